#!/usr/bin/env bash
# Session 35, call 7: the new rows' temperatures in one kernel (``hardkv_calibrate``; ``HardKVPolicy.calibrate_kernel``)
# against the torch path's bisection on those rows ("old"): the keep kernel's GPU tests (16 new rows of 64), then the
# engine's Hard-KV rows at batches 256 and 64, one run per arm: the first event of every sequence calibrates.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c7
t0=$SECONDS
F=kvroll/policies/hardkv.py
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_hardkv_keep.py -p no:cacheprovider > $OUT/c7/gpu_tests.log 2>&1
echo "gpu tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c7/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c7/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c7/engine.jsonl; rm -rf $OUT/bench; }
for spec in "256 new" "256 old" "64 new" "64 old"; do
  set -- $spec
  if (( SECONDS - t0 > 480 )); then echo "skip $spec (time)"; continue; fi
  if [[ $2 == new ]]; then sed -i "s/^    calibrate_kernel = False/    calibrate_kernel = True/" $F; else sed -i "s/^    calibrate_kernel = True/    calibrate_kernel = False/" $F; fi
  eng hardkv $1 $2; echo "hardkv $spec at $((SECONDS - t0)) s"
done
sed -i "s/^    calibrate_kernel = False/    calibrate_kernel = True/" $F
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c7/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    first = r["policy_s"] * 1e3 - (r["events"] - 1) * r["event_ms_median"]
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4),
          "event ms", round(r["event_ms_median"], 2), "first event ms", round(first, 1), "policy_s", round(r["policy_s"], 4),
          "wall", round(r["wall_s"], 3), "e2e tok/s", round(r["e2e_tok_s"]), "tok/s", round(r["tok_s"]))
PY
tar czf $OUT/c7.tgz -C $OUT c7 gpu.txt; rm -rf $OUT/c7
