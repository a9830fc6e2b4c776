#!/usr/bin/env bash
# Session 25, call 10: every policy at batch 64 on two architectures the benchmark's default does not name
# (Llama-3.2-1B: head_dim 64, 4 query heads per KV head, 16 layers; Qwen3-0.6B), the final code.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
for arch in ${ARCHS:-llama-3.2-1b qwen3-0.6b}; do
  t0=$SECONDS
  STAGES=engine ENGINE_TIMEOUT=200 bash benchmarks/run_gpu.sh --architecture $arch --policies full,longflow,rkv,snapkv,lagkv,hardkv \
    --budgets 1024 --batch_sizes 64 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$arch.log 2>&1
  sed "s/^{/{\"arch\": \"$arch\", /" $OUT/bench/measurements.jsonl >> $OUT/arch.jsonl; rm -rf $OUT/bench
  echo "$arch $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/arch.jsonl"):
    r = json.loads(line)
    print(r["arch"], r["policy"], r["batch"], round(r.get("steady_step_ms", 0), 3), round(r.get("floor_step_ms", 0), 3),
          round(r.get("step_over_floor", 0), 4), round(r.get("mean_live_tokens", 0), 1), r.get("kernels_per_step"),
          round(r.get("event_ms_median") or 0, 2), round(r.get("tok_s", 0)))
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
