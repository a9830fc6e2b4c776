#!/usr/bin/env bash
# Session 42, call 2 (nvidia-h200): the H200's head rule (sample.DEVICE_HEAD: head_sample in 128-wide tiles up to 32
# rows, cuBLAS's head + the inverse-CDF sampler above) in the engine against the H100's rule, LongFlow at batches 64,
# 32 and 16 (Qwen3-1.7B architecture, random weights, budget 1,024, 4,096 new tokens), arms alternated; then the
# head's and the sampler's GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
eng() { STAGES=engine ENGINE_TIMEOUT=100 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64 new" "longflow 64 old" "longflow 32 old" "longflow 32 new" "longflow 16 new" "longflow 16 old" "longflow 64 old" "longflow 64 new"; do
  set -- $spec
  if (( SECONDS - t0 > 420 )); then echo "skip $spec (time)"; continue; fi
  if [[ $3 == new ]]; then sed -i 's/^DEVICE_HEAD = False/DEVICE_HEAD = True/' kvroll/kernels/sample.py
  else sed -i 's/^DEVICE_HEAD = True/DEVICE_HEAD = False/' kvroll/kernels/sample.py; fi
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^DEVICE_HEAD = False/DEVICE_HEAD = True/' kvroll/kernels/sample.py
grep -n "^DEVICE_HEAD" kvroll/kernels/sample.py
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c2/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], [k for k in r["top_kernels"] if "head" in k[0] or "mass" in k[0] or "pick" in k[0] or "nvjet" in k[0] or "gemm" in k[0].lower()][:6])
PY
timeout $((590 - (SECONDS - t0))) python -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_head_sample.py tests/kernels/test_sample.py > $OUT/c2/tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c2/tests.log
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
