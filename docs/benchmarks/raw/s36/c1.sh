#!/usr/bin/env bash
# Session 36, call 1: the long tail's finish at 2,048 tokens with 4-8 query heads per KV head (issue 16 §3's two
# shapes over 1.5x SDPA): last arrival vs merge kernel, splits, chunks, warps (benchmarks/tail_finish_probe.py).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 560 python benchmarks/tail_finish_probe.py --out $OUT --budget-s 470 2>&1 | grep -v Warning | tail -30
