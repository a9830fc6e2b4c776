#!/usr/bin/env bash
# Session 24, call 12: after the review fixes (add_rms_norm in the chain at batches 33-64 too), the chain's GPU tests
# and the engine A/B at batches 48 and 64 (PDL_CHAIN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=200 TEST_FILES="tests/kernels/test_pdl_gemm.py" \
ROWS="${ROWS:-longflow:48 longflow,snapkv:64}" FLAG=PDL_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
tail -15 $OUT/gpu_tests.log | grep -E "passed|failed|Error|assert" | head -8
rm -f $OUT/engine_*.log
