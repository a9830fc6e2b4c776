#!/usr/bin/env bash
# Session 43, call 9 (nvidia-h200): the batched prefill's final code (after the review: pads zeroed, a long prompt
# no longer stops the batching behind it): the probe again, the prefill tests and the engine's GPU tests, plainly.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 110 python benchmarks/prefill_probe.py --out $OUT 2>&1 | grep -v Warning | grep "^{"
t0=$SECONDS
timeout 60 python -m pytest -q -rfE -p no:cacheprovider tests/rollout/test_prefill_batch.py > $OUT/prefill_tests.log 2>&1
echo "prefill tests rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/prefill_tests.log
timeout 80 python -m pytest -q -rfE -p no:cacheprovider -m gpu tests/rollout/test_engine.py > $OUT/gpu_tests.log 2>&1
echo "engine gpu tests rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/gpu_tests.log
