#!/usr/bin/env bash
# Session 33, call 1: the decode kernel's wave boundaries (NEXT_PREFETCH, FIN_PREFETCH; experiment switches).
#  1. benchmarks/next_prefetch_ab.py: the arms at the engine's batches (LongFlow's call, Hard-KV's, attention alone);
#  2. the engine, LongFlow at batches 64 and 128: NEXT_PREFETCH = 2 with FIN_PREFETCH ("new") against off ("old").
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c1
t0=$SECONDS
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/decode_attention.py | xargs -r git checkout HEAD --
  git status --short | head; git rev-parse --short HEAD
fi
timeout 330 python benchmarks/next_prefetch_ab.py --out $OUT/c1 --rounds 3 --budget-s 290 > $OUT/c1/next_prefetch_ab.log 2>&1
echo "probe rc $? at $((SECONDS - t0)) s"; cat $OUT/c1/next_prefetch_ab.log | grep -v Warning
F=kvroll/kernels/decode_attention.py
eng() { STAGES=engine ENGINE_TIMEOUT=90 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c1/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c1/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 128" "longflow 64"; do
  set -- $spec
  if (( SECONDS - t0 > 440 )); then echo "skip $spec (time)"; continue; fi
  sed -i "s/^NEXT_PREFETCH = 0 /NEXT_PREFETCH = 2 /; s/^FIN_PREFETCH = False /FIN_PREFETCH = True /" $F; eng $1 $2 new
  sed -i "s/^NEXT_PREFETCH = 2 /NEXT_PREFETCH = 0 /; s/^FIN_PREFETCH = True /FIN_PREFETCH = False /" $F; eng $1 $2 old
  echo "$spec at $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c1/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"],
          [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"] if "decode" in k[0].lower()])
PY
tar czf $OUT/c1.tgz -C $OUT c1 gpu.txt; rm -rf $OUT/c1
