#!/usr/bin/env bash
# Session 25, call 8: the final code (the scan on by default, 2 stages): the R-KV kernel's, policies' and rollout's
# GPU tests, then R-KV at batches 64 and 256.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=200 TEST_FILES="tests/kernels/test_rkv_redundancy.py tests/policies tests/rollout" \
  ROWS="${ROWS:-rkv:64 rkv:256}" KERNELS="decode" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
grep -E "passed|failed|Error|assert" $OUT/gpu_tests.log | head -8
rm -f $OUT/engine_*.log
