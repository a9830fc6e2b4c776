#!/usr/bin/env bash
# Session 40, call 1 (nvidia-h200): a stream-K gate_up with SiLU * up (benchmarks/streamk_gate_up_probe.py) against
# the chain's 96 tiles at 64, 48 and 32 rows of Qwen3-1.7B's widths; main's LongFlow and Hard-KV engine rows at
# batch 64 on this GPU (one run each).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c1
t0=$SECONDS
timeout 300 python benchmarks/streamk_gate_up_probe.py --rows 64 48 32 --out $OUT/c1/streamk.json > $OUT/c1/streamk.log 2>&1
echo "probe rc $? at $((SECONDS - t0)) s"; cut -c1-1200 $OUT/c1/streamk.log | tail -30
eng() { STAGES=engine ENGINE_TIMEOUT=100 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c1/engine_$1_$2.log 2>&1; sed "s/^{/{\"arm\": \"main\", /" $OUT/bench/measurements.jsonl >> $OUT/c1/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64" "hardkv 64"; do
  set -- $spec
  if (( SECONDS - t0 > 500 )); then echo "skip $spec (time)"; continue; fi
  eng $1 $2; echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c1/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"])
PY
tar czf $OUT/c1.tgz -C $OUT c1 gpu.txt; rm -rf $OUT/c1
