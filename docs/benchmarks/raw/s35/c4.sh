#!/usr/bin/env bash
# Session 35, call 4: Hard-KV's compaction by hole filling (``HardKVPolicy.hole_fill``, the attention base:
# kvroll/policies/base.py hole_fill_slots) on top of the keep kernel. Arms: "fill" (both on), "keep" (the keep kernel,
# time-ordered compaction: call 2's "new"), "old" (neither). GPU tests; the event by kernel (4 layers, x7) per arm;
# the engine's Hard-KV row at batch 256 (fill and keep alternating, twice) and at 64 (fill, keep).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c4
t0=$SECONDS
F=kvroll/policies/hardkv.py
setarm() {
  case $1 in
    fill) sed -i "s/^    keep_kernel = False/    keep_kernel = True/; s/^    hole_fill = False/    hole_fill = True/" $F ;;
    keep) sed -i "s/^    keep_kernel = False/    keep_kernel = True/; s/^    hole_fill = True/    hole_fill = False/" $F ;;
    old) sed -i "s/^    keep_kernel = True/    keep_kernel = False/; s/^    hole_fill = True/    hole_fill = False/" $F ;;
  esac
  grep -c "^    keep_kernel = True\|^    hole_fill = True" $F
}
setarm fill
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_hardkv_keep.py tests/kernels/test_compact.py tests/rollout/test_graphs.py tests/rollout/test_schedule.py -p no:cacheprovider > $OUT/c4/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c4/gpu_tests.log
for arm in fill keep old; do
  setarm $arm
  timeout 100 python benchmarks/event_profile.py --policies hardkv --slots 256 --layers 4 --top 12 --label $arm --out $OUT/c4/event_$arm.json > $OUT/c4/event_$arm.log 2>&1
  echo "event $arm rc $? at $((SECONDS - t0)) s"
done
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c4/engine_$1_$2_$3_$4.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c4/engine.jsonl; rm -rf $OUT/bench; }
for spec in "256 fill 1" "256 keep 1" "256 fill 2" "256 keep 2" "64 fill 1" "64 keep 1"; do
  set -- $spec
  if (( SECONDS - t0 > 520 )); then echo "skip $spec (time)"; continue; fi
  setarm $2 > /dev/null; eng hardkv $1 $2 $3
  echo "hardkv $spec at $((SECONDS - t0)) s"
done
setarm fill
python - <<'PY'
import json, os
out = os.environ["OUT"] + "/c4/"
for arm in ("fill", "keep", "old"):
    p = out + f"event_{arm}.json"
    for r in (json.load(open(p)) if os.path.exists(p) else []):
        print(arm, r["slots"], "graph ms x7", round(r["graph_ms"] * 7, 2), "kernels", r["kernels"], r.get("graph_checksum"))
        for k, v in list(r["top"].items())[:4]:
            print("   %8.3f ms %4d  %s" % (v["us"] / 1e3 * 7, v["calls"], k[:90]))
p = out + "engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4),
          "event ms", round(r.get("event_ms_median", 0), 2), "pure", round(r.get("pure_step_ms", 0), 4), "live", round(r["mean_live_tokens"], 2))
PY
tar czf $OUT/c4.tgz -C $OUT c4 gpu.txt; rm -rf $OUT/c4
