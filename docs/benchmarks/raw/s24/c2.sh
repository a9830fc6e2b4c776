#!/usr/bin/env bash
# Session 24, call 2: cuBLASLt's heuristic algorithms against cuBLAS on the projections; the decode kernel's GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 300 python benchmarks/cublaslt_algo_probe.py --out $OUT 2>&1 | tail -30
timeout 280 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
