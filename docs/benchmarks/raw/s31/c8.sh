#!/usr/bin/env bash
# Session 31, call 8: a chained layer's qkv GEMM asks L2 for o's whole weight and the first 16 MB of gate_up's at
# its programs' end with Hopper's bulk prefetch (cp.async.bulk.prefetch.L2; call 7: it lands where the per-line
# prefetch of sessions 24-31 lands only in part), so that the bytes stream while the rotary and the decode kernel
# leave the memory idle (pdl_gemm.NEXT_PREFETCH, <= 64 rows). The chain's GPU tests with it, then LongFlow arms
# interleaved per spec: gate_up's 16 MB (g16), o only (g0), none (off).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
F=kvroll/kernels/pdl_gemm.py
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
echo "tests $((SECONDS - t0)) s"
mkdir -p $OUT/ab
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture $1 --policies $2 --budgets 1024 --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/ab/engine_$1_$3_$4.log 2>&1; sed "s/^{/{\"arm\": \"$4\", /" $OUT/bench/measurements.jsonl >> $OUT/ab/$1_$2_$3.jsonl; rm -rf $OUT/bench; }
arm() { case $1 in off) sed -i "s/^NEXT_PREFETCH = True /NEXT_PREFETCH = False /" $F;; g*) sed -i "s/^NEXT_PREFETCH = False /NEXT_PREFETCH = True /; s/^NEXT_PREFETCH_GATE_UP = [0-9]* << 20 /NEXT_PREFETCH_GATE_UP = ${1#g} << 20 /" $F;; esac; }
for spec in "qwen3-1.7b longflow 1" "qwen3-1.7b longflow 8" "qwen3-1.7b longflow 32" "qwen3-1.7b longflow 64"; do
  set -- $spec
  for a in g16 off g0; do
    if (( SECONDS > 530 )); then echo "skip $spec $a (time)"; continue; fi
    arm $a; eng $1 $2 $3 $a; echo "$spec $a $((SECONDS - t0)) s"
  done
done
arm g16
python - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/ab/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"],
              [(k[0][:14], k[1], round(k[2], 1)) for k in r["top_kernels"][:3]])
PY
tar czf $OUT/c8.tgz -C $OUT ab gpu_tests.log; rm -rf $OUT/ab
