#!/usr/bin/env bash
# Session 27, call 1: the chain's GEMM with the rows in tiles (BLOCK_M) at 128 and 256 rows of Qwen3-1.7B's four
# projections (and gate_up with SiLU * up in its epilogue) against cuBLAS (benchmarks/chain_tiles_probe.py --wide);
# then the best tile per projection as WIDE_TILES with MAX_ROWS = 256 (the chain at 128 rows), LongFlow at batch
# 128 against the committed code (MAX_ROWS = 64: cuBLAS past 64 rows).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
t0=$SECONDS
timeout ${PROBE_S:-300} python benchmarks/chain_tiles_probe.py --model qwen3-1.7b --rows ${PROBE_ROWS:-128,256} --wide \
  > $OUT/probe.log 2> $OUT/probe.err; echo "probe $((SECONDS - t0)) s"; tail -3 $OUT/probe.err
python - <<'PY'
import json, os, re
out = os.environ["OUT"]
table = {}
for line in open(f"{out}/probe.log"):
    r = json.loads(line)
    timed = {k: v[0] for k, v in r.items() if isinstance(v, list)}
    best = min(timed, key=timed.get)
    print(r["proj"], r["rows"], "cuBLAS", r["cublas_us"], "best", best, timed[best],
          " ".join(f"{k}:{v}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:4]))
    cap = 128 if r["rows"] <= 128 else 256
    table[(cap, r["n"], r["k"], r["parts"], r["proj"].endswith("+silu"))] = tuple(map(int, best.split("x")))
line = "WIDE_TILES: dict = " + repr(table)
src = open("kvroll/kernels/pdl_gemm.py").read()
src = re.sub(r"^WIDE_TILES: dict = \{\}", line.replace("\\", "\\\\"), src, flags=re.M)
open(f"{out}/wide_tiles.txt", "w").write(line + "\n")
open("kvroll/kernels/pdl_gemm.py.wide", "w").write(src)
print(line)
PY
cp $F $F.orig
eng() { STAGES=engine ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-200} bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $2 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$3.log 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$3.jsonl; rm -rf $OUT/bench; }
for spec in ${ROWS:-longflow:128}; do
  t0=$SECONDS; cp $F.wide $F; sed -i "s/^MAX_ROWS = 64 /MAX_ROWS = 256 /" $F; eng ${spec%%:*} ${spec##*:} new; cp $F.orig $F; echo "$spec new $((SECONDS - t0)) s"
  t0=$SECONDS; eng ${spec%%:*} ${spec##*:} old; echo "$spec old $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
for tag in ("new", "old"):
    path = os.environ["OUT"] + f"/{tag}.jsonl"
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["floor_step_ms"], 3),
                  round(r["step_over_floor"], 4), r["kernels_per_step"], [(k[0][:24], k[1], round(k[2], 1)) for k in r["top_kernels"][:9]])
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log 2>/dev/null); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log $F.wide $F.orig
