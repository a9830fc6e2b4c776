#!/usr/bin/env bash
# Session 43, call 3 (same lease as call 2, the wheels installed): the same measurement with kvroll's PPOTrainer
# (--trainer ppo, new: 64 prompts a rollout, one completion each, one PPO epoch, a value model from the policy, no
# reference model), PPO's Ray mode on GPUs for the first time.
set -uo pipefail
export KVROLL_DEVSTAGE=.devray/p0
OUT=$OUT/ppo BENCH_TIMEOUT=480 bash benchmarks/run_ray_gpu.sh --trainer ppo 2>&1 | tail -45
