#!/usr/bin/env bash
# Session 36, call 5: the engine at the long tail's batches, FINISH_EARLY on ("new") against off ("old", set by
# sed), one run per arm, arms alternated: LongFlow at batches 1 and 8, Hard-KV at batch 1 (the mass into its votes).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c5
t0=$SECONDS
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c5/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c5/engine.jsonl; rm -rf $OUT/bench; }
F=kvroll/kernels/decode_attention.py
for spec in "longflow 1 new" "longflow 1 old" "longflow 8 old" "longflow 8 new" "hardkv 1 new" "hardkv 1 old" "longflow 1 new" "longflow 1 old"; do
  set -- $spec
  if (( SECONDS - t0 > 500 )); then echo "skip $spec (time)"; continue; fi
  if [ $3 = old ]; then sed -i 's/^FINISH_EARLY = True/FINISH_EARLY = False/' $F; else sed -i 's/^FINISH_EARLY = False/FINISH_EARLY = True/' $F; fi
  grep -c "^FINISH_EARLY = $([ $3 = old ] && echo False || echo True)" $F
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^FINISH_EARLY = False/FINISH_EARLY = True/' $F
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c5/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], "tok/s", round(r["tok_s"]))
PY
tar czf $OUT/c5.tgz -C $OUT c5 gpu.txt; rm -rf $OUT/c5
