#!/usr/bin/env bash
# Session 31, call 5: call 1's L2 prefetch before the wait (raw/s31/gemm_prefetch.patch) only in o's and down's GEMMs
# (2 K slices; their predecessors, the decode kernel and gate_up, stream memory, where qkv's and gate_up's,
# add_rms_norm, are short and latency-bound): PREFETCH_STEPS 2 and 8 (o's whole slice of 8 steps of 128, 8 of
# down's 12 of 256), and (r1, GEMM_PRELOAD) o's and down's first weight tile loaded into registers before the wait
# (no prefetch), against none, LongFlow, one engine run per arm, arms interleaved per spec. The chain's GPU tests
# first.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
F=kvroll/kernels/pdl_gemm.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
sed -i 's/^GEMM_PRELOAD = False /GEMM_PRELOAD = True /' $F
timeout 170 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture $1 --policies $2 --budgets 1024 --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/ab/engine_$1_$3_$4.log 2>&1; cat $OUT/bench/measurements.jsonl | sed "s/^{/{\"arm\": \"$4\", /" >> $OUT/ab/$1_$2_$3.jsonl; rm -rf $OUT/bench; }
arm() { sed -i "s/^GEMM_PRELOAD = True /GEMM_PRELOAD = False /" $F; case $1 in off) sed -i "s/^GEMM_PREFETCH = True /GEMM_PREFETCH = False /" $F;; p*) sed -i "s/^GEMM_PREFETCH = False /GEMM_PREFETCH = True /; s/^PREFETCH_STEPS = [0-9]* /PREFETCH_STEPS = ${1#p} /" $F;; r1) sed -i "s/^GEMM_PREFETCH = True /GEMM_PREFETCH = False /; s/^GEMM_PRELOAD = False /GEMM_PRELOAD = True /" $F;; esac; grep -E "^(GEMM_PREFETCH|PREFETCH_STEPS|GEMM_PRELOAD) " $F | tr '\n' ' '; echo; }
for spec in "qwen3-1.7b longflow 64" "qwen3-1.7b longflow 8" "qwen3-1.7b longflow 32" "qwen3-4b longflow 16"; do
  set -- $spec
  for a in p2 off r1 p8; do
    if (( SECONDS > 540 )); then echo "skip $spec $a (time)"; continue; fi
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
tar czf $OUT/c5.tgz -C $OUT ab gpu_tests.log gpu.txt; rm -rf $OUT/ab
