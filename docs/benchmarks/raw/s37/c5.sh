#!/usr/bin/env bash
# Session 37, call 5 (nvidia-h100-x1): the GPU test files call 4 did not reach in its 300 s (test_pdl_gemm,
# test_layer_batched_events), and the engine's tests (greedy full against HF generate among them), plainly.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c5
t0=$SECONDS
for f in tests/kernels/test_pdl_gemm.py tests/kernels/test_layer_batched_events.py tests/rollout/test_engine.py; do
  left=$(( 540 - (SECONDS - t0) )); (( left < 30 )) && { echo "skip $f (time)"; continue; }
  timeout $left python -m pytest -q -rfE -p no:cacheprovider $f > $OUT/c5/$(basename $f .py).log 2>&1
  echo "$f rc $? at $((SECONDS - t0)) s: $(tail -1 $OUT/c5/$(basename $f .py).log)"
done
tar czf $OUT/c5.tgz -C $OUT c5 gpu.txt; rm -rf $OUT/c5
