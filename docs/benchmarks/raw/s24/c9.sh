#!/usr/bin/env bash
# Session 24, call 9: is the decode kernel's PDL launch what slows the chain at batches 16 and 32? A/B of ATTN_PDL
# (False the old) at 16, 32, 64; then the chain's A/B (PDL_CHAIN) at batch 48.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
run() {  # tag flag rows
  mkdir -p /tmp/o_$1; OUT=/tmp/o_$1 ROWS="$3" FLAG=$2 FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" \
    bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
  for t in new old; do cp /tmp/o_$1/$t.jsonl $OUT/$1_$t.jsonl 2>/dev/null; done
}
run a ATTN_PDL "longflow:16 longflow:32 longflow:64"
run b PDL_CHAIN "longflow:48"
