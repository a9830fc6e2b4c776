#!/usr/bin/env bash
# Session 25, call 3: the scan kernel's parts against torch (c2's scan disagreed on the GPU only), the kernel's GPU
# tests, then the probe ("ordered" against "scan", random and real keys).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
python benchmarks/rkv_scan_debug.py 2>&1 | tail -20
timeout 120 python -m pytest -q -m gpu tests/kernels/test_rkv_redundancy.py -p no:cacheprovider 2>&1 | tail -3
timeout 300 python benchmarks/rkv_scan_probe.py --real-keys .devdata/smollm2_keys_1152.pt --out $OUT/rkv_scan_probe.json 2>&1 | cut -c1-600
