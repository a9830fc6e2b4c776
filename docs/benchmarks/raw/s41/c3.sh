#!/usr/bin/env bash
# Session 41, call 3 (nvidia-h200): issue 16's GRPO rollout phase against TRL's default path on main (last measured
# in session 11): one GRPO step of TRL's GRPOTrainer, Qwen3-1.7B architecture (random bf16 weights), 8 prompts x G = 8,
# 4,096-token completions, EOS ignored; kvroll (longflow, budget 1,024) then TRL's model.generate, in one run.
# Staged: bash benchmarks/stage_device.sh, without the GGUF's chunks (random weights; .devtok holds the embedded
# model's tokenizer); carry .devstage/p0 and .devtok.
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
STAGES=speed TOTAL_S=585 SPEED_ARGS="--max-completion-length 4096 --budget 1024 --policy longflow --stop-after-rollout --tokenizer .devtok" bash benchmarks/run_trl_gpu.sh
