#!/usr/bin/env bash
# Session 31, call 2: the residual adds in o's and down's GEMMs and the RMSNorms in gate_up's and qkv's
# (pdl_gemm.NORM_FUSION; no add_rms_norm in a chained layer) checked and measured: the chain's GPU tests, then
# LongFlow (and Hard-KV) new / old (NORM_FUSION = False: add_rms_norm between them, sessions 24-30).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 220 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -25 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
ab() { FLAG=NORM_FUSION FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|norm" ENGINE_TIMEOUT=110 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
for spec in "qwen3-1.7b longflow:8" "qwen3-1.7b longflow:64" "qwen3-1.7b longflow:1" "qwen3-1.7b longflow:128" "qwen3-4b longflow:16" "qwen3-1.7b hardkv:64"; do
  if (( SECONDS > 520 )); then echo "skip $spec (time)"; continue; fi
  arch=${spec%% *}; rows=${spec#* }
  ab env ARCH=$arch ROWS="$rows"
  cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${arch}_${rows%%:*}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
  echo "$spec done $((SECONDS - t0)) s"
done
cp $OUT/engine_*.log $OUT/ab/ 2>/dev/null; rm -f $OUT/engine_*.log
tar czf $OUT/c2.tgz -C $OUT ab gpu_tests.log; rm -rf $OUT/ab
