#!/usr/bin/env bash
# Session 26, call 2: the epilogue's kernel test on the GPU (bit for bit against silu_mul of the GEMM's output),
# the MLP chain probe over tiles (c1's crashed at a pre-wait tile: out of shared memory), the engine at batch 1.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q tests/kernels/test_pdl_gemm.py -k "silu_mul or against" -p no:cacheprovider 2>&1 | tail -15 > $OUT/gpu_tests.log; tail -3 $OUT/gpu_tests.log
timeout 200 python benchmarks/mlp_chain_probe.py --rows 1,8,16,32,64 --out $OUT/mlp_chain_probe.json > $OUT/probe.log 2>&1; tail -3 $OUT/probe.log | cut -c1-300
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/mlp_chain_probe.json"))["results"]:
    print(r["rows"], {k[:-3]: v for k, v in r.items() if k.endswith("_us")})
    print("   ", {k: v for k, v in r.items() if k.endswith("_equal") or k.endswith("_error")})
PY
ROWS="longflow:1" FLAG=SILU_EPILOGUE FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|silu" ENGINE_TIMEOUT=150 bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
