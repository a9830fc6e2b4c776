#!/usr/bin/env bash
# Session 24, call 4: the PDL chain's GPU tests, then the engine A/B (PDL_CHAIN = False is "old").
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
TESTS=1 TESTS_TIMEOUT=${TESTS_TIMEOUT:-260} TEST_FILES="tests/kernels/test_pdl_gemm.py tests/kernels/test_split_k.py tests/kernels/test_fused_mlp.py tests/kernels/test_fused_qkv_rotary.py tests/kernels/test_add_rms_norm.py tests/kernels/test_silu_mul.py tests/kernels/test_rotary.py" \
  ROWS="${ROWS:-longflow,snapkv,hardkv:64 longflow:8 longflow:1}" FLAG=PDL_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py \
  KERNELS="decode|gemm|nvjet|norm|rotary|silu" bash docs/benchmarks/raw/s23/calls.sh
