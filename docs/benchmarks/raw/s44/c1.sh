#!/usr/bin/env bash
# Session 44, call 1 (nvidia-h200; carry .devstage/p0 .devtok): issue 16's GRPO rollout phase on main after session
# 43's batched prefill: session 41's call 5 again (kvroll's 4,096-token rollout twice in one process on a fresh
# machine: the first compiles the Triton kernels, the second finds them compiled). One GRPO step of TRL's
# GRPOTrainer, Qwen3-1.7B architecture (random bf16 weights), 8 prompts x G = 8, EOS ignored, longflow at 1,024.
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
STAGES=speed TOTAL_S=300 SPEED_ARGS="--max-completion-length 4096 --budget 1024 --policy longflow --backends kvroll,kvroll --stop-after-rollout --tokenizer .devtok" bash benchmarks/run_trl_gpu.sh
