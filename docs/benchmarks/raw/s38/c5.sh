#!/usr/bin/env bash
# Session 38, call 5 (nvidia-h100-x1): after the read of the change (the tile draw's dead fallback removed, the head
# benchmarks' shared set-up): head_sample's tile-draw, NaN and GPU tests plainly on the GPU; both head benchmarks,
# briefly (one round), to check they run.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
mkdir -p $OUT/c5
t0=$SECONDS
timeout 200 python -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_head_sample.py \
  -k "tile or follow or nan or gpu or engine" > $OUT/c5/tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -2 $OUT/c5/tests.log
timeout 60 python benchmarks/head_tile_draw_ab.py --out $OUT/c5 --rows 48,64 --rounds 1 > $OUT/c5/tile_ab.log 2>&1
echo "tile ab rc $?"; cut -c1-300 $OUT/c5/tile_ab.log | tail -2
timeout 60 python benchmarks/head_sample_ab.py --out $OUT/c5 --rows 8 --rounds 1 > $OUT/c5/head_ab.log 2>&1
echo "head ab rc $?"; cut -c1-300 $OUT/c5/head_ab.log | tail -1
tar czf $OUT/c5.tgz -C $OUT c5; rm -rf $OUT/c5
