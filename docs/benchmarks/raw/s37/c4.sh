#!/usr/bin/env bash
# Session 37, call 4 (nvidia-h100-x1): session 36's last code commit (5f604a3: the finish's helpers shared, checked
# on the CPU and by PTX only) run plainly on a GPU: the decode kernel's, the chain's and the engine's GPU tests; then
# the engine's LongFlow rows at batches 1, 64, 128 and Hard-KV at 64 (one run each) against session 36's.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c4
t0=$SECONDS
timeout 300 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_decode_attention.py \
  tests/kernels/test_pdl_gemm.py tests/kernels/test_layer_batched_events.py > $OUT/c4/gpu_tests.log 2>&1
echo "kernel tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c4/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c4/engine_$1_$2.log 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/c4/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64" "longflow 1" "hardkv 64" "longflow 128"; do
  set -- $spec
  if (( SECONDS - t0 > 520 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2; echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c4/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], "tok/s", round(r["tok_s"]))
PY
tar czf $OUT/c4.tgz -C $OUT c4 gpu.txt; rm -rf $OUT/c4
