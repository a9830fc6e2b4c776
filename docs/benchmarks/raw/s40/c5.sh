#!/usr/bin/env bash
# Session 40, call 5 (nvidia-h200): issue 16 §3's long-tail grid on an H200 (kernel_tail.py --mode check), main's
# decode kernel unchanged since session 36; the H100's runs are sessions 32, 33 and 36.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 500 python benchmarks/kernel_tail.py --mode check --out $OUT --budget-s 470 2>&1 | grep -v Warning | tail -75
