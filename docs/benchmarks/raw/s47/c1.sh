#!/usr/bin/env bash
# Session 47, call 1 (nvidia-h200): the GPU suite of the engine, kernels, bench and policies, plainly, on main after this session's changes
# (decode_attention.py split into the kernels + decode_launch.py; usage.py; the audits' fixes).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 560 python -m pytest -q -rfEs -m gpu tests/kernels tests/rollout tests/bench tests/policies -p no:cacheprovider \
    --durations=10 > $OUT/gpu_tests.log 2>&1
echo "rc $? at $((SECONDS - t0)) s"; grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -5
