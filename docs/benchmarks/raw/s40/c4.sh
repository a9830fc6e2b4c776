#!/usr/bin/env bash
# Session 40, call 4 (nvidia-h200): at batch 128 the chain's GEMMs lost to cuBLAS on this GPU in c2 (each product
# alone): LongFlow's step with the chain at 65-128 rows (main) against SHAPE_CHAIN = False (cuBLAS there), arms
# alternated; then issue 16's section 4 rows on this GPU, main's code, one run each.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c4
t0=$SECONDS
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c4/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c4/engine.jsonl; rm -rf $OUT/bench; }
for spec in "longflow 128 chain" "longflow 128 cublas" "longflow 128 cublas" "longflow 128 chain" "full 64 main" "longflow 256 main" "snapkv 64 main" "rkv 64 main" "lagkv 64 main" "hardkv 256 main" "full 128 main"; do
  set -- $spec
  if (( SECONDS - t0 > 500 )); then echo "skip $spec (time)"; continue; fi
  if [[ $3 == cublas ]]; then sed -i 's/^SHAPE_CHAIN = True/SHAPE_CHAIN = False/' kvroll/kernels/pdl_gemm.py
  else sed -i 's/^SHAPE_CHAIN = False/SHAPE_CHAIN = True/' kvroll/kernels/pdl_gemm.py; fi
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
sed -i 's/^SHAPE_CHAIN = False/SHAPE_CHAIN = True/' kvroll/kernels/pdl_gemm.py
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c4/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    extra = [(round(c), round(s / f, 3)) for c, s, f in r.get("step_curve", [])]
    print(r["arm"], r["policy"], r["batch"], round(r.get("steady_step_ms") or 0, 4), round(r.get("floor_step_ms") or 0, 4), round(r.get("step_over_floor") or 0, 4), r.get("kernels_per_step"), r.get("policy_share"), str(extra)[:300])
PY
tar czf $OUT/c4.tgz -C $OUT c4 gpu.txt; rm -rf $OUT/c4
