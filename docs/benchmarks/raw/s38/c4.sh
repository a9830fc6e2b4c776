#!/usr/bin/env bash
# Session 38, call 4 (nvidia-h100-x1): the session's final code plainly on a GPU: head_sample's tests (the tile draw
# with its width rule, the Qwen3-1.7B head at 1-64 rows), the fused sampler's GPU and engine tests, the graphs' GPU
# tests; then the tile-draw A/B at 33-64 rows on the final rule.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c4
t0=$SECONDS
timeout 330 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_head_sample.py \
  tests/kernels/test_sample.py -k "gpu or engine or tile or follow or rule" > $OUT/c4/tests_sample.log 2>&1
echo "sample tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c4/tests_sample.log
timeout 150 python -m pytest -q -rfE -p no:cacheprovider -m gpu tests/rollout/test_graphs.py > $OUT/c4/tests_graphs.log 2>&1
echo "graph tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c4/tests_graphs.log
timeout 100 python benchmarks/head_tile_draw_ab.py --out $OUT/c4 --rows 33,40,48,56,64 > $OUT/c4/ab.log 2>&1
echo "ab rc $? at $((SECONDS - t0)) s"; cut -c1-400 $OUT/c4/ab.log | tail -5
tar czf $OUT/c4.tgz -C $OUT c4 gpu.txt; rm -rf $OUT/c4
