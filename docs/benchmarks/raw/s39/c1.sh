#!/usr/bin/env bash
# Session 39, call 1 (nvidia-h100-x1): the chain's o and down in more K slices (benchmarks/split_k_parts_probe.py:
# o, down with add_rms_norm, qkv alone, at 64 and 128 rows); the best 3-4-slice tile of o and down at each row
# count that beats the rule's by >= 3% goes into PARTS_TILES (sed), and the engine's LongFlow row at batch 64 runs
# with it and without (one run each, arms alternated).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
mkdir -p $OUT/c1
t0=$SECONDS
timeout 300 python benchmarks/split_k_parts_probe.py --rows 64,128 --time_limit 240 --out $OUT/c1/probe.json > $OUT/c1/probe.log 2>&1
echo "probe rc $? at $((SECONDS - t0)) s"; cut -c1-420 $OUT/c1/probe.log | tail -12
python - <<'PY' > $OUT/c1/parts_tiles.txt
import json, os
rows = json.load(open(os.environ["OUT"] + "/c1/probe.json"))
tiles = {}
for r in rows:
    if r["proj"] not in ("o", "down"):
        continue
    timed = {k: v for k, v in r["configs"].items() if isinstance(v, dict)}
    rule = "p%d_" % r["rule"][0] + "x".join(map(str, r["rule"][1]))
    more = [k for k in timed if int(k.split("_")[0][1:]) > 2]
    if not more or rule not in timed:
        continue
    best = min(more, key=lambda k: timed[k]["us"])
    if timed[best]["us"] < 0.97 * timed[rule]["us"]:
        parts = int(best.split("_")[0][1:])
        cfg = tuple(int(v) for v in best.split("_")[1].split("x"))
        tiles[((r["rows"], r["rows"]), r["n"], r["k"])] = (parts, cfg)
print(repr(tiles))
PY
echo "PARTS_TILES: $(cat $OUT/c1/parts_tiles.txt)"
eng() { STAGES=engine ENGINE_TIMEOUT=110 bash benchmarks/run_gpu.sh --architecture qwen3-1.7b --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/c1/engine_$1_$2_$3.log 2>&1; sed "s/^{/{\"arm\": \"$3\", /" $OUT/bench/measurements.jsonl >> $OUT/c1/engine.jsonl; rm -rf $OUT/bench; }
cp kvroll/kernels/pdl_gemm.py /tmp/pdl_gemm_main.py
for spec in "longflow 64 new" "longflow 64 old" "longflow 128 new" "longflow 128 old"; do
  set -- $spec
  if (( SECONDS - t0 > 470 )); then echo "skip $spec (time)"; continue; fi
  cp /tmp/pdl_gemm_main.py kvroll/kernels/pdl_gemm.py
  if [[ $3 == new ]]; then sed -i "s/^PARTS_TILES: dict = {}/PARTS_TILES: dict = $(cat $OUT/c1/parts_tiles.txt)/" kvroll/kernels/pdl_gemm.py; fi
  grep -n "^PARTS_TILES" kvroll/kernels/pdl_gemm.py
  eng $1 $2 $3; echo "$spec at $((SECONDS - t0)) s"
done
cp /tmp/pdl_gemm_main.py kvroll/kernels/pdl_gemm.py
python - <<'PY'
import json, os
p = os.environ["OUT"] + "/c1/engine.jsonl"
for line in (open(p) if os.path.exists(p) else []):
    r = json.loads(line)
    print(r["arm"], r["policy"], r["batch"], round(r["steady_step_ms"], 4), round(r["floor_step_ms"], 4), round(r["step_over_floor"], 4), r["kernels_per_step"], [(k[0][:20], k[1], round(k[2], 1)) for k in r["top_kernels"][:5]])
PY
tar czf $OUT/c1.tgz -C $OUT c1 gpu.txt; rm -rf $OUT/c1
