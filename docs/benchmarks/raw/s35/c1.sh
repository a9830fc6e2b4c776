#!/usr/bin/env bash
# Session 35, call 1: where Hard-KV's (and R-KV's) compression event at 256 slots spends its time, by kernel
# (benchmarks/event_profile.py, 4 layers: scale by 7), on main.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 300 python benchmarks/event_profile.py --policies hardkv,rkv --slots 256,64 --layers 4 --top 30 --out $OUT/event_main.json 2>&1 | tail -20
