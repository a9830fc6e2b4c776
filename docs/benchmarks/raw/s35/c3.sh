#!/usr/bin/env bash
# Session 35, call 3: Hard-KV's event by kernel with the keep kernel ("new") and without ("old"), 4 layers (x7 for
# 28; call 2's 28-layer run ran out of memory in its checksum), at 256 and 64 slots; then the engine's Hard-KV row at
# batch 256 twice more per arm, alternating (the floor's spread between runs).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3
t0=$SECONDS
F=kvroll/policies/hardkv.py
setarm() { if [[ $1 == new ]]; then sed -i "s/^    keep_kernel = False/    keep_kernel = True/" $F; else sed -i "s/^    keep_kernel = True/    keep_kernel = False/" $F; fi; }
for arm in new old; do
  setarm $arm
  timeout 120 python benchmarks/event_profile.py --policies hardkv --slots 256,64 --layers 4 --top 25 --label $arm --out $OUT/c3/event_$arm.json > $OUT/c3/event_$arm.log 2>&1
  echo "event $arm rc $? at $((SECONDS - t0)) s"
done
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c3/engine_$1_$2_$3_$4.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c3/engine.jsonl; rm -rf $OUT/bench; }
for rep in 1 2; do
  for arm in old new; do
    if (( SECONDS - t0 > 480 )); then echo "skip $rep $arm (time)"; continue; fi
    setarm $arm; eng hardkv 256 $arm $rep
    echo "hardkv 256 $arm $rep at $((SECONDS - t0)) s"
  done
done
setarm new
python - <<'PY'
import json, os
out = os.environ["OUT"] + "/c3/"
for arm in ("new", "old"):
    p = out + f"event_{arm}.json"
    for r in (json.load(open(p)) if os.path.exists(p) else []):
        print(arm, r["slots"], "graph ms x7", round(r["graph_ms"] * 7, 2), "kernels", r["kernels"], r.get("graph_checksum"))
        for k, v in list(r["top"].items())[:10]:
            print("   %8.3f ms %4d  %s" % (v["us"] / 1e3 * 7, v["calls"], k[:90]))
p = out + "engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4),
          "event ms", round(r.get("event_ms_median", 0), 2), "pure", round(r.get("pure_step_ms", 0), 4), "live", round(r["mean_live_tokens"], 2))
PY
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
