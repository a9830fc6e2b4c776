#!/usr/bin/env bash
# Session 24, call 7: the GPU tests the c6 suite did not reach (rollout, bench, policies) and the chain's own, then the
# engine A/B at batches 16, 32 and 128 (PDL_CHAIN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=300 TEST_FILES="tests/kernels/test_pdl_gemm.py tests/rollout tests/bench tests/policies" \
  ROWS="${ROWS:-longflow:16 longflow:32 longflow:128}" FLAG=PDL_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-400
rm -f $OUT/engine_*.log
