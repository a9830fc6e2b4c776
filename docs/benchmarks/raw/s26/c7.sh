#!/usr/bin/env bash
# Session 26, call 7: the chain past 64 rows (MAX_ROWS = 128 on the device, gemm_config's 128-row tiles; the old:
# MAX_ROWS = 64): first linear_pdl and its epilogue against cuBLAS at 96 and 128 rows, then LongFlow at batches 96
# and 128 and SnapKV at 128 (Qwen3-1.7B).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
python - <<'PY' 2>&1 | tail -6
import torch, torch.nn.functional as F
from kvroll.kernels import pdl_gemm, split_k, silu_mul as sm
pdl_gemm.MAX_ROWS = 128
g = torch.Generator(device="cuda").manual_seed(0)
worst, silu_equal = 0.0, True
for n, k, parts in [(4096, 2048, 1), (2048, 2048, 2), (12288, 2048, 1), (2048, 6144, 2)]:
    for rows in (96, 128):
        x = torch.randn(rows, 1, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
        assert pdl_gemm.chain_applies(x, w, parts=parts), (n, k, parts, rows)
        out = pdl_gemm.linear_pdl(x, w, pdl=False, parts=parts)
        ref = split_k.linear_parts(x, w, parts) if parts > 1 else F.linear(x, w)
        worst = max(worst, float((out.float() - ref.float()).abs().max() / ref.float().abs().max()))
        if n == 12288:
            cfg = pdl_gemm.gemm_config(rows, n, k, silu_mul=True)
            silu_equal &= torch.equal(pdl_gemm.linear_pdl(x, w, pdl=False, silu_mul=True),
                                      sm.silu_mul(pdl_gemm.linear_pdl(x, w, pdl=False, config=cfg)))
print("128-row tiles: linear_pdl against cuBLAS, worst relative difference", worst, "silu epilogue bit-equal", silu_equal)
PY
eng() { STAGES=engine ENGINE_TIMEOUT=150 bash benchmarks/run_gpu.sh --policies $1 --budgets 1024 --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$1_$2.log 2>&1; cat $OUT/bench/measurements.jsonl >> $OUT/$2.jsonl; rm -rf $OUT/bench; }
for spec in longflow:96,128 snapkv:128; do
  p=${spec%%:*}; b=${spec##*:}
  t0=$SECONDS; sed -i "s/^MAX_ROWS = 64 /MAX_ROWS = 128 /" $F; eng $p new $b; sed -i "s/^MAX_ROWS = 128 /MAX_ROWS = 64 /" $F; echo "$p new $((SECONDS - t0)) s"
  t0=$SECONDS; eng $p old $b; echo "$p old $((SECONDS - t0)) s"
done
python - <<'PY'
import json, os
for tag in ("new", "old"):
    path = os.environ["OUT"] + f"/{tag}.jsonl"
    if os.path.exists(path):
        for line in open(path):
            r = json.loads(line)
            print(tag, r["policy"], r["batch"], round(r["steady_step_ms"], 3), round(r["floor_step_ms"], 3),
                  round(r["step_over_floor"], 4), r["kernels_per_step"], [(k[0][:20], k[1], round(k[2], 1)) for k in r["top_kernels"][:6]])
PY
for f in $(grep -l "Traceback\|Error" $OUT/engine_*.log); do echo "== $f"; tail -12 $f; done
rm -f $OUT/engine_*.log
