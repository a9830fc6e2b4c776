#!/usr/bin/env bash
# Session 39, call 3: the MLP half of a chained layer as one persistent kernel with a grid barrier (with and without
# down's first weight tile loaded before the barrier) against the chain's two PDL launches
# (benchmarks/persistent_mlp_probe.py), at 64 and 32 rows of Qwen3-1.7B's widths.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 300 python benchmarks/persistent_mlp_probe.py --rows 64,32 --out $OUT/persistent_mlp.json > $OUT/persistent_mlp.log 2>&1
echo "rc $?"; cat $OUT/persistent_mlp.log | cut -c1-1500
