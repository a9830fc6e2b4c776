#!/usr/bin/env bash
# Session 23's device calls: optional GPU tests, then engine rows (the committed code, once each; with FLAG set, the
# same rows again with that module switch off, "old"), one `kvroll bench` run per row spec.
#   ROWS="longflow,snapkv:64 rkv:256" [FLAG=SPLIT_K FLAG_FILE=kvroll/kernels/split_k.py] [SUITE=1] [TESTS=1 TEST_FILES=...]
#   [ENGINE_TIMEOUT=s] [ARCH=llama-3.2-1b (session 26)] bash docs/benchmarks/raw/s23/calls.sh
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
FLAG=${FLAG:-}
FLAG_FILE=${FLAG_FILE:-kvroll/kernels/decode_attention.py}
TEST_FILES=${TEST_FILES:-tests/kernels/test_split_k.py tests/bench tests/kernels/test_decode_attention.py}
KERNELS=${KERNELS:-decode}  # top kernels printed: names containing one of these (| separated)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
if [[ -n ${SUITE:-} ]]; then  # the whole GPU suite
  timeout 330 python -m pytest -q -m gpu tests/kernels tests/rollout tests/bench tests/policies -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_suite.log; tail -1 $OUT/gpu_suite.log
fi
if [[ -n ${TESTS:-} ]]; then
  timeout ${TESTS_TIMEOUT:-200} python -m pytest -q -m gpu $TEST_FILES -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
fi
eng() { STAGES=engine ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-230} bash benchmarks/run_gpu.sh ${ARCH:+--architecture $ARCH} --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$3.log 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
# the switch at a line's start, or indented (a class attribute; session 29)
use_old() { [[ -n $FLAG ]] && sed -i "s/^\( *\)$FLAG = True /\1$FLAG = False /" $FLAG_FILE; }
use_new() { [[ -n $FLAG ]] && sed -i "s/^\( *\)$FLAG = False /\1$FLAG = True /" $FLAG_FILE; }
for spec in ${ROWS:-}; do
  t0=$SECONDS; use_new; eng ${spec%%:*} ${spec##*:} new; echo "$spec new $((SECONDS - t0)) s"
  if [[ -n $FLAG ]]; then t0=$SECONDS; use_old; eng ${spec%%:*} ${spec##*:} old; use_new; echo "$spec old $((SECONDS - t0)) s"; fi
done
python - <<'PY'
import json, os
names = os.environ.get("KERNELS", "decode").split("|")
for tag in ("new", "old"):
    path = os.environ["OUT"] + f"/{tag}.jsonl"
    if not os.path.exists(path):
        continue
    for line in open(path):
        r = json.loads(line)
        print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["floor_step_ms"], 3), round(r["step_over_floor"], 4),
              round(r.get("mean_live_tokens", 0), 1), r.get("live_tokens_end"), r["kernels_per_step"], round(r["kernel_us_per_step"]), round(r["tok_s"]),
              [(k[0][:20], k[1], round(k[2], 1)) for k in r["top_kernels"] if any(n.lower() in k[0].lower() for n in names)])
PY
