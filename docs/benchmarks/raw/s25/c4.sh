#!/usr/bin/env bash
# Session 25, call 4: the scan kernel with the newest BLOCK_V slots first (unaligned) and the diagonal masked in the
# tiles crossing it only; its GPU tests, the probe, and the engine A/B of R-KV at batches 64 and 256
# (ORDERED_SCAN = False the old).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 300 python benchmarks/rkv_scan_probe.py --real-keys .devdata/smollm2_keys_1152.pt --out $OUT/rkv_scan_probe.json 2>&1 | cut -c1-600
TESTS=1 TESTS_TIMEOUT=150 TEST_FILES="tests/kernels/test_rkv_redundancy.py tests/policies" \
  ROWS="${ROWS:-rkv:64 rkv:256}" FLAG=ORDERED_SCAN FLAG_FILE=kvroll/kernels/rkv_redundancy.py KERNELS="decode" \
  bash docs/benchmarks/raw/s23/calls.sh | grep -v "^ *$" | cut -c1-300
grep -E "passed|failed|Error|assert" $OUT/gpu_tests.log | head -8
rm -f $OUT/engine_*.log
