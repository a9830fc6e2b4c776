#!/usr/bin/env bash
# Session 30, call 3: two more signal placements in the chain (raw/s30/signals.patch, applied here only), each an
# A/B against the committed code (the flag off): GEMM_SIGNAL_EARLY (each chained GEMM lets its successor launch right
# after its wait, not after its K loop) and NORM_SIGNAL_LATE (add_rms_norm lets its successor launch at each
# program's end, not at once). LongFlow, Qwen3-1.7B, batches 16 and 64.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
patch -p1 < docs/benchmarks/raw/s30/signals.patch
mkdir -p $OUT/ab
for flag in GEMM_SIGNAL_EARLY:kvroll/kernels/pdl_gemm.py NORM_SIGNAL_LATE:kvroll/kernels/add_rms_norm.py; do
  for rows in longflow:16 longflow:64; do
    FLAG=${flag%%:*} FLAG_FILE=${flag#*:} KERNELS="decode|gemm|add_rms" ENGINE_TIMEOUT=120 ROWS=$rows bash docs/benchmarks/raw/s23/calls.sh
    cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${flag%%:*}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
    echo "$flag $rows done $((SECONDS - t0)) s"
  done
done
rm -f $OUT/engine_*.log
tar czf $OUT/c3.tgz -C $OUT ab; rm -rf $OUT/ab
