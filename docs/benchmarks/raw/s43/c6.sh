#!/usr/bin/env bash
# Session 43, call 6 (nvidia-h200): what 64 distinct prompts pay for their one-by-one prefills against 8 prompts x 8
# samples (benchmarks/prefill_probe.py, new), rkv at 512, 128-token prompts, 1 and 1,024 new tokens.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 500 python benchmarks/prefill_probe.py --out $OUT 2>&1 | grep -v Warning | tail -12
head -40 $OUT/prefill_profile.txt
