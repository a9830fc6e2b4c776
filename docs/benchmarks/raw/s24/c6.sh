#!/usr/bin/env bash
# Session 24, call 6: the whole GPU suite on the chain's final code, then the engine A/B at batches 8 and 128
# (PDL_CHAIN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
SUITE=1 ROWS="${ROWS:-longflow:8 longflow:128}" FLAG=PDL_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm|nvjet" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-500
rm -f $OUT/engine_*.log
