#!/usr/bin/env bash
# Session 32, call 1: issue 16's engine table re-measured on main in one lease (no A/B, no code change): LongFlow at
# batches 64 / 128 / 256 / 352, the four periodic policies at 64 and 256, `full` at 64 and 128 (its context sweep up
# to 4.6k tokens). Session 20's setup: Qwen3-1.7B architecture, random bf16 weights, prompt 512, 4,096 new tokens,
# budget 1,024, 512 steady steps, temperature 1. One `kvroll bench` process per group.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c1
t0=$SECONDS
run() {  # $1 tag, $2 policies, $3 batches, $4 timeout
  STAGES=engine ENGINE_TIMEOUT=$4 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $2 --budgets 1024 \
    --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c1/engine_$1.log 2>&1
  cp $OUT/bench/measurements.jsonl $OUT/c1/$1.jsonl; cp $OUT/bench/report.md $OUT/c1/$1_report.md 2>/dev/null
  rm -rf $OUT/bench; echo "$1 done at $((SECONDS - t0)) s"
}
run longflow longflow 64,128,256,352 150
run periodic64 snapkv,rkv,lagkv,hardkv 64 140
run periodic256 snapkv,rkv,lagkv,hardkv 256 170
run full full 64,128 120
python - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/c1/*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print(r["policy"], r["batch"], "ctx", r.get("context_tokens"), round(r.get("steady_step_ms") or 0, 3),
              round(r.get("floor_step_ms") or 0, 3), round(r.get("step_over_floor") or 0, 4), r.get("kernels_per_step"),
              round(r.get("tok_s") or 0))
        if r.get("step_curve"):
            print("   curve [context, step ms, floor ms, ratio]:", [[round(c), round(a, 3), round(b, 3), round(a / b, 3)] for c, a, b in r["step_curve"]])
PY
tar czf $OUT/c1.tgz -C $OUT c1 gpu.txt; rm -rf $OUT/c1
