#!/usr/bin/env bash
# Session 28, call 3: (1) the CPU-tensor audit of c2 (cpu_tensor_audit.py), one pytest per test file, 8 at a time
# (c2's single run reached a third of the files in 200 s), each test's name and outcome listed; (2) Qwen3-8B at
# batch 64 (33-64 rows, SHAPE_TILES' new entries) against SHAPE_CHAIN = False.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
mkdir -p $OUT/audit
ls tests/kernels/test_*.py tests/bench/test_*.py | PYTHONPATH=$PYTHONPATH:$PWD/docs/benchmarks/raw/s28 \
  timeout ${AUDIT_S:-300} xargs -P 8 -I{} sh -c 'python -m pytest -v -p cpu_tensor_audit -m "not gpu" {} -p no:cacheprovider > $OUT/audit/$(basename {} .py).log 2>&1'
echo "audit $((SECONDS - t0)) s"
grep -h -E " (FAILED|ERROR)" $OUT/audit/*.log | sed 's/\[.*//; s/ FAILED.*//; s/ ERROR.*//' | sort | uniq -c
for f in $OUT/audit/*.log; do echo "$(basename $f): $(tail -1 $f)"; done
for spec in ${ARCH_ROWS:-qwen3-8b:longflow:64}; do
  ARCH=${spec%%:*} ROWS=${spec#*:} FLAG=SHAPE_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|nvjet|silu" \
    ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-170} bash docs/benchmarks/raw/s23/calls.sh
  mv $OUT/new.jsonl $OUT/${spec//:/_}_new.jsonl; mv $OUT/old.jsonl $OUT/${spec//:/_}_old.jsonl
done
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
