#!/usr/bin/env bash
# Session 31, call 1: the chain's GPU tests (session 30's engine assertions of the decode kernel's chain_pdl had not
# run on a GPU), then the chained GEMM's L2 prefetch of its first K steps before its wait (pdl_gemm.GEMM_PREFETCH,
# PREFETCH_STEPS 2 and 4) against none, LongFlow, one engine run per arm, arms interleaved per spec.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
F=kvroll/kernels/pdl_gemm.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 170 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture $1 --policies $2 --budgets 1024 --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/ab/engine_$1_$3_$4.log 2>&1; cat $OUT/bench/measurements.jsonl | sed "s/^{/{\"arm\": \"$4\", /" >> $OUT/ab/$1_$2_$3.jsonl; rm -rf $OUT/bench; }
arm() { case $1 in off) sed -i "s/^GEMM_PREFETCH = True /GEMM_PREFETCH = False /" $F;; p*) sed -i "s/^GEMM_PREFETCH = False /GEMM_PREFETCH = True /; s/^PREFETCH_STEPS = [0-9]* /PREFETCH_STEPS = ${1#p} /" $F;; esac; }
for spec in "qwen3-1.7b longflow 8" "qwen3-1.7b longflow 64" "qwen3-1.7b longflow 32" "qwen3-4b longflow 16"; do
  set -- $spec
  for a in p2 off p4; do
    if (( SECONDS > 500 )); then echo "skip $spec $a (time)"; continue; fi
    arm $a; eng $1 $2 $3 $a; echo "$spec $a $((SECONDS - t0)) s"
  done
done
arm p2
python - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/ab/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(r["arm"], r.get("architecture", ""), r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"],
              [(k[0][:14], k[1], round(k[2], 1)) for k in r["top_kernels"][:4]])
PY
tar czf $OUT/c1.tgz -C $OUT ab gpu_tests.log gpu.txt; rm -rf $OUT/ab
