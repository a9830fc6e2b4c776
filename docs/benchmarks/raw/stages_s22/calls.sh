#!/usr/bin/env bash
# Session 22's engine A/B in one call: the committed code ("new": decode_attention.launch_config's warps and
# stages) against the same code with LAUNCH_RULE = False ("old": 4 warps, 3 stages everywhere), alternated.
#   ROWS="longflow:64 snapkv:64" bash docs/benchmarks/raw/stages_s22/calls.sh
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
if [[ -n ${TESTS:-} ]]; then
  timeout 200 python -m pytest -q -m gpu tests/kernels/test_decode_attention.py tests/rollout/test_graphs.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
fi
eng() { STAGES=engine ENGINE_TIMEOUT=230 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > /dev/null 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
use_old() { sed -i 's/^LAUNCH_RULE = True /LAUNCH_RULE = False /' kvroll/kernels/decode_attention.py; }
use_new() { sed -i 's/^LAUNCH_RULE = False /LAUNCH_RULE = True /' kvroll/kernels/decode_attention.py; }
for spec in ${ROWS:-longflow:64 snapkv:64}; do
  use_new; eng ${spec%%:*} ${spec##*:} new
  use_old; eng ${spec%%:*} ${spec##*:} old
done
use_new
python - <<'PY'
import json, os
for tag in ("new", "old"):
    for line in open(os.environ["OUT"] + f"/{tag}.jsonl"):
        r = json.loads(line); print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]), [(k[0][:20], k[1], round(k[2], 1)) for k in r["top_kernels"] if "decode" in k[0]])
PY
