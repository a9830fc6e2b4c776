#!/usr/bin/env bash
# The Ray issue's 2-GPU measurement on a device machine with two GPUs (nvidia-h200-x2): a Ray head owning GPU 1,
# the GRPO trainer under DeepSpeed ZeRO-3 on GPU 0 (accelerate launch), one rollout worker; results in $OUT.
#   device call 1 (carry .devstage/p1):  mkdir -p /root/devstage && cp -r .devstage/p1/. /root/devstage/
#   device call 2 (carry .devstage/p0 .devtok):  bash benchmarks/run_ray_gpu.sh [ray_grpo_gpu.py flags]
# .devtok holds the embedded model's tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja).
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/device_env.sh
export PYTHONUNBUFFERED=1 RAY_DEDUP_LOGS=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET NCCL_DEBUG_FILE=/tmp/nccl.%h.%p.log
OUT="${OUT:-out}"; mkdir -p "$OUT"
RAY=/tmp/site/bin/ray
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m; } \
  > "$OUT/env.txt" 2>&1
CUDA_VISIBLE_DEVICES=1 RAY="$RAY" scripts/ray_cluster.sh head --num-gpus 1 --num-cpus 8 > "$OUT/ray_head.log" 2>&1
RAY="$RAY" scripts/ray_cluster.sh status >> "$OUT/ray_head.log" 2>&1
timeout "${BENCH_TIMEOUT:-480}" accelerate launch --config_file configs/accelerate_zero3.yaml \
  benchmarks/ray_grpo_gpu.py --tokenizer .devtok --out "$OUT" "$@" > /tmp/bench.log 2>&1
echo "bench exit $?" >> /tmp/bench.log
grep -v "Warning\|warn(" /tmp/bench.log | tail -120 > "$OUT/bench.log"
tail -40 "$OUT/bench.log"
grep -h "via P2P\|via SHM\|via NET\|Channel 00" /tmp/nccl.*.log 2>/dev/null | sort | uniq -c | head -20 > "$OUT/nccl_transport.txt"
cat "$OUT/nccl_transport.txt"
RAY="$RAY" scripts/ray_cluster.sh stop > /dev/null 2>&1
ls -la "$OUT"
