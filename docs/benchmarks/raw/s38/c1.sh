#!/usr/bin/env bash
# Session 38, call 1 (nvidia-h100-x1): head_sample's tile draw (TILE_DRAW) against its Gumbel arm and cuBLAS + the
# sampler at 1-128 rows (benchmarks/head_tile_draw_ab.py); head_sample's tests plainly on the GPU; the engine's
# LongFlow and Hard-KV rows at batch 64 with TILE_DRAW on and off (sed; one run each, arms alternated).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c1
t0=$SECONDS
timeout 200 python benchmarks/head_tile_draw_ab.py --out $OUT/c1 > $OUT/c1/ab.log 2>&1
echo "ab rc $? at $((SECONDS - t0)) s"; cut -c1-400 $OUT/c1/ab.log | tail -12
timeout 150 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_head_sample.py > $OUT/c1/tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c1/tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=100 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c1/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c1/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64 tile" "longflow 64 gumbel" "hardkv 64 gumbel" "hardkv 64 tile"; do
  set -- $spec
  if (( SECONDS - t0 > 530 )); then echo "skip $spec (time)"; continue; fi
  if [[ $3 == tile ]]; then sed -i 's/^TILE_DRAW = False/TILE_DRAW = True/' kvroll/kernels/sample.py
  else sed -i 's/^TILE_DRAW = True/TILE_DRAW = False/' kvroll/kernels/sample.py; fi
  grep -n "^TILE_DRAW" kvroll/kernels/sample.py
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^TILE_DRAW = False/TILE_DRAW = True/' kvroll/kernels/sample.py
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c1/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], [k for k in r["top_kernels"] if k[0] == "_head_kernel"])
PY
tar czf $OUT/c1.tgz -C $OUT c1 gpu.txt; rm -rf $OUT/c1
