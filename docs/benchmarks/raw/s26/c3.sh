#!/usr/bin/env bash
# Session 26, call 3: the epilogue's tile rule from c2's probe. The chain's kernel and GPU tests (all of the file),
# then the engine A/B (SILU_EPILOGUE = False the old) on Qwen3-1.7B at batches 1, 8, 32, 64 and Llama-3.2-1B at 64.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q tests/kernels/test_pdl_gemm.py tests/kernels/test_fused_mlp.py -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
export FLAG=SILU_EPILOGUE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|silu" ENGINE_TIMEOUT=150
ROWS="longflow:64 longflow:8 longflow:1 longflow:32" bash docs/benchmarks/raw/s23/calls.sh
mkdir -p $OUT/qwen; mv $OUT/new.jsonl $OUT/old.jsonl $OUT/qwen/
ROWS="longflow:64" ARCH=llama-3.2-1b bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
