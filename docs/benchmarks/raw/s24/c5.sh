#!/usr/bin/env bash
# Session 24, call 5: o / down as the chain's split GEMM (tile sweep), then the engine A/B of the whole chain
# (a_: PDL_CHAIN = False the old) and of the split GEMMs alone (b_: SPLIT_CHAIN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 150 python benchmarks/pdl_gemm_probe.py --split --rows 1,8,64 --out $OUT 2>&1 | grep split
run() {  # tag flag rows
  mkdir -p /tmp/o_$1; OUT=/tmp/o_$1 ROWS="$3" FLAG=$2 FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm|nvjet" \
    bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-400
  for t in new old; do cp /tmp/o_$1/$t.jsonl $OUT/$1_$t.jsonl 2>/dev/null; done
  tail -3 /tmp/o_$1/engine_new.log | grep -i -E "error|Traceback" | head -3
}
run a PDL_CHAIN "${ROWS_A:-longflow,snapkv,hardkv:64 longflow:1}"
run b SPLIT_CHAIN "${ROWS_B:-longflow:64}"
