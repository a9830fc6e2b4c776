#!/usr/bin/env bash
# Session 25, call 6: the scan with the norm pass in 32-slot partials summed by torch; where the time goes (the norm
# passes alone at 16-128 slots per program, both kernels without the exemption), then the probe.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
python benchmarks/rkv_scan_debug.py 2>&1 | grep -E "scan vs rows|rowsum" | tail -8
timeout 300 python benchmarks/rkv_scan_probe.py --real-keys .devdata/smollm2_keys_1152.pt --out $OUT/rkv_scan_probe.json 2>&1 | cut -c1-900
