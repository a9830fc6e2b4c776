#!/usr/bin/env bash
# Session 36, calls 7 and 9 (after calls 6 and 8 copied .devstage/p1 to /root/devstage; carry .devstage/p0): a worker killed and a
# worker hung in the middle of an NCCL weight sync (benchmarks/ray_nccl_faults.py): a Ray head owning GPUs 1 and 2,
# the trainer's rank 0 on GPU 0, two workers.
set -uo pipefail
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/c7
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $OUT/c7/env.txt 2>&1
RAY=/tmp/site/bin/ray
CUDA_VISIBLE_DEVICES=1,2 RAY="$RAY" scripts/ray_cluster.sh head --num-gpus 2 --num-cpus 8 > $OUT/c7/ray_head.log 2>&1
echo "head rc $?"; tail -3 $OUT/c7/ray_head.log
timeout 240 python benchmarks/ray_nccl_faults.py --address auto --out $OUT/c7 > $OUT/c7/faults.log 2>&1
echo "faults rc $?"
grep -v "Warning\|warn(" $OUT/c7/faults.log | tail -40
RAY="$RAY" scripts/ray_cluster.sh stop > /dev/null 2>&1
tar czf $OUT/c7.tgz -C $OUT c7; rm -rf $OUT/c7
