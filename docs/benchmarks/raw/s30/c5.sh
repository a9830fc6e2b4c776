#!/usr/bin/env bash
# Session 30, call 5: the committed rules (gemm_signal_early at <= 64 rows, rotary_signal_late): the chain's GPU
# tests, then GEMM_SIGNAL_EARLY on / off at LongFlow batch 48 (Qwen3-1.7B), Qwen3-8B's batch 16 and Hard-KV's 64.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 100 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
ab() { FLAG=GEMM_SIGNAL_EARLY FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" ENGINE_TIMEOUT=100 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
for spec in "qwen3-1.7b longflow:48" "qwen3-8b longflow:16" "qwen3-1.7b hardkv:64"; do
  arch=${spec%% *}; rows=${spec#* }
  ab env ARCH=$arch ROWS="$rows"
  cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${arch}_${rows%%:*}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
  echo "$spec done $((SECONDS - t0)) s"
done
rm -f $OUT/engine_*.log
tar czf $OUT/c5.tgz -C $OUT ab gpu_tests.log; rm -rf $OUT/ab
