#!/usr/bin/env bash
# Session 43, call 5 (a fresh lease: after copying .devray/p1 to /root/devstage again; carry .devray/p0 .devtok):
# call 2's GRPO measurement again, the Ray worker now warmed on the timed prompts' shape like the colocated engine
# (call 2's first Ray round took 1.20x its second), 4 interleaved throughput rounds.
set -uo pipefail
export KVROLL_DEVSTAGE=.devray/p0
OUT=$OUT/grpo BENCH_TIMEOUT=480 bash benchmarks/run_ray_gpu.sh --throughput-rounds 4 2>&1 | grep -B2 -A3 "Rollout throughput"
