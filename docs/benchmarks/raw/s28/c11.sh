#!/usr/bin/env bash
# Session 28, call 11: after the review's fix (a layer is chained only where the chain's GEMM takes its gate_up too,
# and the attention module follows the layer's decision, kvroll_chain): the chain's tests plainly, the rollout's GPU
# tests, and Qwen3-4B / Llama-3.2-1B at batch 64 on the final code (the rule's plain decode launch at 512 rows).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 120 python -m pytest -q -rfE tests/kernels/test_pdl_gemm.py tests/bench/test_dev_benchmarks.py -k "not event" -p no:cacheprovider 2>&1 | tail -4 > $OUT/tests_chain.log; tail -1 $OUT/tests_chain.log
timeout 120 python -m pytest -q -rfE -m gpu tests/rollout -p no:cacheprovider 2>&1 | tail -4 > $OUT/tests_rollout.log; tail -1 $OUT/tests_rollout.log
for arch in qwen3-4b llama-3.2-1b; do
  STAGES=engine ENGINE_TIMEOUT=120 bash benchmarks/run_gpu.sh --architecture $arch --policies longflow --budgets 1024 --batch_sizes 64 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine.log 2>&1
  python -c "
import json; r = json.loads(open('$OUT/bench/measurements.jsonl').readline())
print('$arch', r['batch'], round(r['steady_step_ms'], 3), round(r['floor_step_ms'], 3), round(r['step_over_floor'], 4), r['kernels_per_step'])"
  rm -rf $OUT/bench
done | tee $OUT/rows.txt
rm -f $OUT/engine.log
