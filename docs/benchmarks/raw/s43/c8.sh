#!/usr/bin/env bash
# Session 43, call 8 (nvidia-h200): the policies' and the bench's GPU tests plainly on the batched prefill's code
# (the engine's ran in call 7).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 250 python -m pytest -q -rfE -p no:cacheprovider -m gpu tests/policies tests/bench > $OUT/gpu_tests.log 2>&1
echo "policies + bench gpu tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/gpu_tests.log
