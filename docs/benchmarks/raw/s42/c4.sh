#!/usr/bin/env bash
# Session 42, call 4 (nvidia-h200): the whole GPU suite of kernels, rollout, bench and policies on main with the H200 head rule, on an H200
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 570 python -m pytest -q -rfEs -m gpu tests/kernels tests/rollout tests/bench tests/policies -p no:cacheprovider --durations=15 > $OUT/gpu_suite_full.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/gpu_suite_full.log | tail -5
tail -80 $OUT/gpu_suite_full.log > $OUT/gpu_suite.log
