#!/usr/bin/env bash
# Session 28, call 9: the final code. The chain's and the decode kernel's GPU tests and the rollout's (-m gpu), then
# Qwen3-4B at batch 64 (SHAPE_TILES to 64 rows, the decode kernel a plain launch by attention_pdl's group rule)
# against SHAPE_CHAIN = False (cuBLAS at 64 rows).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 250 python -m pytest -q -rfE tests/kernels/test_pdl_gemm.py tests/kernels/test_decode_attention.py -m gpu -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests_kernels.log; tail -1 $OUT/gpu_tests_kernels.log
timeout 150 python -m pytest -q -rfE -m gpu tests/rollout -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests_rollout.log; tail -1 $OUT/gpu_tests_rollout.log
echo "tests $((SECONDS - t0)) s"
ARCH=qwen3-4b ROWS=longflow:64 FLAG=SHAPE_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="decode|gemm|nvjet" ENGINE_TIMEOUT=150 \
  bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
