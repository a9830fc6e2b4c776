#!/usr/bin/env bash
# Session 26, call 6: R-KV's and Hard-KV's events at 64 slots by kernel (what is left of a batch-64 step's periodic
# work), then the chain of Qwen3-4B and 8B past 8 rows (FEW_ROWS = 32 on the device only; PDL_CHAIN = False the
# old), LongFlow at batches 16 and 32.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 150 python benchmarks/event_profile.py --policies rkv,hardkv --slots 64 --out $OUT/event_profile_64.json 2>&1 | tail -4 | cut -c1-400
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/event_profile_64.json")):
    print(r["policy"], r["slots"], "graph ms", round(r["graph_ms"], 3), "kernel ms", round(r["kernel_ms"], 3), "kernels", r["kernels"])
    for name, v in r["top"].items():
        print("   ", round(v["us"], 1), v["calls"], name[:90])
PY
F=kvroll/kernels/pdl_gemm.py
sed -i "s/^FEW_ROWS = 8$/FEW_ROWS = 32/" $F; grep -n "^FEW_ROWS =" $F
eng() { STAGES=engine ENGINE_TIMEOUT=150 bash benchmarks/run_gpu.sh --architecture $1 --policies longflow --budgets 1024 --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$1_$2.log 2>&1; cat $OUT/bench/measurements.jsonl | sed "s/^{/{\"arch\": \"$1\", /" >> $OUT/$2.jsonl; rm -rf $OUT/bench; }
for spec in qwen3-4b:16,32 qwen3-8b:16,32; do
  arch=${spec%%:*}; b=${spec##*:}
  t0=$SECONDS; eng $arch new $b; echo "$arch new $((SECONDS - t0)) s"
  t0=$SECONDS; sed -i "s/^PDL_CHAIN = True /PDL_CHAIN = False /" $F; eng $arch old $b; sed -i "s/^PDL_CHAIN = False /PDL_CHAIN = True /" $F; echo "$arch old $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
for tag in ("new", "old"):
    path = os.environ["OUT"] + f"/{tag}.jsonl"
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            print(tag, r["arch"], r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["floor_step_ms"], 3),
                  round(r["step_over_floor"], 4), r["kernels_per_step"])
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
