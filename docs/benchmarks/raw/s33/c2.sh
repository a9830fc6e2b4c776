#!/usr/bin/env bash
# Session 33, call 2: the engine with one tile of the next wave's row asked of L2 (NEXT_PREFETCH = 1) where 3+
# programs share an SM (NEXT_MIN_PER_SM = 3: the statistic's 2-stage calls at head_dim 128, head_dim 64), the
# finishing pass's prefetch off; c1's probe found 0.97-0.99x the kernel's time there and 1.01-1.02x elsewhere.
# "new" against "old" (NEXT_PREFETCH = 0): LongFlow on Qwen3-1.7B at batch 64, on Llama-3.2-1B (head_dim 64) at 64, 128.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/decode_attention.py | xargs -r git checkout HEAD --
fi
F=kvroll/kernels/decode_attention.py
sed -i "s/^NEXT_MIN_PER_SM = 0 /NEXT_MIN_PER_SM = 3 /" $F
eng() { STAGES=engine ENGINE_TIMEOUT=90 bash benchmarks/run_gpu.sh --architecture $4 --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2_$3_$4.log 2>&1; sed "s/^{/{\"arm\": \"$3\", \"arch\": \"$4\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 64 qwen3-1.7b" "longflow 64 llama-3.2-1b" "longflow 128 llama-3.2-1b" "longflow 64 qwen3-1.7b"; do
  set -- $spec
  if (( SECONDS - t0 > 420 )); then echo "skip $spec (time)"; continue; fi
  sed -i "s/^NEXT_PREFETCH = 0 /NEXT_PREFETCH = 1 /" $F; eng $1 $2 new $3
  sed -i "s/^NEXT_PREFETCH = 1 /NEXT_PREFETCH = 0 /" $F; eng $1 $2 old $3
  echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c2/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["arch"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "decode" in k[0].lower()])
PY
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
