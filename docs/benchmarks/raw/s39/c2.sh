#!/usr/bin/env bash
# Session 39, call 2: the whole GPU suite of kernels, rollout, bench and policies on main (last run whole in
# session 31; sessions 32-38 changed the decode kernel's finish and merge, the fused head's draw and the sampler, and
# ran those files alone).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 570 python -m pytest -q -rfEs -m gpu tests/kernels tests/rollout tests/bench tests/policies -p no:cacheprovider --durations=15 > $OUT/gpu_suite_full.log 2>&1
echo "rc $?"; grep -E "passed|failed|error" $OUT/gpu_suite_full.log | tail -5
tail -80 $OUT/gpu_suite_full.log > $OUT/gpu_suite.log
