#!/usr/bin/env bash
# Session 42, call 1 (nvidia-h200): the fused head's tiles (head_sample, Qwen3-1.7B's head, bf16, T = 1) swept on an
# H200; head_config's tiles were chosen on an H100 (session 21), and session 40's profile put the head at 187 us
# against its 146 us floor at batch 64 on the H200.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
t0=$SECONDS
for rows in 64 48 32 16 1; do
  if (( SECONDS - t0 > 470 )); then echo "skip rows $rows (time)"; continue; fi
  timeout $((560 - (SECONDS - t0))) python benchmarks/head_sample_ab.py --out $OUT --rows $rows --sweep --rounds 3 2>&1 | grep -v Warning | tail -3
  mv $OUT/head_sample_ab.json $OUT/head_sweep_$rows.json 2>/dev/null
  echo "rows $rows done at $((SECONDS - t0)) s"
done
