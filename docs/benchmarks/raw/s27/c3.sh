#!/usr/bin/env bash
# Session 27, call 3: the final code (MAX_ROWS = 128, WIDE_TILES from c2). The chain's GPU tests (the engine's
# chain at batch 96 among them) and the rollout's; LongFlow at batches 128 and 72 (a partial second row tile) and
# Hard-KV at 128 against WIDE_CHAIN = False; then Qwen3-4B's projections at 64 rows under the row-tiled tiles
# (the lead of a per-shape rule at 33-64 rows).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q tests/kernels/test_pdl_gemm.py tests/kernels/test_fused_mlp.py -p no:cacheprovider 2>&1 | tail -8 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
timeout 120 python -m pytest -q -m gpu tests/rollout -p no:cacheprovider 2>&1 | tail -8 > $OUT/gpu_tests_rollout.log; tail -1 $OUT/gpu_tests_rollout.log
ROWS="longflow:128 longflow:72 hardkv:128" FLAG=WIDE_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|nvjet|silu" ENGINE_TIMEOUT=150 bash docs/benchmarks/raw/s23/calls.sh
timeout 100 python benchmarks/chain_tiles_probe.py --model qwen3-4b --rows 64 --wide > $OUT/probe_4b.log 2>&1
python - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/probe_4b.log"):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    timed = {k: v[0] for k, v in r.items() if isinstance(v, list)}
    print(r["proj"], r["rows"], "cuBLAS", r["cublas_us"], " ".join(f"{k}:{v}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])[:4]))
PY
rm -f $OUT/engine_*.log
