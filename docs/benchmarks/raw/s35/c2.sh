#!/usr/bin/env bash
# Session 35, call 2: Hard-KV's keep kernel (kvroll/kernels/hardkv_keep.py, ``HardKVPolicy.keep_kernel``) against
# the torch path ("old": the switch off). Its GPU tests and the layer-batched events' file; one event by kernel at
# 256 and 64 slots, 28 layers, both arms (checksums: the same tokens kept?); the engine's Hard-KV rows at batches
# 256 and 64, one run per arm.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
F=kvroll/policies/hardkv.py
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_hardkv_keep.py tests/kernels/test_compact.py tests/rollout/test_graphs.py -p no:cacheprovider > $OUT/c2/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c2/gpu_tests.log
for arm in new old; do
  if [[ $arm == new ]]; then sed -i "s/^    keep_kernel = False/    keep_kernel = True/" $F; else sed -i "s/^    keep_kernel = True/    keep_kernel = False/" $F; fi
  grep -c "^    keep_kernel = True" $F
  timeout 120 python benchmarks/event_profile.py --policies hardkv --slots 256,64 --layers 28 --top 12 --label $arm --out $OUT/c2/event_$arm.json > $OUT/c2/event_$arm.log 2>&1
  echo "event $arm rc $? at $((SECONDS - t0)) s"
done
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
for spec in "hardkv 256" "hardkv 64"; do
  set -- $spec
  for arm in new old; do
    if (( SECONDS - t0 > 500 )); then echo "skip $spec $arm (time)"; continue; fi
    if [[ $arm == new ]]; then sed -i "s/^    keep_kernel = False/    keep_kernel = True/" $F; else sed -i "s/^    keep_kernel = True/    keep_kernel = False/" $F; fi
    eng $1 $2 $arm
    echo "$spec $arm at $((SECONDS - t0)) s"
  done
done
sed -i "s/^    keep_kernel = False/    keep_kernel = True/" $F
python - <<'PY'
import json, os
out = os.environ["OUT"] + "/c2/"
for arm in ("new", "old"):
    p = out + f"event_{arm}.json"
    if os.path.exists(p):
        d = json.load(open(p))
        for r in (d if isinstance(d, list) else d.get("rows", [])):
            print(arm, r["slots"], "graph ms", round(r["graph_ms"], 3), "kernels", r["kernels"], r.get("graph_checksum"))
p = out + "engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4),
          r["kernels_per_step"], "event ms", round(r.get("event_ms_median", 0), 2), "pure", round(r.get("pure_step_ms", 0), 4), "share", round(r.get("policy_share", 0), 4))
PY
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
