#!/usr/bin/env bash
# Session 21's engine A/B in one call: the committed code ("new": the output head fused with the draw at <= 64 rows)
# against the same code with HEAD_MAX_ROWS = 0 ("old": cuBLAS's head, then the fused sampler), alternated.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 150 python -m pytest -q -m gpu tests/kernels/test_head_sample.py tests/kernels/test_sample.py tests/rollout/test_graphs.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=230 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > /dev/null 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
use_old() { sed -i 's/^HEAD_MAX_ROWS = 64 /HEAD_MAX_ROWS = 0 /' kvroll/kernels/sample.py; }
use_new() { sed -i 's/^HEAD_MAX_ROWS = 0 /HEAD_MAX_ROWS = 64 /' kvroll/kernels/sample.py; }
for spec in ${ROWS:-longflow:8,64 snapkv:64}; do
  use_new; eng ${spec%%:*} ${spec##*:} new
  use_old; eng ${spec%%:*} ${spec##*:} old
done
use_new
python - <<'PY'
import json, os
for tag in ("new", "old"):
    for line in open(os.environ["OUT"] + f"/{tag}.jsonl"):
        r = json.loads(line); print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]), [(k[0][:14], k[1], round(k[2], 1)) for k in r["top_kernels"] if k[0] in ("_head_kernel", "_chunk_kernel", "_merge_kernel") or "384x" in k[0] or k[1] == 1])
PY
