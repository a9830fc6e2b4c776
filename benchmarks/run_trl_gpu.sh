#!/usr/bin/env bash
# The TRL issue's GPU measurements, device calls of at most ~9.5 minutes each; results land in $OUT.
#   source benchmarks/device_env.sh && STAGES=zero3,fidelity bash benchmarks/run_trl_gpu.sh   # call 1
#   source benchmarks/device_env.sh && STAGES=speed bash benchmarks/run_trl_gpu.sh            # call 2
#   source benchmarks/device_env.sh && STAGES=literal bash benchmarks/run_trl_gpu.sh          # call 3
# Stages run in a fixed order (zero3, fidelity, literal, speed) against one wall-clock budget, TOTAL_S seconds from
# this script's start (default 540); each gets at most what is left. A stage cut by its timeout keeps what it wrote:
# the fidelity benchmark writes every policy's curve after each step, the speed benchmark stops TRL's path itself
# before its budget and reports a lower bound. $OUT gets at most 8 files (the device returns no more): logs, the
# headline files, and one tarball of everything.
#   zero3:    tests/trainers/zero3_worker.py: 2-step GRPO under DeepSpeed ZeRO-3, engine weights == gathered weights
#   fidelity: benchmarks/grpo_learning_fidelity.py, full vs rkv vs longflow on the embedded model (FIDELITY_ARGS)
#   literal:  the same at the literal budget (25% of full's mean completion length, nothing added) on the
#             long-completion task (~29-token prompts, ~160-token answers), so the prompt stays whole (LITERAL_ARGS)
#   speed:    benchmarks/grpo_rollout_speed.py, kvroll longflow 2048 vs TRL model.generate at 8192 (SPEED_ARGS)
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
OUT="${OUT:-out}"; mkdir -p "$OUT"
WORK="${WORK:-/tmp/kvroll_trl_gpu}"; rm -rf "$WORK"; mkdir -p "$WORK"
STAGES="${STAGES:-zero3,fidelity}"
TOTAL_S="${TOTAL_S:-540}"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"  # cpu: a smoke run of this script (small FIDELITY_ARGS / LITERAL_ARGS / SPEED_ARGS)
left() { echo $(( TOTAL_S - SECONDS )); }
# 40 steps x 64 rows (8 prompts x 8 samples), completions up to 256 tokens (reasoning prompt: ~60-90 on average);
# compressed budget = the longest prompt + 25% of full's mean completion length; R-KV compresses every 8 tokens.
DEFAULT_FIDELITY='--steps 40 --prompts-per-step 8 --generations 8 --max-completion-length 256 --learning-rate 2e-5
  --budget-base prompt --budget-fraction 0.25 --final-window 10 --task-max-operand 9 --policy-kwargs {"rkv":{"buffer":8}}'
FIDELITY_ARGS="${FIDELITY_ARGS:-$DEFAULT_FIDELITY}"
# 40 steps x 64 rows on --task-style long: on CPU SmolLM2 answered in 160 tokens on average (16-384; 1 in 32 cut at
# 384), so each rollout decodes ~384 steps; budget = floor(0.25 x full's mean length), ~40 > the 29-token prompt.
DEFAULT_LITERAL='--task-style long --steps 40 --prompts-per-step 8 --generations 8 --max-completion-length 384
  --learning-rate 2e-5 --budget-base none --budget-fraction 0.25 --final-window 10 --task-max-operand 9
  --policy-kwargs {"rkv":{"buffer":8}}'
LITERAL_ARGS="${LITERAL_ARGS:-$DEFAULT_LITERAL}"
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

# full first (its mean completion length sets the compressed budget), then rkv and longflow side by side: two
# processes share the GPU (a 135M model leaves it mostly idle), which shortens the stage by about a third. Rollout
# seconds of those two are then measured under contention (these stages measure learning, not speed).
fidelity_stage() {  # name, flags for benchmarks/grpo_learning_fidelity.py; runs until TOTAL_S - 25
  local name=$1 args=$2 end=$(( TOTAL_S - 25 ))
  fidelity_run() {
    # shellcheck disable=SC2086  # args is a list of flags
    timeout "$(( end - SECONDS ))" "$PY" benchmarks/grpo_learning_fidelity.py --device "$DEVICE" \
      --out "$WORK/$name" $args --policies "$1" > "$WORK/${name}_$1.log" 2>&1
    echo "$name $1 exit $? at ${SECONDS}s" >> "$WORK/${name}_$1.log"
  }
  echo "== $name (until ${end}s): $args"
  fidelity_run full
  if [[ ${FIDELITY_PARALLEL:-1} == 1 ]]; then fidelity_run rkv & fidelity_run longflow & wait
  else fidelity_run rkv; fidelity_run longflow; fi
  # shellcheck disable=SC2086
  "$PY" benchmarks/grpo_learning_fidelity.py --plot-only --out "$WORK/$name" $args > "$WORK/${name}_summary.log" 2>&1
  cat "$WORK"/"${name}"_{full,rkv,longflow,summary}.log | grep -v "it/s\]" > "$WORK/$name.log"
  grep -h "exit\|final reward\|note:" "$WORK"/"${name}"_{full,rkv,longflow}.log; cat "$WORK/${name}_summary.log"
  tail -300 "$WORK/$name.log" > "$OUT/$name.log"
  cp "$WORK/$name/summary_grpo.md" "$OUT/${name}_summary.md" 2>/dev/null
  cp "$WORK/$name/reward_curves_grpo.png" "$OUT/${name}_reward_curves.png" 2>/dev/null
}
[[ $STAGES == *fidelity* ]] && fidelity_stage fidelity "$FIDELITY_ARGS"
[[ $STAGES == *literal* ]] && fidelity_stage literal "$LITERAL_ARGS"

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
