#!/usr/bin/env bash
# Session 48, call 1 (nvidia-h200): benchmarks/engine_fuzz.py, the engine on random shapes against independent
# references: the fp32 part (CUDA defaults against the CPU engine, and HF generate for full), then the bf16 part (the
# chain's widths and row rules against HF's fp32 forward / replay with the chain off).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
python benchmarks/engine_fuzz.py --part fp32 --seconds ${FP32_S:-250} --seed ${SEED:-0} --out $OUT > $OUT/fp32.log 2>&1
tail -2 $OUT/fp32.log
python benchmarks/engine_fuzz.py --part bf16 --seconds ${BF16_S:-230} --seed ${SEED:-0} --out $OUT > $OUT/bf16.log 2>&1
tail -2 $OUT/bf16.log
