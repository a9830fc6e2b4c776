#!/usr/bin/env bash
# Session 38, call 2 (nvidia-h100-x1): at 48 and 64 rows, head_sample's 128- and 256-wide tiles with the tile draw
# against the rule's; head_sample's tests plainly on the GPU; the engine's LongFlow row at batch 48 with TILE_DRAW
# on and off (sed; one run each, arms alternated).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
timeout 150 python benchmarks/head_tile_draw_ab.py --out $OUT/c2 --rows 48,64 --config_rows 48 \
  --configs "64,128,64,4,4;64,128,64,4,3;64,128,128,4,3;64,256,64,8,3;64,128,64,8,4" > $OUT/c2/ab.log 2>&1
echo "ab rc $? at $((SECONDS - t0)) s"; cut -c1-700 $OUT/c2/ab.log | tail -4
eng() { STAGES=engine ENGINE_TIMEOUT=100 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 48 gumbel" "longflow 48 tile"; do
  set -- $spec
  if [[ $3 == tile ]]; then sed -i 's/^TILE_DRAW = False/TILE_DRAW = True/' kvroll/kernels/sample.py
  else sed -i 's/^TILE_DRAW = True/TILE_DRAW = False/' kvroll/kernels/sample.py; fi
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^TILE_DRAW = False/TILE_DRAW = True/' kvroll/kernels/sample.py
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c2/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], [k for k in r["top_kernels"] if k[0] == "_head_kernel"])
PY
timeout $((560 - (SECONDS - t0))) python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_head_sample.py > $OUT/c2/tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c2/tests.log
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
