#!/usr/bin/env bash
# Session 48, call 3 (nvidia-h200): call 1's fuzz with seed 2, in what the session's device time left.
SEED=2 FP32_S=220 BF16_S=140 bash docs/benchmarks/raw/s48/c1.sh
