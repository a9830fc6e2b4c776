#!/usr/bin/env bash
# Session 40, call 3 (nvidia-h200): the H200's deeper chain tiles (pdl_gemm.H200_TILES, DEVICE_TILES) in the engine:
# LongFlow at batch 64 (new / old / old / new), Hard-KV at 64 and LongFlow at 32 (one pair each), arms alternated;
# then the chain's GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3
t0=$SECONDS
eng() { STAGES=engine ENGINE_TIMEOUT=100 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c3/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c3/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64 new" "longflow 64 old" "hardkv 64 old" "hardkv 64 new" "longflow 32 new" "longflow 32 old" "longflow 64 old" "longflow 64 new"; do
  set -- $spec
  if (( SECONDS - t0 > 380 )); then echo "skip $spec (time)"; continue; fi
  if [[ $3 == new ]]; then sed -i 's/^DEVICE_TILES = False/DEVICE_TILES = True/' kvroll/kernels/pdl_gemm.py
  else sed -i 's/^DEVICE_TILES = True/DEVICE_TILES = False/' kvroll/kernels/pdl_gemm.py; fi
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^DEVICE_TILES = False/DEVICE_TILES = True/' kvroll/kernels/pdl_gemm.py
grep -n "^DEVICE_TILES" kvroll/kernels/pdl_gemm.py
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c3/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], [k for k in r["top_kernels"] if k[0] == "_gemm_kernel"])
PY
timeout 170 python -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_pdl_gemm.py > $OUT/c3/tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c3/tests.log
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
