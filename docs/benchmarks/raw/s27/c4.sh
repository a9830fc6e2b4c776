#!/usr/bin/env bash
# Session 27, call 4: SHAPE_TILES with Qwen3-4B's projections at 33-64 rows (c3's probe). First each of its four
# products under the table's tiles against cuBLAS at 48 and 64 rows (and the epilogue against silu_mul), the chain's
# GPU tests; then Qwen3-4B LongFlow at batches 64 and 48 against SHAPE_CHAIN = False (session 26's chain: <= 32 rows).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
python - <<'PY' 2>&1 | tail -8
import torch, torch.nn.functional as F
from kvroll.kernels import pdl_gemm, split_k, silu_mul as sm
g = torch.Generator(device="cuda").manual_seed(0)
for n, k, parts in [(6144, 2560, 1), (2560, 4096, 2), (19456, 2560, 1), (2560, 9728, 2)]:
    for rows in (33, 48, 64):
        x = torch.randn(rows, 1, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        assert pdl_gemm.chain_applies(x, w, parts=parts) or not pdl_gemm.gemm_available("cuda"), (n, k, rows)
        out = pdl_gemm.linear_pdl(x, w, pdl=False, parts=parts)
        ref = split_k.linear_parts(x, w, parts) if parts > 1 else F.linear(x, w)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())
        line = f"{n}x{k}/{parts} rows {rows} cfg {pdl_gemm.gemm_config(rows, n, k, parts)} rel err {err:.2e}"
        if n == 19456:
            cfg = pdl_gemm.gemm_config(rows, n, k, silu_mul=True)
            line += f" silu cfg {cfg} equal {torch.equal(pdl_gemm.linear_pdl(x, w, pdl=False, silu_mul=True), sm.silu_mul(pdl_gemm.linear_pdl(x, w, pdl=False, config=cfg)))}"
        print(line)
PY
timeout 120 python -m pytest -q tests/kernels/test_pdl_gemm.py -p no:cacheprovider 2>&1 | tail -5 > $OUT/gpu_tests.log; tail -1 $OUT/gpu_tests.log
ROWS="longflow:64 longflow:48" ARCH=qwen3-4b FLAG=SHAPE_CHAIN FLAG_FILE=kvroll/kernels/pdl_gemm.py KERNELS="gemm|nvjet|silu" ENGINE_TIMEOUT=150 bash docs/benchmarks/raw/s23/calls.sh
rm -f $OUT/engine_*.log
