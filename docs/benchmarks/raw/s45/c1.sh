#!/usr/bin/env bash
# Session 45, call 1 (nvidia-h200): the shipped GPU bench config, end to end with main's code, on an H200. The
# shipped report (docs/benchmarks/bench_qwen3_1.7b_h100/) is session 6's, on an H100, from before sessions 9-44's
# kernels; this is the same config and command, re-run. batch_sizes: [max], so the H200's 141 GB take larger batches.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KVROLL_GIT_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv > $OUT/gpu.txt
t0=$SECONDS
timeout -s INT 570 python -m kvroll.cli bench --config configs/bench/qwen3_1.7b_h100.yaml --out $OUT/bench_h200 \
    --no-progress > $OUT/bench.log 2>&1
echo "rc $? at $((SECONDS - t0)) s"; tail -5 $OUT/bench.log; sed -n 1,40p $OUT/bench_h200/report.md
