#!/usr/bin/env bash
# Session 40, call 6 (nvidia-h200): after the review fixes and Hard-KV's snapkv base max-pooling, their GPU tests.
# Output (30.6 s): "NVIDIA H200 ... 5 passed, 89 deselected in 10.96s" (test_cuda_device_tiles_against_cublas at 17,
# 40 and 64 rows with the launch spy; test_engine_shape_on_gpu, attention and snapkv bases).
nvidia-smi --query-gpu=name --format=csv,noheader; PYTHONPATH=$PWD timeout 170 python -m pytest -q -rfE -m gpu -p no:cacheprovider tests/kernels/test_pdl_gemm.py tests/kernels/test_hardkv_keep.py -k "device_tile or engine_shape_on_gpu" 2>&1 | tail -6
