#!/usr/bin/env bash
# Session 22's engine A/Bs in one call: the committed code ("new") against the same code with one module switch
# off ("old"), alternated per row. Default: decode_attention.launch_config's warps and stages against
# LAUNCH_RULE = False (4 warps, 3 stages everywhere); calls_splitk.sh sets the split-K switch instead.
#   ROWS="longflow:64 snapkv:64" [TESTS=1] [SUITE=1] [SHAPES=name:NxK,...] bash docs/benchmarks/raw/stages_s22/calls.sh
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
FLAG=${FLAG:-LAUNCH_RULE}
FLAG_FILE=${FLAG_FILE:-kvroll/kernels/decode_attention.py}
TEST_FILES=${TEST_FILES:-tests/kernels/test_decode_attention.py tests/rollout/test_graphs.py}
KERNELS=${KERNELS:-decode}  # top kernels printed: names containing one of these (| separated)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
if [[ -n ${SHAPES:-} ]]; then  # other models' projections, split-K against cuBLAS
  timeout 120 python benchmarks/gemm_ksplit_bmm.py --out $OUT --rows 1,16,64,128,256 --variants k2_fp32 --shapes $SHAPES 2>&1 | tail -12
fi
if [[ -n ${SUITE:-} ]]; then  # the whole GPU suite
  timeout 330 python -m pytest -q -m gpu tests/kernels tests/rollout tests/bench tests/policies -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_suite.log; tail -1 $OUT/gpu_suite.log
fi
if [[ -n ${TESTS:-} ]]; then
  timeout 200 python -m pytest -q -m gpu $TEST_FILES -p no:cacheprovider 2>&1 | tail -3 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
fi
eng() { STAGES=engine ENGINE_TIMEOUT=230 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > /dev/null 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
use_old() { sed -i "s/^$FLAG = True /$FLAG = False /" $FLAG_FILE; }
use_new() { sed -i "s/^$FLAG = False /$FLAG = True /" $FLAG_FILE; }
for spec in ${ROWS:-longflow:64 snapkv:64}; do
  use_new; eng ${spec%%:*} ${spec##*:} new
  use_old; eng ${spec%%:*} ${spec##*:} old
done
use_new
python - <<'PY'
import json, os
names = os.environ.get("KERNELS", "decode").split("|")
for tag in ("new", "old"):
    for line in open(os.environ["OUT"] + f"/{tag}.jsonl"):
        r = json.loads(line); print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["step_over_floor"], 4), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]), [(k[0][:20], k[1], round(k[2], 1)) for k in r["top_kernels"] if any(n.lower() in k[0].lower() for n in names)])
PY
