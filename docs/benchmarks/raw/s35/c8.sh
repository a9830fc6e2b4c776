#!/usr/bin/env bash
# Session 35, call 8: the final code (the keep and calibration kernels, hole filling, the review's ranking by value):
# the keep kernel's GPU tests and the compaction tests plainly; the engine's Hard-KV rows at batches 256 and 64 and
# R-KV's at 256 (its events untouched: the cache's time_ordered property and compress_index's order flag).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c8
t0=$SECONDS
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_hardkv_keep.py tests/rollout/test_graphs.py -p no:cacheprovider > $OUT/c8/gpu_tests.log 2>&1
echo "gpu tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c8/gpu_tests.log
timeout 100 python -m pytest -q -rfE tests/kernels/test_compact.py tests/kernels/test_layer_batched_events.py -p no:cacheprovider > $OUT/c8/plain_tests.log 2>&1
echo "plain tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c8/plain_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c8/engine_$1_$2.log 2>&1; sed "s/^{/{\"arm\": \"final\", /" $OUT/bench/measurements.jsonl >> $OUT/c8/engine.jsonl; rm -rf $OUT/bench; }
for spec in "hardkv 256" "hardkv 64" "rkv 256"; do
  set -- $spec
  if (( SECONDS - t0 > 450 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2; echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c8/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    first = r["policy_s"] * 1e3 - (r["events"] - 1) * r["event_ms_median"]
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          "event ms", round(r["event_ms_median"], 2), "first event ms", round(first, 1), "pure", round(r["pure_step_ms"], 4), "tok/s", round(r["tok_s"]))
PY
tar czf $OUT/c8.tgz -C $OUT c8 gpu.txt; rm -rf $OUT/c8
