#!/usr/bin/env bash
# Session 30, call 4: GEMM_SIGNAL_EARLY (c3: LongFlow at batch 16 3.1% shorter, at 64 0.1%) as committed code (on),
# against it off (old): the chain's GPU tests, then LongFlow at Qwen3-1.7B's batches 1, 8, 32 and 128, Qwen3-4B's
# and Llama-3.2-1B's 16.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
ab() { FLAG=GEMM_SIGNAL_EARLY FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm" ENGINE_TIMEOUT=120 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
for spec in "qwen3-1.7b longflow:1" "qwen3-1.7b longflow:8" "qwen3-1.7b longflow:32" "qwen3-1.7b longflow:128" "qwen3-4b longflow:16" "llama-3.2-1b longflow:16"; do
  arch=${spec%% *}; rows=${spec#* }
  ab env ARCH=$arch ROWS="$rows"
  cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${arch}_${rows%%:*}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
  echo "$spec done $((SECONDS - t0)) s"
done
rm -f $OUT/engine_*.log
tar czf $OUT/c4.tgz -C $OUT ab gpu_tests.log; rm -rf $OUT/ab
