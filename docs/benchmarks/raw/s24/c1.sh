#!/usr/bin/env bash
# Session 24, call 1: the L2 prefetch probe; the pending GPU checks of session 23 (the decode kernel's GPU tests with
# FEW_ROWS_SPLITS the launcher's default, the few-rows shape default vs 2 splits, LagKV's graphed event).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 300 python benchmarks/l2_prefetch_probe.py --out $OUT 2>&1 | tail -20
timeout 120 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
SHAPES=8x32x8x64x2048,8x16x8x64x2048 VARIANTS=default,sp2,sp4 timeout 90 python benchmarks/stat_epilogue_probe.py --out $OUT 2>&1 | grep -v "^ *$" | tail -8
timeout 120 python benchmarks/event_profile.py --policies lagkv --slots 64 --out $OUT/event_lagkv.json 2>&1 | tail -4
