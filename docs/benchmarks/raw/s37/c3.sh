#!/usr/bin/env bash
# Session 37, call 3 (carry .devstage/p0; call 1's copy of p1 in /root/devstage): call 2's last run again, its
# --no-connect fixed (rank 0 sets the communicator up with the workers' one-byte broadcast, on its own thread and
# unwatched, as before SyncGroup.connect): a worker killed after join_group, before the set-up. Expected: rank 0
# hangs there (the stacks printed at 75 s) until the timeout ends the run.
set -uo pipefail
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/c3
RAY=/tmp/site/bin/ray
CUDA_VISIBLE_DEVICES=1,2 RAY="$RAY" scripts/ray_cluster.sh head --num-gpus 2 --num-cpus 8 > $OUT/c3/ray_head.log 2>&1
echo "head rc $?"
start=$(date +%s)
timeout 90 python benchmarks/ray_nccl_faults.py --address auto --setup-only --no-connect --dump-after 75 \
  --out $OUT/c3 > $OUT/c3/faults.log 2>&1
echo "old set-up rc $? in $(( $(date +%s) - start )) s (124: the timeout ended it)"
grep -v "Warning\|warn(" $OUT/c3/faults.log | grep -v "^(.*pid=\|logging.cc\|^    @" | tail -45
RAY="$RAY" scripts/ray_cluster.sh stop > /dev/null 2>&1
tar czf $OUT/c3.tgz -C $OUT c3; rm -rf $OUT/c3
