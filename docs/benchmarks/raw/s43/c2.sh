#!/usr/bin/env bash
# Session 43, call 2 (nvidia-h200-x4; after call 1 copied .devray/p1, ray's first chunk, to /root/devstage; carry
# .devray/p0 .devtok): the Ray issue's 2-GPU measurement re-run on main (last run in session 11): GRPO under ZeRO-3 on
# GPU 0, one Ray rollout worker on GPU 1 (benchmarks/run_ray_gpu.sh's defaults: Qwen3-1.7B architecture, random bf16
# weights, 64 rows x 1,024 tokens, rkv 512, 1 GB buckets, 4 steps).
set -uo pipefail
export KVROLL_DEVSTAGE=.devray/p0
OUT=$OUT/grpo BENCH_TIMEOUT=480 bash benchmarks/run_ray_gpu.sh 2>&1 | tail -45
