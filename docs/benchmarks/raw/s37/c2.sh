#!/usr/bin/env bash
# Session 37, call 2 (after call 1 copied .devstage/p1 to /root/devstage; carry .devstage/p0): NCCL faults with the
# set-up watched (SyncGroup.connect): a worker killed or hung mid-broadcast, and killed or hung after join_group,
# before the communicator's set-up; then the set-up fault with rank 0 as before connect (expected to hang: timeout).
set -uo pipefail
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/c2/old
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader > $OUT/c2/env.txt 2>&1
RAY=/tmp/site/bin/ray
CUDA_VISIBLE_DEVICES=1,2 RAY="$RAY" scripts/ray_cluster.sh head --num-gpus 2 --num-cpus 8 > $OUT/c2/ray_head.log 2>&1
echo "head rc $?"; tail -3 $OUT/c2/ray_head.log
start=$(date +%s)
timeout 330 python benchmarks/ray_nccl_faults.py --address auto --out $OUT/c2 > $OUT/c2/faults.log 2>&1
echo "faults rc $? in $(( $(date +%s) - start )) s"
grep -v "Warning\|warn(" $OUT/c2/faults.log | grep -v "^(.*pid=" | tail -30
start=$(date +%s)
timeout 80 python benchmarks/ray_nccl_faults.py --address auto --setup-only --no-connect --out $OUT/c2/old > $OUT/c2/old/faults.log 2>&1
echo "old set-up rc $? in $(( $(date +%s) - start )) s (124: the timeout ended it)"
grep -v "Warning\|warn(" $OUT/c2/old/faults.log | grep -v "^(.*pid=" | tail -8
RAY="$RAY" scripts/ray_cluster.sh stop > /dev/null 2>&1
tar czf $OUT/c2.tgz -C $OUT c2; rm -rf $OUT/c2
