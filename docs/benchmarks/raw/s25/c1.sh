#!/usr/bin/env bash
# Session 25, call 1: the GPU tests on session 24's final code (the chain's engine test that c12 failed and was fixed
# after it, rollout, policies), then R-KV / LagKV / Hard-KV at batch 64 with the chain (new code only, no A/B).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=300 TEST_FILES="tests/kernels/test_pdl_gemm.py tests/rollout tests/policies" \
  ROWS="${ROWS:-rkv,lagkv,hardkv:64}" KERNELS="decode|gemm" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-400
grep -E "passed|failed|Error|assert" $OUT/gpu_tests.log | head -8
rm -f $OUT/engine_*.log
