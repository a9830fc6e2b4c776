#!/usr/bin/env bash
# Session 21's engine A/B in one call: the step's rotary and cache write inside the decode kernel ("new",
# ROTARY_IN_ATTENTION = True) against the rotary kernel before it ("old", the same code with the switch off).
# The code is not in kvroll (not adopted): the call applies rotary_in_attention.patch (against 472a2c4) first.
set -uo pipefail
grep -q ROTARY_IN_ATTENTION kvroll/rollout/cache.py || git apply docs/benchmarks/raw/head_s21/rotary_in_attention.patch
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
if [ -n "${TESTS:-}" ]; then timeout 240 python -m pytest -q -m gpu $TESTS -p no:cacheprovider 2>&1 | tail -5 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log; fi
eng() { STAGES=engine ENGINE_TIMEOUT=230 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > /dev/null 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
use_old() { sed -i 's/^ROTARY_IN_ATTENTION = True/ROTARY_IN_ATTENTION = False/' kvroll/rollout/cache.py; }
use_new() { sed -i 's/^ROTARY_IN_ATTENTION = False/ROTARY_IN_ATTENTION = True/' kvroll/rollout/cache.py; }
for spec in ${ROWS:-longflow:64}; do
  use_new; eng ${spec%%:*} ${spec##*:} new
  use_old; eng ${spec%%:*} ${spec##*:} old
done
use_new
python - <<'PY'
import json, os
for tag in ("new", "old"):
    path = os.environ["OUT"] + f"/{tag}.jsonl"
    if not os.path.exists(path): continue
    for line in open(path):
        r = json.loads(line); print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]), [(k[0][:16], k[1], round(k[2], 1)) for k in r["top_kernels"] if k[0] in ("_rotary_kernel", "_decode_split_kernel")])
PY
