#!/usr/bin/env bash
# Session 31, call 7: does an L2 prefetch issued from a kernel land? benchmarks/l2_prefetch_check.py at 16 and 8 MB.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
mkdir -p $OUT/a $OUT/b
timeout 120 python benchmarks/l2_prefetch_check.py --mb 16 --out $OUT/a 2>&1 | tail -8
timeout 120 python benchmarks/l2_prefetch_check.py --mb 8 --out $OUT/b 2>&1 | tail -8
