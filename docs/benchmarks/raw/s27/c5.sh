#!/usr/bin/env bash
# Session 27, call 5: Qwen3-4B's range in SHAPE_TILES. LongFlow at batch 40 (in the range 33-48) on the final code
# against SHAPE_CHAIN = False; at batch 56 with the range widened to 64 on the device (c4: 48 -5.2%, 64 +0.7%).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
ROWS="longflow:40" ARCH=qwen3-4b FLAG=SHAPE_CHAIN FLAG_FILE=$F ENGINE_TIMEOUT=120 KERNELS="gemm|nvjet" bash docs/benchmarks/raw/s23/calls.sh
mkdir -p $OUT/c40 && mv $OUT/new.jsonl $OUT/old.jsonl $OUT/c40/
sed -i "s/^_R17, _R4 = (65, 128), (FEW_ROWS + 1, 48)/_R17, _R4 = (65, 128), (FEW_ROWS + 1, 64)/" $F; grep -n "^_R17" $F
ROWS="longflow:56" ARCH=qwen3-4b FLAG=SHAPE_CHAIN FLAG_FILE=$F ENGINE_TIMEOUT=120 KERNELS="gemm|nvjet" bash docs/benchmarks/raw/s23/calls.sh
git checkout -q $F 2>/dev/null || sed -i "s/^_R17, _R4 = (65, 128), (FEW_ROWS + 1, 64)/_R17, _R4 = (65, 128), (FEW_ROWS + 1, 48)/" $F
rm -f $OUT/engine_*.log
