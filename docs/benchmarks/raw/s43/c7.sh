#!/usr/bin/env bash
# Session 43, call 7 (nvidia-h200): the batched prefill (engine._prefill_many) on the GPU: call 6's probe again, then
# the engine's GPU tests and the new prefill tests, plainly.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 130 python benchmarks/prefill_probe.py --out $OUT 2>&1 | grep -v Warning | grep "^{" 
t0=$SECONDS
timeout 120 python -m pytest -q -rfE -p no:cacheprovider tests/rollout/test_prefill_batch.py > $OUT/prefill_tests.log 2>&1
echo "prefill tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/prefill_tests.log
timeout 200 python -m pytest -q -rfE -p no:cacheprovider -m gpu tests/rollout > $OUT/gpu_tests.log 2>&1
echo "rollout gpu tests rc $? at $((SECONDS - t0)) s"; tail -5 $OUT/gpu_tests.log
