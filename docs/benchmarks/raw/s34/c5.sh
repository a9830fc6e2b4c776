#!/usr/bin/env bash
# Session 34, call 5: does head_sample (the head's matmul with the Gumbel draw in its epilogue, the engine's step at
# <= 64 rows) still beat cuBLAS's head + the fused sampler, now that the sampler draws by the inverse CDF?
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c5
timeout 300 python benchmarks/head_sample_ab.py --out $OUT/c5 --rows 1,16,32,48,64,80,96,128 > $OUT/c5/head_ab.log 2>&1
echo "rc $?"; cat $OUT/c5/head_ab.log | tail -12
tar czf $OUT/c5.tgz -C $OUT c5 gpu.txt; rm -rf $OUT/c5
