#!/usr/bin/env bash
# Session 36, call 2: the finish with every load at once (FINISH_EARLY) against main's finish in turn, at the
# kernel (LongFlow's and Hard-KV's calls, the engine's batches and the long tail) and in the engine (LongFlow at
# batches 64 and 128, the switch set by sed, one run per arm, arms alternated); the long tail's 128-token splits
# with a statistic at one and two slots (TAIL_STAT_SPLIT) (benchmarks/finish_early_ab.py).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c2
t0=$SECONDS
timeout 300 python benchmarks/finish_early_ab.py --out $OUT/c2 --budget-s 250 --rounds 5 2>&1 | grep -v Warning | tail -30
echo "probe done at $((SECONDS - t0)) s"
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c2/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c2/engine.jsonl; rm -rf $OUT/bench; }
F=kvroll/kernels/decode_attention.py
for spec in "longflow 64 new" "longflow 64 old" "longflow 128 old" "longflow 128 new"; do
  set -- $spec
  if (( SECONDS - t0 > 520 )); then echo "skip $spec (time)"; continue; fi
  if [ $3 = old ]; then sed -i 's/^FINISH_EARLY = True/FINISH_EARLY = False/' $F; else sed -i 's/^FINISH_EARLY = False/FINISH_EARLY = True/' $F; fi
  grep -c "^FINISH_EARLY = $([ $3 = old ] && echo False || echo True)" $F
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^FINISH_EARLY = False/FINISH_EARLY = True/' $F
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c2/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], "pure", round(r["pure_step_ms"], 4), "tok/s", round(r["tok_s"]))
PY
tar czf $OUT/c2.tgz -C $OUT c2 gpu.txt; rm -rf $OUT/c2
