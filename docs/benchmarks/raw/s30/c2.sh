#!/usr/bin/env bash
# Session 30, call 2: the committed rule (pdl_gemm.rotary_signal_late: the rotary signals the decode kernel at each
# program's end where session 28's early signal lost, and the decode kernel is then a PDL launch) checked and
# measured. The GPU tests of the chain and the rotary kernel, then LongFlow (and Hard-KV) new / old
# (ROTARY_LATE = False: session 28's rule) at points where the rule changes the launch (Qwen3-1.7B at 16, Qwen3-4B
# at 32, Llama-3.2-1B at 48, Qwen3-0.6B at 32, Hard-KV at 32) and one where it does not (Qwen3-1.7B at 64).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 200 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py tests/kernels/test_rotary.py -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
ab() { FLAG=ROTARY_LATE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|rotary" ENGINE_TIMEOUT=120 "$@" bash docs/benchmarks/raw/s23/calls.sh; }
for spec in "qwen3-1.7b longflow:16" "qwen3-4b longflow:32" "llama-3.2-1b longflow:48" "qwen3-0.6b longflow:32" "qwen3-1.7b hardkv:32" "qwen3-1.7b longflow:64"; do
  arch=${spec%% *}; rows=${spec#* }
  ab env ARCH=$arch ROWS="$rows"
  cat $OUT/new.jsonl $OUT/old.jsonl > $OUT/ab/${arch}_${rows%%:*}_${rows##*:}.jsonl; rm -f $OUT/new.jsonl $OUT/old.jsonl
  echo "$spec done $((SECONDS - t0)) s"
done
cp $OUT/engine_*.log $OUT/ab/ 2>/dev/null; rm -f $OUT/engine_*.log
tar czf $OUT/c2.tgz -C $OUT ab gpu_tests.log; rm -rf $OUT/ab
