#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 120 python -m pytest -q -m gpu tests/kernels/test_rotary.py tests/kernels/test_fused_qkv_rotary.py -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
eng() { STAGES=engine ENGINE_TIMEOUT=230 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > /dev/null 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
mkdir -p /tmp/new && cp kvroll/rollout/engine.py kvroll/rollout/schedule.py kvroll/kernels/sample.py kvroll/kernels/rotary.py /tmp/new/
use_old() { cp benchmarks/_old/engine.py benchmarks/_old/schedule.py kvroll/rollout/; cp benchmarks/_old/sample.py benchmarks/_old/rotary.py kvroll/kernels/; }
use_new() { cp /tmp/new/engine.py /tmp/new/schedule.py kvroll/rollout/; cp /tmp/new/sample.py /tmp/new/rotary.py kvroll/kernels/; }
use_new; eng longflow 64,128,256 new
use_old; eng longflow 64,128,256 old
use_new; eng longflow 8 new; eng rkv 64 new
use_old; eng longflow 8 old; eng rkv 64 old
use_new
python - <<'PY'
import json, os
for tag in ("new", "old"):
    for line in open(os.environ["OUT"] + f"/{tag}.jsonl"):
        r = json.loads(line); print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]), [(k[0][:14], round(k[2], 1)) for k in r["top_kernels"] if k[0] in ("_rotary_kernel", "_chunk_kernel")])
PY
