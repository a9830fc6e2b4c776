#!/usr/bin/env bash
# Session 24, call 10: the final rule (attention_pdl) against PDL_CHAIN = False at batches 16, 32, 48; the chain's GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=150 TEST_FILES="tests/kernels/test_pdl_gemm.py" \
ROWS="${ROWS:-longflow:16 longflow:32 longflow:48}" FLAG=PDL_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
rm -f $OUT/engine_*.log
