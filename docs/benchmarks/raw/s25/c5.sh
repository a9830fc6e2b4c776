#!/usr/bin/env bash
# Session 25, call 5: the kernels' GPU tests on the final code (session 24's last commit passed the chain's keywords
# plainly to add_rms_norm / rotary / silu_mul and was not run on a GPU), then LagKV and Hard-KV at batch 64 again.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=330 TEST_FILES="tests/kernels tests/bench" \
  ROWS="${ROWS:-lagkv,hardkv,rkv:64}" KERNELS="decode" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
grep -E "passed|failed|Error|assert" $OUT/gpu_tests.log | head -8
rm -f $OUT/engine_*.log
