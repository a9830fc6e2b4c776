#!/usr/bin/env bash
# Session 22's split-K A/B: calls.sh with the committed code ("new": the o and down projections as 2 K slices whose
# fp32 partials add_rms_norm sums, kvroll/kernels/split_k.py) against SPLIT_K = False ("old").
#   ROWS="longflow:64 snapkv:64" [SHAPES=, TESTS=1, SUITE=1] bash docs/benchmarks/raw/stages_s22/calls_splitk.sh
export FLAG=SPLIT_K FLAG_FILE=kvroll/kernels/split_k.py KERNELS="nvjet|add_rms|gemm"
export TEST_FILES="tests/kernels/test_split_k.py tests/kernels/test_add_rms_norm.py tests/kernels/test_fused_add_norm.py tests/kernels/test_fusion_switches.py tests/rollout/test_graphs.py"
exec bash "$(dirname "$0")/calls.sh"
