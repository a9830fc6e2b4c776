#!/usr/bin/env bash
# Session 41, call 4 (nvidia-h200): kvroll's GRPO rollout phase at 16,384-token completions (budget 4,096, the same
# 25%), TRL's trainer as in call 3, kvroll only (TRL's path at 16k would take more than a device call).
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
STAGES=speed TOTAL_S=400 SPEED_ARGS="--max-completion-length 16384 --budget 4096 --policy longflow --backends kvroll --stop-after-rollout --tokenizer .devtok" bash benchmarks/run_trl_gpu.sh
