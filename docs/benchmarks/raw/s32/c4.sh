#!/usr/bin/env bash
# Session 32, call 4: the one-pass merge's rule (`_merge_one_pass`: a head's (query head, dim) elements under 1,024,
# so 8 query heads per KV head at head_dim 128 keep the two passes), on the shapes where c3 found attention alone
# slower in one pass, and neighbours; then the decode kernel's GPU tests on the final code.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c4
t0=$SECONDS
if git rev-parse HEAD >/dev/null 2>&1; then
  git diff --name-only HEAD | grep -v -e kvroll/kernels/decode_attention.py -e tests/kernels/test_decode_attention.py | xargs -r git checkout HEAD --
fi
timeout 150 python benchmarks/merge_apart_ab.py --out $OUT/c4 --rounds 3 --budget-s 120 \
  --dims 1:128:8:8192,1:128:8:2048,1:128:8:32768,2:128:8:16384,1:128:4:8192,1:128:2:8192,1:64:8:8192,4:64:8:8192,8:64:8:32768 > $OUT/c4/merge_apart_ab.log 2>&1
echo "probe rc $? at $((SECONDS - t0)) s"; cat $OUT/c4/merge_apart_ab.log
timeout 170 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py -p no:cacheprovider > $OUT/c4/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c4/gpu_tests.log
tar czf $OUT/c4.tgz -C $OUT c4 gpu.txt; rm -rf $OUT/c4
