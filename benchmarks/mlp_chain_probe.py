"""The chained MLP of a decode layer, with and without SiLU * up in gate_up's epilogue (``kvroll.kernels.pdl_gemm``:
``linear_pdl(silu_mul=True)``), the epilogue over several tiles.

Per "layer" (``--layers`` of them, each with its own weights so that they stream from memory as in a step), the
chain's MLP half as PDL launches: ``add_rms_norm`` (adding the previous down projection's 2 K slices) -> gate_up
(Qwen3-1.7B's 12,288 x 2,048) -> [``silu_mul``] -> down in 2 K slices (2,048 x 6,144). Each variant is one CUDA
graph, timed by ``kernel_decode.graph_time_ms``; every variant's output is compared with the two-kernel one's
(``equal``: bit for bit). Session 26 (developer probe). Its first version (c2) also timed the first weight tile
loaded before the PDL wait: slower at every row count, and out of shared memory at 64 rows; not kept.

    PYTHONPATH=.:benchmarks python benchmarks/mlp_chain_probe.py --rows 1,8,16,32,64 --out OUT.json
"""
from __future__ import annotations

import argparse
import json

import torch

from kvroll.kernels import add_rms_norm as arn
from kvroll.kernels import pdl_gemm
from kvroll.kernels import silu_mul as sm

try:
    from kernel_decode import graph_time_ms
except ImportError:
    from benchmarks.kernel_decode import graph_time_ms


def chain(parts, residual, norm_w, layers, epilogue: bool, config=None):
    for w_gu, w_down in layers:
        residual, normed = arn.add_rms_norm(parts, residual, norm_w, 1e-6, pdl=True)
        if epilogue:
            act = pdl_gemm.linear_pdl(normed, w_gu, pdl=True, silu_mul=True, config=config)
        else:
            act = sm.silu_mul(pdl_gemm.linear_pdl(normed, w_gu, pdl=True, config=config), pdl=True)
        parts = pdl_gemm.linear_pdl(act, w_down, pdl=True, parts=2)
    return parts


EPILOGUE_CONFIGS = [(32, 128, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 3), (64, 256, 4, 3),
                    (128, 64, 4, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=6144)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    h, i = args.hidden, args.inter
    layers = [((torch.randn(2 * i, h, device="cuda", generator=gen) * 0.02).bfloat16(),
               (torch.randn(h, i, device="cuda", generator=gen) * 0.02).bfloat16()) for _ in range(args.layers)]
    norm_w = (torch.rand(h, device="cuda", generator=gen) + 0.5).bfloat16()
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        parts = torch.randn(2, rows, h, device="cuda", generator=gen) * 0.5
        residual = torch.randn(rows, h, device="cuda", generator=gen).bfloat16()
        row = {"rows": rows}
        outs = {}
        rule = pdl_gemm.gemm_config(rows, 2 * i, h, silu_mul=True, device=torch.device("cuda"))
        variants = [("two_kernels", False, None), ("epilogue", True, rule)]
        variants += [(f"epilogue_{'x'.join(map(str, c))}", True, c) for c in EPILOGUE_CONFIGS
                     if c != rule and (2 * i) % c[0] == 0]
        for name, epilogue, config in variants:
            try:
                outs[name] = chain(parts, residual, norm_w, layers, epilogue, config)
                row[name + "_us"] = round(1000 * graph_time_ms(
                    lambda: chain(parts, residual, norm_w, layers, epilogue, config)) / args.layers, 3)
            except Exception as e:  # e.g. out of shared memory at a tile
                row[name + "_error"] = f"{type(e).__name__}: {str(e)[:120]}"
                torch.cuda.synchronize()
        for name, out in outs.items():
            row[name + "_equal"] = bool(torch.equal(out, outs["two_kernels"]))
            row[name + "_maxdiff"] = float((out - outs["two_kernels"]).abs().max())
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "layers": args.layers, "hidden": h, "inter": i,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
