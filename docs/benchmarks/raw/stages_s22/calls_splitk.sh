#!/usr/bin/env bash
# Session 22's split-K A/B in one call: the committed code ("new": the o and down projections as 2 K slices whose
# fp32 partials add_rms_norm sums, kvroll/kernels/split_k.py) against the same code with SPLIT_K = False ("old").
#   ROWS="longflow:64 snapkv:64" bash docs/benchmarks/raw/stages_s22/calls_splitk.sh  (SHAPES=, TESTS=1, SUITE=1 optional)
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
if [[ -n ${SHAPES:-} ]]; then
  timeout 120 python benchmarks/gemm_ksplit_bmm.py --out $OUT --rows 1,16,64,128,256 --variants k2_fp32 --shapes $SHAPES 2>&1 | tail -12
fi
if [[ -n ${SUITE:-} ]]; then  # the whole GPU suite
  timeout 330 python -m pytest -q -m gpu tests/kernels tests/rollout tests/bench tests/policies -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_suite.log; tail -1 $OUT/gpu_suite.log
fi
if [[ -n ${TESTS:-} ]]; then
  timeout 200 python -m pytest -q -m gpu tests/kernels/test_split_k.py tests/kernels/test_add_rms_norm.py tests/kernels/test_fused_add_norm.py tests/kernels/test_fusion_switches.py tests/rollout/test_graphs.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
fi
eng() { STAGES=engine ENGINE_TIMEOUT=230 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > /dev/null 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
use_old() { sed -i 's/^SPLIT_K = True /SPLIT_K = False /' kvroll/kernels/split_k.py; }
use_new() { sed -i 's/^SPLIT_K = False /SPLIT_K = True /' kvroll/kernels/split_k.py; }
for spec in ${ROWS:-longflow:64 snapkv:64}; do
  use_new; eng ${spec%%:*} ${spec##*:} new
  use_old; eng ${spec%%:*} ${spec##*:} old
done
use_new
python - <<'PY'
import json, os
for tag in ("new", "old"):
    for line in open(os.environ["OUT"] + f"/{tag}.jsonl"):
        r = json.loads(line); print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]), [(k[0][:20], k[1], round(k[2], 1)) for k in r["top_kernels"] if "nvjet" in k[0] or "add_rms" in k[0] or "gemm" in k[0].lower()])
PY
