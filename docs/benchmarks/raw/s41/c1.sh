#!/usr/bin/env bash
# Session 41, call 1 (nvidia-h200): are the decode kernel's H100-tuned configurations the H200's best?
# (1) kernel_decode.py's coordinate search at the engine's shapes (K4 = batch 64, K5 = 128, K3 = 256 at budget
# 1,024-1,152); (2) kernel_tail.py --mode tune on the three section-3 shapes over 1.5x on the H200 in session 40.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
t0=$SECONDS
mkdir -p $OUT/kd
timeout 260 python benchmarks/kernel_decode.py --shapes K4,K5,K3 --budget-s 200 --out $OUT/kd 2>&1 | grep -v Warning | tail -30
echo "kernel_decode done at $((SECONDS - t0)) s"
timeout $((560 - (SECONDS - t0))) python benchmarks/kernel_tail.py --mode tune --shapes 4x64x8x32768,8x64x8x32768,8x64x8x2048 --budget-s $((520 - (SECONDS - t0))) --out $OUT 2>&1 | grep -v Warning | tail -10
echo "done at $((SECONDS - t0)) s"
