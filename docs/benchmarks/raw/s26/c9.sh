#!/usr/bin/env bash
# Session 26, call 9: the final code. The chain's and the MLP's kernel tests on the GPU (plain files, the CPU-tensor
# tests now skip without the interpreter), then LongFlow at batches 128 and 256 and Hard-KV at 256 (Qwen3-1.7B; the
# chain does not apply there: the goal table's rows).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q tests/kernels/test_pdl_gemm.py tests/kernels/test_fused_mlp.py tests/kernels/test_silu_mul.py -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
ROWS="longflow:128,256 hardkv:256" KERNELS="decode|gemm|silu" ENGINE_TIMEOUT=240 bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
