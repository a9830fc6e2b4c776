#!/usr/bin/env bash
# Session 24, call 8: after the decode kernel stopped signalling early in the long tail, the
# engine A/B at batches 1-64 (PDL_CHAIN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
ROWS="${ROWS:-longflow:1 longflow:8 longflow:16 longflow:32 longflow:64}" FLAG=PDL_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-400
rm -f $OUT/engine_*.log
