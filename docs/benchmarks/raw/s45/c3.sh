#!/usr/bin/env bash
# Session 45, call 3 (nvidia-h200): issue 16's section 4 rows re-measured on main after sessions 43-45 (the batched prefill, the review fixes; the kernels are
# session 42's), one run each: LongFlow at 64 / 128 / 256, SnapKV / R-KV / LagKV / Hard-KV at 64, Hard-KV at 256.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3
t0=$SECONDS
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c3/engine_$1_$2.log 2>&1; sed "s/^{/{\"arm\": \"main\", /" $OUT/bench/measurements.jsonl >> $OUT/c3/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64" "longflow 128" "longflow 256" "snapkv 64" "rkv 64" "lagkv 64" "hardkv 64" "hardkv 256"; do
  set -- $spec
  if (( SECONDS - t0 > 480 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2; echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c3/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["policy"], r["batch"], round(r.get("steady_step_ms") or 0, 4), round(r.get("floor_step_ms") or 0, 4), round(r.get("step_over_floor") or 0, 4), r.get("kernels_per_step"), round(r.get("policy_frac") or 0, 4))
PY
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
