#!/usr/bin/env bash
# Session 39, call 5: the GPU tests of the sampler's paths after logprobs_mode="processed" (the graphs' key, the
# torch sampler inside CUDA graphs with every processor) and the engine's input fixes.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 500 python -m pytest -q -rfEs -m gpu tests/rollout tests/kernels/test_sample.py tests/kernels/test_head_sample.py -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
echo "rc $?"; tail -15 $OUT/gpu_tests.log
