#!/usr/bin/env bash
# Session 43, call 4 (same lease, the wheels installed): session 37's NCCL faults re-run on main, after session 42's
# change to the pool's sync failure (a failed sync with every worker healthy drops and re-forms the group): a worker
# SIGKILLed / SIGSTOPped mid-broadcast and before the communicator's set-up; trainer's rank 0 on GPU 0, workers on
# GPUs 1-2.
set -uo pipefail
export KVROLL_DEVSTAGE=.devray/p0
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/c4
RAY=/tmp/site/bin/ray
CUDA_VISIBLE_DEVICES=1,2 RAY="$RAY" scripts/ray_cluster.sh head --num-gpus 2 --num-cpus 8 > $OUT/c4/ray_head.log 2>&1
echo "head rc $?"; tail -3 $OUT/c4/ray_head.log
start=$(date +%s)
timeout 420 python benchmarks/ray_nccl_faults.py --address auto --out $OUT/c4 > $OUT/c4/faults.log 2>&1
echo "faults rc $? in $(( $(date +%s) - start )) s"
grep -v "Warning\|warn(" $OUT/c4/faults.log | grep -v "^(.*pid=" | tail -30
RAY="$RAY" scripts/ray_cluster.sh stop > /dev/null 2>&1
