#!/usr/bin/env bash
# Session 35, call 6: the keep kernel at budgets 1,024, 3,200 and 8,192 (capacities 1,152 / 3,328 / 8,320: 2,048-,
# 4,096- and 16,384-slot programs) against the torch path on one layer of 256 and 64 slots, warps by warps_for (4 / 8
# / 16) against 16; then the GPU tests of kernels, rollout, policies and bench (-m gpu) on the final code.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c6
t0=$SECONDS
timeout 240 python benchmarks/hardkv_keep_ab.py --out $OUT/c6 --slots 256,64 --budgets 1024,3200,8192 --warps 4,16 > $OUT/c6/ab.log 2>&1
echo "ab rc $? at $((SECONDS - t0)) s"; tail -14 $OUT/c6/ab.log
timeout 330 python -m pytest -q -rfE -m gpu tests/kernels tests/rollout tests/policies tests/bench -p no:cacheprovider > $OUT/c6/gpu_suite.log 2>&1
echo "gpu suite rc $? at $((SECONDS - t0)) s"; tail -6 $OUT/c6/gpu_suite.log
tar czf $OUT/c6.tgz -C $OUT c6 gpu.txt; rm -rf $OUT/c6
