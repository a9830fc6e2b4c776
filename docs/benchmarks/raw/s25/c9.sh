#!/usr/bin/env bash
# Session 25, call 9: the PDL chain at other models' widths (CHAIN_WIDTHS extended here, on the device only):
# linear_pdl against cuBLAS's products at Qwen3-0.6B / 4B / 8B's and Llama-3.2-1B's shapes, then the engine A/B
# (LongFlow, budget 1,024, batches 1 and 64; PDL_CHAIN = False the old) on Qwen3-4B, Llama-3.2-1B and Qwen3-0.6B.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
F=kvroll/kernels/pdl_gemm.py
sed -i "s/^CHAIN_WIDTHS = .*/CHAIN_WIDTHS = {1: (1024, 2048, 2560, 4096), 2: (2048, 3072, 4096, 6144, 8192, 9728, 12288)}/" $F
grep -n "^CHAIN_WIDTHS" $F
python - <<'PY' 2>&1 | tail -30
import torch, torch.nn.functional as F
from kvroll.kernels import pdl_gemm, split_k
# (name, N, K, parts): each model's qkv, o, gate_up, down
models = {"qwen3-0.6b": [(4096, 1024, 1), (1024, 2048, 2), (6144, 1024, 1), (1024, 3072, 2)],
          "qwen3-4b": [(6144, 2560, 1), (2560, 4096, 2), (19456, 2560, 1), (2560, 9728, 2)],
          "qwen3-8b": [(6144, 4096, 1), (4096, 4096, 2), (24576, 4096, 1), (4096, 12288, 2)],
          "llama-3.2-1b": [(3072, 2048, 1), (2048, 2048, 2), (16384, 2048, 1), (2048, 8192, 2)]}
g = torch.Generator(device="cuda").manual_seed(0)
for name, prods in models.items():
    worst = 0.0
    for n, k, parts in prods:
        for rows in (1, 8, 64):
            x = torch.randn(rows, 1, k, device="cuda", generator=g).bfloat16()
            w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).bfloat16()
            assert pdl_gemm.chain_applies(x, w, parts=parts), (name, n, k, parts, rows)
            out = pdl_gemm.linear_pdl(x, w, pdl=False, parts=parts)
            ref = split_k.linear_parts(x, w, parts) if parts > 1 else F.linear(x, w)
            worst = max(worst, float((out.float() - ref.float()).abs().max() / ref.float().abs().max()))
    print(name, "linear_pdl against cuBLAS, worst relative difference", worst)
PY
eng() { STAGES=engine ENGINE_TIMEOUT=170 bash benchmarks/run_gpu.sh --architecture $1 --policies longflow --budgets 1024 --batch_sizes 1,64 --output_lengths 4096 --steady_steps 512 --full_steps 32 --hf_generate false > $OUT/engine_$1_$2.log 2>&1; cat $OUT/bench/measurements.jsonl | sed "s/^{/{\"arch\": \"$1\", /" >> $OUT/$2.jsonl; rm -rf $OUT/bench; }
for arch in ${ARCHS:-qwen3-4b llama-3.2-1b qwen3-0.6b}; do
  t0=$SECONDS; eng $arch new; echo "$arch new $((SECONDS - t0)) s"
  t0=$SECONDS; sed -i "s/^PDL_CHAIN = True /PDL_CHAIN = False /" $F; eng $arch old; sed -i "s/^PDL_CHAIN = False /PDL_CHAIN = True /" $F; echo "$arch old $((SECONDS - t0)) s"
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
