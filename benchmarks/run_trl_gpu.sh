#!/usr/bin/env bash
# The TRL issue's GPU measurements, two device calls of at most ~9.5 minutes each; results land in $OUT.
#   source benchmarks/device_env.sh && STAGES=zero3,fidelity bash benchmarks/run_trl_gpu.sh   # call 1
#   source benchmarks/device_env.sh && STAGES=speed bash benchmarks/run_trl_gpu.sh            # call 2
# Stages run in a fixed order (zero3, fidelity, speed) against one wall-clock budget, TOTAL_S seconds from this
# script's start (default 540); each gets at most what is left. A stage cut by its timeout keeps what it wrote:
# the fidelity benchmark writes every policy's curve after each step, the speed benchmark stops TRL's path itself
# before its budget and reports a lower bound. $OUT gets at most 8 files (the device returns no more): logs, the
# headline files, and one tarball of everything.
#   zero3:    tests/trainers/zero3_worker.py: 2-step GRPO under DeepSpeed ZeRO-3, engine weights == gathered weights
#   fidelity: benchmarks/grpo_learning_fidelity.py, full vs rkv vs longflow on the embedded model (FIDELITY_ARGS)
#   speed:    benchmarks/grpo_rollout_speed.py, kvroll longflow 2048 vs TRL model.generate at 8192 (SPEED_ARGS)
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
OUT="${OUT:-out}"; mkdir -p "$OUT"
WORK="${WORK:-/tmp/kvroll_trl_gpu}"; rm -rf "$WORK"; mkdir -p "$WORK"
STAGES="${STAGES:-zero3,fidelity}"
TOTAL_S="${TOTAL_S:-540}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"  # cpu: a smoke run of this script (with small FIDELITY_ARGS / SPEED_ARGS)
left() { echo $(( TOTAL_S - SECONDS )); }
# 40 steps x 64 rows (8 prompts x 8 samples), completions up to 256 tokens (reasoning prompt: ~60-90 on average);
# compressed budget = the longest prompt + 25% of full's mean completion length; R-KV compresses every 8 tokens.
DEFAULT_FIDELITY='--steps 40 --prompts-per-step 8 --generations 8 --max-completion-length 256 --learning-rate 2e-5
  --budget-base prompt --budget-fraction 0.25 --final-window 10 --task-max-operand 9 --policy-kwargs {"rkv":{"buffer":8}}'
FIDELITY_ARGS="${FIDELITY_ARGS:-$DEFAULT_FIDELITY}"
SPEED_ARGS="${SPEED_ARGS:---max-completion-length 8192 --budget 2048 --policy longflow --stop-after-rollout}"

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  "$PY" -c "import torch, transformers, trl, deepspeed; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, 'deepspeed', deepspeed.__version__)"; } 2>&1 | tee "$WORK/env.txt"

if [[ $STAGES == *zero3* ]]; then
  t=$(( $(left) < 150 ? $(left) : 150 ))
  echo "== zero3 (timeout ${t}s)"
  timeout "$t" "$PY" tests/trainers/zero3_worker.py "$WORK/zero3" --device "$DEVICE" > "$WORK/zero3.log" 2>&1
  echo "zero3 exit $?" >> "$WORK/zero3.log"
  grep -v "Warning\|warn(" "$WORK/zero3.log" | tail -25
  tail -60 "$WORK/zero3.log" > "$OUT/zero3.log"
fi

if [[ $STAGES == *fidelity* ]]; then
  # full first (its mean completion length sets the compressed budget), then rkv and longflow side by side: two
  # processes share the GPU (a 135M model leaves it mostly idle), which shortens the stage by about a third.
  # Rollout seconds of those two are then measured under contention (this stage measures learning, not speed).
  end=$(( TOTAL_S - 25 ))
  fidelity() {
    # shellcheck disable=SC2086  # FIDELITY_ARGS is a list of flags
    timeout "$(( end - SECONDS ))" "$PY" benchmarks/grpo_learning_fidelity.py --device "$DEVICE" \
      --out "$WORK/fidelity" $FIDELITY_ARGS --policies "$1" > "$WORK/fidelity_$1.log" 2>&1
    echo "fidelity $1 exit $? at ${SECONDS}s" >> "$WORK/fidelity_$1.log"
  }
  echo "== fidelity (until ${end}s): $FIDELITY_ARGS"
  fidelity full
  if [[ ${FIDELITY_PARALLEL:-1} == 1 ]]; then fidelity rkv & fidelity longflow & wait
  else fidelity rkv; fidelity longflow; fi
  # shellcheck disable=SC2086
  "$PY" benchmarks/grpo_learning_fidelity.py --plot-only --out "$WORK/fidelity" $FIDELITY_ARGS \
    > "$WORK/fidelity_summary.log" 2>&1
  cat "$WORK"/fidelity_{full,rkv,longflow,summary}.log | grep -v "it/s\]" > "$WORK/fidelity.log"
  grep -h "exit\|final reward" "$WORK"/fidelity_{full,rkv,longflow}.log; cat "$WORK/fidelity_summary.log"
  tail -300 "$WORK/fidelity.log" > "$OUT/fidelity.log"
  cp "$WORK/fidelity/summary.md" "$OUT/fidelity_summary.md" 2>/dev/null
  cp "$WORK/fidelity/reward_curves.png" "$OUT/reward_curves.png" 2>/dev/null
fi

if [[ $STAGES == *speed* ]]; then
  budget=$(( $(left) - 10 ))
  echo "== speed (time budget ${budget}s): $SPEED_ARGS"
  # shellcheck disable=SC2086
  timeout "$(( budget + 5 ))" "$PY" benchmarks/grpo_rollout_speed.py --device "$DEVICE" --time-budget "$budget" \
    --out "$WORK/speed" \
    $SPEED_ARGS > "$WORK/speed.log" 2>&1
  echo "speed exit $? after ${SECONDS}s" >> "$WORK/speed.log"
  grep -v "Warning\|warn(\|it/s\]" "$WORK/speed.log" | tail -20
  grep -v "it/s\]" "$WORK/speed.log" | tail -100 > "$OUT/speed.log"
  cp "$WORK"/speed/grpo_rollout_speed_* "$OUT/" 2>/dev/null
fi

find "$WORK" -name "*.safetensors" -delete
tar czf "$OUT/trl_gpu_${STAGES//,/_}.tar.gz" -C "$WORK" . && ls -la "$OUT"
echo "run_trl_gpu.sh done in ${SECONDS}s"
