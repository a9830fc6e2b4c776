#!/usr/bin/env bash
# Session 25, call 7: the scan with 128-slot norm partials again (c6: 32 was slower), the probe timed from CUDA
# graphs, then the engine A/B of R-KV at batches 64 and 256 with ORDERED_SCAN on (new) and off (old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
sed -i "s/^ORDERED_SCAN = False /ORDERED_SCAN = True /" kvroll/kernels/rkv_redundancy.py
timeout 300 python benchmarks/rkv_scan_probe.py --real-keys .devdata/smollm2_keys_1152.pt --out $OUT/rkv_scan_probe.json 2>&1 | cut -c1-900
ROWS="${ROWS:-rkv:64 rkv:256}" FLAG=ORDERED_SCAN FLAG_FILE=kvroll/kernels/rkv_redundancy.py KERNELS="decode" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
rm -f $OUT/engine_*.log
