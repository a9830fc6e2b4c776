#!/usr/bin/env bash
# Session 26, call 5: the final code's GPU tests (the chain's and the fused MLP's files whole, the rollout's GPU
# tests), the periodic policies at batch 64 (Qwen3-1.7B), and the epilogue's engine A/B on Qwen3-0.6B at batch 64
# (its gate_up at 64 rows takes the 64 x 128 tiles: 128 x 128 would make 48 programs).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q tests/kernels/test_pdl_gemm.py tests/kernels/test_fused_mlp.py tests/kernels/test_silu_mul.py -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
timeout 200 python -m pytest -q -m gpu tests/rollout -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests_rollout.log; tail -1 $OUT/gpu_tests_rollout.log
ROWS="rkv,lagkv,hardkv,snapkv:64" KERNELS="gemm|silu" ENGINE_TIMEOUT=200 bash docs/benchmarks/raw/s23/calls.sh
mkdir -p $OUT/periodic; mv $OUT/new.jsonl $OUT/periodic/
ROWS="longflow:64" ARCH=qwen3-0.6b FLAG=SILU_EPILOGUE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|silu" ENGINE_TIMEOUT=150 bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
