#!/usr/bin/env bash
# Session 34, call 7: the final code (the inverse CDF on, the mass kernel at 1024:1:2:48): the sampler's and the
# engine's GPU tests, then the engine's rows of issue 16's table above 64 rows on the final shape, one run each.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c7
t0=$SECONDS
timeout 200 python -m pytest -q -m gpu tests/kernels/test_sample.py tests/kernels/test_head_sample.py tests/rollout/test_graphs.py -p no:cacheprovider > $OUT/c7/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c7/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c7/engine_$1_$2.log 2>&1; sed "s/^{/{\"arm\": \"icdf\", /" $OUT/bench/measurements.jsonl >> $OUT/c7/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 128" "longflow 256" "hardkv 256" "rkv 256"; do
  set -- $spec
  if (( SECONDS - t0 > 480 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2
  echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c7/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "mass" in k[0] or "pick" in k[0] or "chunk" in k[0] or "merge" in k[0]])
PY
tar czf $OUT/c7.tgz -C $OUT c7 gpu.txt; rm -rf $OUT/c7
