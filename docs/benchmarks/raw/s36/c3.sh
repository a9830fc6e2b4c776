#!/usr/bin/env bash
# Session 36, call 3: tail_stat_split's rule at two slots (benchmarks/finish_early_ab.py --part check2), then the
# decode kernel's GPU tests plainly on the session's code (FINISH_EARLY, the rule).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c3
t0=$SECONDS
timeout 200 python benchmarks/finish_early_ab.py --out $OUT/c3 --part check2,split --budget-s 150 --rounds 5 2>&1 | grep -v Warning | tail -30
echo "probe done at $((SECONDS - t0)) s"
timeout 330 python -m pytest -q -rfE tests/kernels/test_decode_attention.py -p no:cacheprovider > $OUT/c3/gpu_tests.log 2>&1
echo "decode tests rc $? at $((SECONDS - t0)) s"; tail -4 $OUT/c3/gpu_tests.log
tar czf $OUT/c3.tgz -C $OUT c3 gpu.txt; rm -rf $OUT/c3
