#!/usr/bin/env bash
# Session 28, call 2: (1) the CPU-tensor audit: tests/kernels and tests/bench without the gpu marker, plainly, with
# cpu_tensor_audit.py failing a kernel launch on CPU tensors before its compile; (2) the new SHAPE_TILES entries
# (c1's probe) in the engine: LongFlow at batch 128 on Qwen3-0.6B and Llama-3.2-1B, SHAPE_CHAIN = False the old.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
PYTHONPATH=$PYTHONPATH:$PWD/docs/benchmarks/raw/s28 timeout ${AUDIT_S:-200} python -m pytest -q -rf -p cpu_tensor_audit \
  -m "not gpu" tests/kernels tests/bench -p no:cacheprovider > $OUT/audit.log 2>&1
echo "audit $((SECONDS - t0)) s"; grep -E "^FAILED|^ERROR" $OUT/audit.log | sed 's/\[.*//; s/ - .*//' | sort | uniq -c; tail -1 $OUT/audit.log
for spec in ${ARCH_ROWS:-qwen3-0.6b:longflow:128 llama-3.2-1b:longflow:128}; do
  ARCH=${spec%%:*} ROWS=${spec#*:} FLAG=SHAPE_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|nvjet|silu" \
    ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-150} bash docs/benchmarks/raw/s23/calls.sh
  mv $OUT/new.jsonl $OUT/${spec//:/_}_new.jsonl; mv $OUT/old.jsonl $OUT/${spec//:/_}_old.jsonl
done
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
