#!/usr/bin/env bash
# Session 35, call 5: the keep kernel's shape (WAYS thresholds a round : WARPS) swept on one layer of an engine-sized
# event (benchmarks/hardkv_keep_ab.py), the fastest (total over 256 and 64 slots, same output as the first) written
# into kvroll/kernels/hardkv_keep.py; its GPU tests and the compaction tests plainly on the GPU; the engine's Hard-KV
# rows at batches 256 and 64 on it.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c5
t0=$SECONDS
timeout 200 python benchmarks/hardkv_keep_ab.py --out $OUT/c5 --slots 256,64 --variants 2:8,2:4,4:8,4:4,8:8,8:4,16:8,2:16,4:16 > $OUT/c5/ab.log 2>&1
echo "ab rc $? at $((SECONDS - t0)) s"; cat $OUT/c5/ab.log | tail -20
BEST=$(python - <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/c5/hardkv_keep_ab.json"))
tot = {}
for r in rows:
    if r["rows_differing_from_first"] <= 2:
        tot.setdefault((r["ways"], r["warps"]), []).append(r["us"])
best = min((sum(v), k) for k, v in tot.items() if len(v) == 2)[1]
print(f"{best[0]} {best[1]}")
PY
)
echo "best $BEST"
if [[ -n "$BEST" ]]; then set -- $BEST; sed -i "s/^WAYS, WARPS = [0-9]*, [0-9]*  #/WAYS, WARPS = $1, $2  #/" kvroll/kernels/hardkv_keep.py; fi
grep -n "^WAYS, WARPS" kvroll/kernels/hardkv_keep.py
timeout 150 python -m pytest -q -rfE -m gpu tests/kernels/test_hardkv_keep.py -p no:cacheprovider > $OUT/c5/gpu_tests.log 2>&1
echo "gpu tests rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c5/gpu_tests.log
timeout 100 python -m pytest -q -rfE tests/kernels/test_compact.py -p no:cacheprovider > $OUT/c5/compact_tests.log 2>&1
echo "compact tests rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c5/compact_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c5/engine_$1_$2.log 2>&1; sed "s/^{/{\"arm\": \"final\", /" $OUT/bench/measurements.jsonl >> $OUT/c5/engine.jsonl; rm -rf $OUT/bench; }
for spec in "hardkv 256" "hardkv 64"; do
  set -- $spec
  if (( SECONDS - t0 > 500 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2; echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c5/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          "event ms", round(r.get("event_ms_median", 0), 2), "pure", round(r.get("pure_step_ms", 0), 4), "live", round(r["mean_live_tokens"], 2), "tok/s", round(r["tok_s"]))
PY
cp kvroll/kernels/hardkv_keep.py $OUT/c5/
tar czf $OUT/c5.tgz -C $OUT c5 gpu.txt; rm -rf $OUT/c5
