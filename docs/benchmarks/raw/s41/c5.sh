#!/usr/bin/env bash
# Session 41, call 5 (nvidia-h200): kvroll's 4,096-token GRPO rollout of call 3 twice in one process, on a fresh
# machine: the first run compiles the Triton kernels (an empty cache), the second finds them compiled. Their
# difference is the JIT compile inside call 3's 22.7 s.
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
STAGES=speed TOTAL_S=300 SPEED_ARGS="--max-completion-length 4096 --budget 1024 --policy longflow --backends kvroll,kvroll --stop-after-rollout --tokenizer .devtok" bash benchmarks/run_trl_gpu.sh
