#!/usr/bin/env bash
# Session 40, call 2 (nvidia-h200): the chain's tiles with deeper pipelines on an H200 (benchmarks/chain_tiles_probe.py
# --deep), Qwen3-1.7B's four projections (gate_up with SiLU * up too) at 16, 32, 64 and 128 rows, against cuBLAS.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
timeout 500 python benchmarks/chain_tiles_probe.py --model qwen3-1.7b --rows 64,32,16,128 --deep --out $OUT/tiles_deep.json > $OUT/tiles_deep.log 2>&1
echo "rc $?"
python - <<'PY'
import json, os
for l in open(os.environ["OUT"] + "/tiles_deep.log"):
    if not l.startswith("{"): print(l.rstrip()[:300]); continue
    r = json.loads(l)
    rule = "x".join(map(str, r["rule"])) if r["rule"] else None
    t = {k: v for k, v in r.items() if isinstance(v, list)}
    print(r["proj"], r["rows"], "cublas", r["cublas_us"], "rule", rule, t.get(rule), "best", r["best"], t.get(r["best"]))
PY
