#!/usr/bin/env bash
# Session 36, call 4: issue 16 §3's long-tail grid in one run on the session's code (kernel_tail.py --mode check:
# FINISH_EARLY, tail_stat_split at fewer than 16 rows), as sessions 32 and 33 ran it on main.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 560 python benchmarks/kernel_tail.py --mode check --out $OUT --budget-s 520 2>&1 | grep -v Warning | tail -75
