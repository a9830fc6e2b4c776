#!/usr/bin/env bash
# Session 39, call 4: the chain's GEMM at fixed tiles over 64-264 programs (benchmarks/gemm_waves_probe.py): does a
# projection stream below the copy bandwidth because its programs leave SMs idle (gate_up: 96 programs on 132 SMs)?
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 300 python benchmarks/gemm_waves_probe.py --rows 64 --out $OUT/gemm_waves_64.json > $OUT/gemm_waves.log 2>&1
echo "rc $?"
timeout 200 python benchmarks/gemm_waves_probe.py --rows 32 --out $OUT/gemm_waves_32.json >> $OUT/gemm_waves.log 2>&1
echo "rc $?"; cat $OUT/gemm_waves.log
