#!/usr/bin/env bash
# Session 29, call 3: Hard-KV's events with the layers batched (``HardKVPolicy.batches_layers``, new) against one
# layer per call (the flag off, "old"). The GPU tests of the periodic policies and the rollout (-m gpu) and the
# layer-batched events' file plainly; one event by kernel (benchmarks/event_profile.py, 28 layers: the cache
# checksums show both keep the same tokens); the engine's Hard-KV rows at batches 16 and 64, new and old.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
t0=$SECONDS
timeout 200 python -m pytest -q -rfE -m gpu tests/rollout tests/policies -p no:cacheprovider 2>&1 | tail -6 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
timeout 100 python -m pytest -q -rfE tests/kernels/test_layer_batched_events.py -p no:cacheprovider 2>&1 | tail -3
echo "tests $((SECONDS - t0)) s"
old() { sed -i 's/^    batches_layers = True  # False: one layer/    batches_layers = False  # False: one layer/' kvroll/policies/hardkv.py; }
new() { sed -i 's/^    batches_layers = False  # False: one layer/    batches_layers = True  # False: one layer/' kvroll/policies/hardkv.py; }
for tag in new old; do
  $tag; grep -c "batches_layers = True" kvroll/policies/hardkv.py
  timeout 150 python benchmarks/event_profile.py --policies hardkv --slots 8,64 --layers 28 --label $tag --out $OUT/event_$tag.json 2>&1 | tail -8
done
new
FLAG=batches_layers FLAG_FILE=kvroll/policies/hardkv.py ROWS="hardkv:64 hardkv:16" KERNELS="decode|gemm" ENGINE_TIMEOUT=150 \
  bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
