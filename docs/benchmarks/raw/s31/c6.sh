#!/usr/bin/env bash
# Session 31, call 6: the chained decode kernel asks L2 for its programs' K and V lines before its wait, at <= 64
# (slot, KV head) rows (decode_attention.ATTN_PREFETCH: in the long tail its programs launch while the short rotary
# kernel runs and the memory is idle). The decode kernel's and the chain's GPU tests with it, then LongFlow new /
# old (ATTN_PREFETCH = False) at batches 1, 4 and 8 of Qwen3-1.7B, 1 of Llama-3.2-1B (head_dim 64) and 8 of Qwen3-4B.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 200 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py tests/kernels/test_decode_attention.py -k "pdl or programmatic or chain" -p no:cacheprovider 2>&1 | tail -8 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
ab() { FLAG=ATTN_PREFETCH FLAG_FILE=kvroll/kernels/decode_attention.py KERNELS="decode|rotary" ENGINE_TIMEOUT=110 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
for spec in "qwen3-1.7b longflow:1" "qwen3-1.7b longflow:8" "llama-3.2-1b longflow:1" "qwen3-1.7b longflow:4" "qwen3-4b longflow:8"; do
  if (( SECONDS > 500 )); then echo "skip $spec (time)"; continue; fi
  arch=${spec%% *}; rows=${spec#* }
  ab env ARCH=$arch ROWS="$rows"
  cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${arch}_${rows%%:*}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
  echo "$spec done $((SECONDS - t0)) s"
done
cp $OUT/engine_*.log $OUT/ab/ 2>/dev/null; rm -f $OUT/engine_*.log
tar czf $OUT/c6.tgz -C $OUT ab gpu_tests.log; rm -rf $OUT/ab
