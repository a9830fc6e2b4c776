#!/usr/bin/env bash
# Session 27, call 2: the row-tile test on the GPU; c1's probe with 10 more tiles (the <= 64-row rule's over row
# tiles of 64 / 32, neighbours of c1's best), then the chain with each projection's best tile against the committed
# code: LongFlow at batches 96, 128 and 256, SnapKV at 128.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 100 python -m pytest -q tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -5 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
ROWS="longflow:128 longflow:256 longflow:96 snapkv:128" PROBE_S=200 bash docs/benchmarks/raw/s27/c1.sh
