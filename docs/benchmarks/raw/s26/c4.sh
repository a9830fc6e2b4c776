#!/usr/bin/env bash
# Session 26, call 4: the chain in the long tail of wider models (FEW_ROWS_WIDTHS: Qwen3-4B's widths chained at
# <= 8 rows; Qwen3-8B's added on the device only), with SiLU * up in gate_up's epilogue: linear_pdl against cuBLAS at
# their shapes, then the engine A/B (PDL_CHAIN = False the old), LongFlow at batches 1, 8 (and 16, unchained: the
# control).
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
sed -i "s/^FEW_ROWS_WIDTHS = .*/FEW_ROWS_WIDTHS = {1: (2560, 4096), 2: (4096, 9728, 12288)}/" $F
grep -n "^FEW_ROWS_WIDTHS" $F
python - <<'PY' 2>&1 | tail -12
import torch, torch.nn.functional as F
from kvroll.kernels import pdl_gemm, split_k, silu_mul as sm
models = {"qwen3-4b": [(6144, 2560, 1), (2560, 4096, 2), (19456, 2560, 1), (2560, 9728, 2)],
          "qwen3-8b": [(6144, 4096, 1), (4096, 4096, 2), (24576, 4096, 1), (4096, 12288, 2)]}
g = torch.Generator(device="cuda").manual_seed(0)
for name, prods in models.items():
    worst, silu_equal = 0.0, True
    for n, k, parts in prods:
        for rows in (1, 8):
            x = torch.randn(rows, 1, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            assert pdl_gemm.chain_applies(x, w, parts=parts), (name, n, k, parts, rows)
            assert not pdl_gemm.chain_applies(torch.randn(16, 1, k, device="cuda").bfloat16(), w, parts=parts)
            out = pdl_gemm.linear_pdl(x, w, pdl=False, parts=parts)
            ref = split_k.linear_parts(x, w, parts) if parts > 1 else F.linear(x, w)
            worst = max(worst, float((out.float() - ref.float()).abs().max() / ref.float().abs().max()))
            if n > 3 * k:  # gate_up
                cfg = pdl_gemm.gemm_config(rows, n, k, silu_mul=True)
                silu_equal &= torch.equal(pdl_gemm.linear_pdl(x, w, pdl=False, silu_mul=True),
                                          sm.silu_mul(pdl_gemm.linear_pdl(x, w, pdl=False, config=cfg)))
    print(name, "linear_pdl against cuBLAS, worst relative difference", worst, "silu epilogue bit-equal", silu_equal)
PY
eng() { STAGES=engine ENGINE_TIMEOUT=150 bash benchmarks/run_gpu.sh --architecture $1 --policies longflow --budgets 1024 --batch_sizes $3 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$1_$2.log 2>&1; cat $OUT/bench/measurements.jsonl | sed "s/^{/{\"arch\": \"$1\", /" >> $OUT/$2.jsonl; rm -rf $OUT/bench; }
for spec in qwen3-4b:1,8,16 qwen3-8b:1,8; do
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
