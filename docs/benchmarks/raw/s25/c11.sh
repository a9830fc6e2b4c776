#!/usr/bin/env bash
# Session 25, call 11: after the review, the scan without the redundant tile at unaligned capacities and a GPU test
# whose blocks stop after the newest tile; the kernel's GPU tests and the probe at 2 shapes.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 120 python -m pytest -q -m gpu tests/kernels/test_rkv_redundancy.py -p no:cacheprovider 2>&1 | tail -3
timeout 200 python benchmarks/rkv_scan_probe.py --real-keys .devdata/smollm2_keys_1152.pt --shapes 64x8x1152x128,64x2x777x128 \
  --out $OUT/rkv_scan_probe.json 2>&1 | cut -c1-700
