#!/usr/bin/env bash
# Learning fidelity over seeds (issue 15 §3), one device call per trainer; results land in $OUT.
#   source benchmarks/device_env.sh && bash benchmarks/run_fidelity_gpu.sh grpo     # staging: stage_fidelity.sh
#   source benchmarks/device_env.sh && bash benchmarks/run_fidelity_gpu.sh ppo
# Launches every run of the trainer at once as background processes: SEEDS (0 1 2) x ARMS (full, rkv, longflow,
# rkv+sparse_rl) on the long-completion task (a 29-token prompt, completions up to 384 tokens), the budget fixed at
# 46 tokens for the whole cache (the literal budget: 25% of full's 185-token mean completion, see
# docs/benchmarks/grpo_learning_fidelity.md), 8 prompts x 8 samples a step, R-KV buffer 8, each run under `timeout`
# so that all have stopped DEADLINE_S (default 490) seconds after this script started. Then it aggregates over
# seeds on the steps every run finished (benchmarks/grpo_learning_fidelity.py --summary, which names the runs
# that did not finish STEPS). Runs go round-robin over the visible GPUs (all on one GPU on nvidia-h200).
# Each run saves its JSON after every step; $OUT gets five files (the device returns at most 8):
# fidelity_<stage>.log (this console), fidelity_<stage>_runs.tar.gz (every run's JSON and log, refreshed every
# 60 s, so a call killed at its limit still returns the finished steps), summary_<stage>.md / .json and
# reward_curves_<stage>.png.
# A study longer than one call (40 steps of 12 runs: ~22 minutes for GRPO on one H200) runs detached inside one
# lease, OUT on the machine's disk, later calls of the lease copying it back (docs/benchmarks/learning_fidelity_seeds.md):
#   (OUT=/root/fid/grpo DEADLINE_S=1500 setsid nohup bash benchmarks/run_fidelity_gpu.sh grpo > /root/fid/grpo.console \
#      2>&1 < /dev/null &); sleep 575; cp /root/fid/grpo/* $OUT/
# CPU smoke: DEVICE=cpu SEEDS="0 1" ARMS="full rkv+sparse_rl" FIDELITY_ARGS="--model /tmp/tiny --steps 2 ..."
set -uo pipefail
STAGE=${1:-}
case $STAGE in grpo|ppo) ;; *) echo "usage: run_fidelity_gpu.sh grpo|ppo (got '$STAGE')" >&2; exit 2 ;; esac
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # 12 processes on 16 cores: no thread pools fighting over them
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
OUT="${OUT:-out}"; mkdir -p "$OUT"
WORK="${WORK:-/tmp/kvroll_fidelity_$STAGE}"; rm -rf "$WORK"; mkdir -p "$WORK/runs"
PY="${PYTHON:-python3}"
DEVICE="${DEVICE:-cuda}"
DEADLINE_S="${DEADLINE_S:-490}"
SEEDS="${SEEDS:-0 1 2}"
ARMS="${ARMS:-full rkv longflow rkv+sparse_rl}"
STEPS="${STEPS:-40}"
# --micro-batch 8: 8 rows per forward/backward (gradient accumulation to the 64-row step) bounds each run's
# training memory to a few GB, so that 12 runs fit one GPU.
DEFAULT_ARGS="--task-style long --task-max-operand 9 --max-completion-length 384 --prompts-per-step 8
  --generations 8 --micro-batch 8 --learning-rate 2e-5 --budget 46 --final-window 10
  --policy-kwargs {\"rkv\":{\"buffer\":8}}"
ARGS="--trainer $STAGE --steps $STEPS ${FIDELITY_ARGS:-$DEFAULT_ARGS}"
exec > >(tee -a "$OUT/fidelity_$STAGE.log") 2>&1

snapshot() {  # every run's JSON and log into $OUT, replaced whole
  tar czf "$OUT/fidelity_${STAGE}_runs.tmp.tar.gz" --exclude='run_*' -C "$WORK" runs \
    && mv "$OUT/fidelity_${STAGE}_runs.tmp.tar.gz" "$OUT/fidelity_${STAGE}_runs.tar.gz"
}
progress() {  # steps done per run, GPU memory
  "$PY" - "$WORK/runs" <<'EOF'
import json, pathlib, sys
done = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    try:
        run = json.loads(path.read_text())
    except ValueError:
        continue
    done.append(f"{run['arm']} s{run['seed']}: {run['steps_done']}")
print("steps done:", "; ".join(done) or "none yet", flush=True)
EOF
  [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
}

echo "== fidelity $STAGE: seeds [$SEEDS] x arms [$ARMS], until ${DEADLINE_S}s: $ARGS"
{ [[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__)"; } 2>&1
GPUS=1
[[ $DEVICE == cuda ]] && GPUS=$(nvidia-smi -L | wc -l)
# Convert the embedded GGUF once: 12 processes converting it at the same time would race on the cache folder.
[[ $ARGS == *--model* ]] || "$PY" -c "from kvroll.rollout.model import smollm2_checkpoint; smollm2_checkpoint()"

i=0; pids=()
for seed in $SEEDS; do
  for arm in $ARMS; do
    gpu=$(( (i + seed) % GPUS )); i=$(( i + 1 ))  # with 4 GPUs each one gets three different arms
    log="$WORK/runs/${arm/+/-}-s$seed.log"
    (
      # shellcheck disable=SC2086  # ARGS is a list of flags
      CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 "$(( DEADLINE_S - SECONDS ))" "$PY" benchmarks/grpo_learning_fidelity.py \
        --device "$DEVICE" --out "$WORK/runs" $ARGS --seed "$seed" --policies "$arm" --no-summary > "$log" 2>&1
      echo "$STAGE $arm seed $seed exit $? at ${SECONDS}s" | tee -a "$log"
    ) &
    pids+=($!)
  done
done
echo "launched $i runs on $GPUS GPU(s) at ${SECONDS}s"
( while sleep 60; do echo "-- ${SECONDS}s"; progress; snapshot; done ) &
monitor=$!
wait "${pids[@]}"
kill "$monitor" 2>/dev/null
echo "== all runs stopped at ${SECONDS}s"
progress
grep -h "final reward\|Error\|error:" "$WORK"/runs/*.log | grep -v "Warning" | tail -40
# shellcheck disable=SC2086
"$PY" benchmarks/grpo_learning_fidelity.py --summary --out "$WORK/runs" $ARGS 2>&1 | grep -v "Warning\|warn("
for f in "summary_$STAGE.md" "summary_$STAGE.json" "reward_curves_$STAGE.png"; do
  cp "$WORK/runs/$f" "$OUT/" 2>/dev/null || echo "no $f"
done
snapshot
ls -la "$OUT"
echo "run_fidelity_gpu.sh $STAGE done in ${SECONDS}s"
