#!/usr/bin/env bash
# Session 44, call 3 (nvidia-h200): the GPU tests of the engine, the Ray worker (new: a CUDA worker takes the
# trainer's whole plan, GPU checksums equal the CPU's), the bench and the policies, plainly, after this session's
# changes (the checksum's odd column weights, the worker's plan coverage check, the bench's fixes, the metrics).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout 540 python -m pytest -q -rfEs -m gpu tests/ray tests/rollout tests/bench tests/policies -p no:cacheprovider --durations=10 > $OUT/gpu_tests.log 2>&1
echo "rc $? at $((SECONDS - t0)) s"; grep -E "passed|failed|error" $OUT/gpu_tests.log | tail -5
