#!/usr/bin/env bash
# Session 47, call 2 (nvidia-h200): after the engine's split (rollout/engine.py + rollout/scheduler.py: GenerateRun),
# the GPU tests of the engine, bench and policies, then issue 16's LongFlow rows at 64 / 128 and Hard-KV at 64 (session
# 45's call 3 setup: Qwen3-1.7B architecture, random weights, prompt 512, 4,096 new tokens, budget 1,024), one run each.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 300 python -m pytest -q -rfEs -m gpu tests/rollout tests/bench tests/policies -p no:cacheprovider \
    --durations=5 > $OUT/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -3
mkdir -p $OUT/c2
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2.log 2>&1; sed "s/^{/{\"arm\": \"main\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64" "hardkv 64" "longflow 128"; do
  set -- $spec
  if (( SECONDS - t0 > 470 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2; echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c2/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["policy"], r["batch"], round(r.get("steady_step_ms") or 0, 4), round(r.get("floor_step_ms") or 0, 4), round(r.get("step_over_floor") or 0, 4), r.get("kernels_per_step"), round(r.get("policy_frac") or 0, 4))
PY
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
