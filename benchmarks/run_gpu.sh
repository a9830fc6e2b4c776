#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmark (a), engine benchmarks (b, c). Results land in $OUT.
#   PYTHONPATH=. bash benchmarks/run_gpu.sh [kvroll bench overrides, e.g. --policies full,rkv]
# STAGES (tests,kernel,engine); TESTS_TIMEOUT (420 s: the GPU tests include the fusion switches' checks).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-out}"; mkdir -p "$OUT"
STAGES="${STAGES:-tests,kernel,engine}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
if [[ $STAGES == *tests* ]]; then
  timeout "${TESTS_TIMEOUT:-420}" python -m pytest -q -s -m gpu tests/kernels tests/rollout/test_graphs.py tests/bench/test_kernel_count.py -p no:cacheprovider 2>&1 \
    | tail -40 | tee "$OUT/gpu_tests.log"
fi
if [[ $STAGES == *kernel* ]]; then
  timeout 240 python benchmarks/kernel_decode.py --out "$OUT" ${KERNEL_ARGS:-} 2>&1 | tail -30
fi
if [[ $STAGES == *engine* ]]; then
  timeout "${ENGINE_TIMEOUT:-540}" python -m kvroll.cli bench --config "${BENCH_CONFIG:-configs/bench/qwen3_1.7b_h100.yaml}" \
    --out "$OUT/bench" --no-progress "$@" 2>&1 | tail -60 \
    | tee "$OUT/engine.log"
fi
