#!/usr/bin/env bash
# Session 44, call 2 (the lease of call 1; carry .devstage/p0 .devtok): kvroll's GRPO rollout phase at 16,384-token
# completions (budget 4,096, the same 25%) twice in one process: session 41 made only a first run (compile included).
source benchmarks/device_env.sh
STAGES=speed TOTAL_S=560 SPEED_ARGS="--max-completion-length 16384 --budget 4096 --policy longflow --backends kvroll,kvroll --stop-after-rollout --tokenizer .devtok" bash benchmarks/run_trl_gpu.sh
