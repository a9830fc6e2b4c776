#!/usr/bin/env bash
# Session 28, call 4: the failing tests of c3's audit whose logs did not come back (tests/bench's fused-switch and
# dev-benchmark files), then the new SHAPE_TILES ranges at their other ends: Qwen3-0.6B and Llama-3.2-1B at
# batch 80 (two row tiles, the second part full), Qwen3-8B at batch 40 (SHAPE_CHAIN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
for f in tests/bench/test_fused_switch.py tests/bench/test_dev_benchmarks.py; do
  PYTHONPATH=$PYTHONPATH:$PWD/docs/benchmarks/raw/s28 timeout 150 python -m pytest -q -x -p cpu_tensor_audit -m "not gpu" $f \
    -p no:cacheprovider 2>&1 | grep -v "^\s*$" | tail -40 > $OUT/audit_$(basename $f .py).log
done
ARCH_ROWS=${ARCH_ROWS:-"qwen3-0.6b:longflow:80 llama-3.2-1b:longflow:80 qwen3-8b:longflow:40"}
for spec in $ARCH_ROWS; do
  ARCH=${spec%%:*} ROWS=${spec#*:} FLAG=SHAPE_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|nvjet|silu" \
    ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-170} bash docs/benchmarks/raw/s23/calls.sh
  mv $OUT/new.jsonl $OUT/${spec//:/_}_new.jsonl; mv $OUT/old.jsonl $OUT/${spec//:/_}_old.jsonl
done
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
