#!/usr/bin/env bash
# Session 27, call 6: the final code's GPU tests of the chain (the engine at batches 3 and 96, the graph test at
# 1-128 rows, gate_up against cuBLAS) and of the split-K projections (split_k.project's chain argument).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 140 python -m pytest -q tests/kernels/test_pdl_gemm.py tests/kernels/test_split_k.py -p no:cacheprovider 2>&1 | tail -6 | tee $OUT/gpu_tests.log
