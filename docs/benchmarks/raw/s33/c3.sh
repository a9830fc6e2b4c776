#!/usr/bin/env bash
# Session 33, call 3: main's code as committed (f903acb; session 32's final merge rules had not run on a GPU):
#  1. issue 16 §3's long-tail grid in one run (`kernel_tail.py --mode check`: 64 shapes, attention alone and with
#     LongFlow's statistic against SDPA);
#  2. the decode kernel's GPU tests.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3
t0=$SECONDS
git rev-parse --short HEAD 2>/dev/null; git status --short 2>/dev/null | head
timeout 390 python benchmarks/kernel_tail.py --mode check --out $OUT/c3 --budget-s 370 > $OUT/c3/kernel_tail_check.log 2>&1
echo "tail check rc $? at $((SECONDS - t0)) s"; tail -8 $OUT/c3/kernel_tail_check.log
timeout $((585 - (SECONDS - t0))) python -m pytest -q -m gpu tests/kernels/test_decode_attention.py -p no:cacheprovider > $OUT/c3/gpu_tests.log 2>&1
echo "tests rc $? at $((SECONDS - t0)) s"; tail -3 $OUT/c3/gpu_tests.log
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
