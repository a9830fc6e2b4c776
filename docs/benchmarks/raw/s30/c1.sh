#!/usr/bin/env bash
# Session 30, call 1. (1) benchmarks/hardkv_rows_probe.py: Hard-KV's decode kernel on the per-head live counts of a
# real run (batch 64), the rows' order and launch knobs. (2) Session 29's c9 A/B finished (raw/s29/
# rotary_late_signal.patch applied here only): the rotary kernel signals the decode kernel at each program's end
# and the decode kernel is a PDL launch in every chained layer (ROTARY_SIGNAL_LATE), against session 28's rule
# (old): Qwen3-1.7B at batches 32 and 48, Llama-3.2-1B and Qwen3-4B at 64. Outputs tarred (a call returns 8 files).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 200 python benchmarks/hardkv_rows_probe.py --out $OUT 2>&1 | tail -30 > $OUT/probe.log; cat $OUT/probe.log
echo "probe $((SECONDS - t0)) s"
patch -p1 < docs/benchmarks/raw/s29/rotary_late_signal.patch
mkdir -p $OUT/ab
ab() { FLAG=ROTARY_SIGNAL_LATE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|rotary" ENGINE_TIMEOUT=120 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
for spec in "qwen3-1.7b longflow:32" "qwen3-1.7b longflow:48" "llama-3.2-1b longflow:64" "qwen3-4b longflow:64"; do
  arch=${spec%% *}; rows=${spec#* }
  ab env ARCH=$arch ROWS="$rows"
  cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${arch}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
  echo "$spec done $((SECONDS - t0)) s"
done
cp $OUT/engine_*.log $OUT/ab/ 2>/dev/null; rm -f $OUT/engine_*.log
tar czf $OUT/c1.tgz -C $OUT ab probe.log; rm -rf $OUT/ab
