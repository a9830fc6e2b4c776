#!/usr/bin/env bash
# Session 26, call 8 (after a call that carried .devstage/p1 into /root/devstage): the embedded SmolLM2-135M-Instruct
# (real weights: 30 layers, 3 KV heads of 64) on the GPU, R-KV's redundancy as the scan against "ordered"
# (ORDERED_SCAN = False the old) at batches 64 and 256, budget 1,024, prompt 512, 4,096 new tokens: the scan's gain
# on a real model's keys, where the random-weight benchmark shows its worst case.
set -uo pipefail
bash .devstage/p0/install.sh > $OUT/install.log 2>&1; tail -2 $OUT/install.log
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
CKPT=$(python -c "from kvroll.rollout.model import smollm2_checkpoint; print(smollm2_checkpoint())" 2>/dev/null | tail -1)
echo "checkpoint: $CKPT"  # (run_gpu.sh sets PYTHONPATH=., so the bench takes the converted checkpoint's folder)
cat > /tmp/smol.yaml <<Y
model: $CKPT
policies: [rkv]
budgets: [1024]
batch_sizes: [64]
output_lengths: [4096]
prompt_length: 512
steady_steps: 512
full_steps: 32
hf_generate: false
reserve_gb: 8
max_batch_cap: 1024
temperature: 1.0
seed: 0
Y
export BENCH_CONFIG=/tmp/smol.yaml
ROWS="rkv:64 rkv:256" FLAG=ORDERED_SCAN FLAG_FILE=kvroll/kernels/rkv_redundancy.py KERNELS="rkv|norm_sum|redund" ENGINE_TIMEOUT=200 bash docs/benchmarks/raw/s23/calls.sh
python - <<'PY'
import json, os
for tag in ("new", "old"):
    for line in open(os.environ["OUT"] + f"/{tag}.jsonl"):
        r = json.loads(line)
        print(tag, r["policy"], r["batch"], "events", r["events"], "event ms (mean)", round(1000 * r["policy_s"] / max(1, r["events"]), 2),
              "policy_frac", round(r["policy_frac"], 4), "decode_s", round(r["decode_s"], 3))
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
