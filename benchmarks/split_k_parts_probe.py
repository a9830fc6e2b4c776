"""The chain's GEMM in more K slices: does a program's share of the input (re-read from L2 by every program of a
column tile) cost what the weight's bytes do not? Session 39 (developer probe).

At 64 rows a chained projection reads, per program, its weight tile from memory and the whole input slice [rows,
K / parts] from L2: o (2 K slices, 32 x 128 tiles) 64 KB of weight and 128 KB of input per program, down 192 KB and
384 KB. Every column tile re-reads the input, so L2 carries 2-3x the weight's bytes. More K slices with wider
column tiles keep the program count and cut the input's share: o in 4 slices of 64-wide tiles reads 64 KB of each.
The partials are then [parts, rows, N] fp32, which ``add_rms_norm`` adds (P <= 4). This probe times o and down
with their consumer (``linear_pdl(parts=P)`` then ``add_rms_norm``), and qkv's GEMM alone (its consumer, the rotary, would have to add its partials), over
tiles and slice counts, each with ``--layers`` weights in one CUDA graph (streamed from memory), against the
rule's (``gemm_config``). Every configuration is first checked against the fp32 product.

    PYTHONPATH=.:benchmarks python benchmarks/split_k_parts_probe.py --rows 8,32,64,128 --out OUT/probe.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.split_k_parts_probe
    from benchmarks.kernel_decode import graph_time_ms

from kvroll.bench.report import write_json
from kvroll.kernels import pdl_gemm
from kvroll.kernels.add_rms_norm import add_rms_norm

# Qwen3-1.7B: (name, N, K, the rule's parts, paired with add_rms_norm)
PROJECTIONS = [("o", 2048, 2048, 2, True), ("down", 2048, 6144, 2, True), ("qkv", 4096, 2048, 1, False)]
BLOCK_NS = (32, 64, 128, 256)
BLOCK_KS = (64, 128, 256)
PARTS = (1, 2, 3, 4)


def candidates(m: int, n: int, k: int, rule_parts: int, budget: int):
    """(parts, (BLOCK_N, BLOCK_K, warps, stages[, BLOCK_M])) to time: 96-528 programs, tiles that divide."""
    out = []
    block_m = 64 if m > 64 else None
    for parts in PARTS:
        if (rule_parts == 2 and parts == 1) or (rule_parts == 1 and parts > 2 and n > 4096):
            continue
        for bn in BLOCK_NS:
            for bk in BLOCK_KS:
                if n % bn or k % (parts * bk) or (k // parts) // bk < 2:
                    continue
                programs = (-(-m // (block_m or m))) * parts * n // bn
                if not 96 <= programs <= 528:
                    continue
                for warps, stages in ((4, 5 if bn * bk <= 64 * 128 else 4 if bn * bk <= 128 * 128 else 3),
                                      (8, 3)):
                    if warps == 8 and bn < 128:
                        continue
                    out.append((parts, (bn, bk, warps, stages) + ((block_m,) if block_m else ())))
    return out[:budget]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--projections", default="o,down,qkv")
    ap.add_argument("--budget", type=int, default=60, help="configurations per (projection, rows) at most")
    ap.add_argument("--time_limit", type=float, default=480.0, help="seconds: stop starting new rows past it")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    results = []
    hidden = 2048
    norm_w = (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16()
    wanted = args.projections.split(",")
    for name, n, k, rule_parts, paired in [p for p in PROJECTIONS if p[0] in wanted]:
        weights = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
        for m in map(int, args.rows.split(",")):
            if time.time() - t0 > args.time_limit:
                print(f"skip {name} {m} (time)", flush=True)
                continue
            x = torch.randn(m, k, device="cuda").bfloat16()
            resid = torch.randn(m, hidden, device="cuda").bfloat16()
            want = x.float() @ weights[0].float().T
            rule = pdl_gemm.gemm_config(m, n, k, rule_parts)
            row = {"proj": name, "n": n, "k": k, "rows": m, "rule": [rule_parts, rule], "configs": {}}

            def run_fn(parts, cfg):
                def one(w):
                    y = pdl_gemm.linear_pdl(x, w, pdl=False, parts=parts, config=cfg)
                    if paired:
                        return add_rms_norm(y, resid, norm_w, 1e-6)
                    return y
                return one

            todo = ([(rule_parts, rule)] if rule else []) + [c for c in candidates(m, n, k, rule_parts, args.budget)
                                                            if c != (rule_parts, rule)]
            for parts, cfg in todo:
                label = f"p{parts}_" + "x".join(map(str, cfg))
                try:
                    y = pdl_gemm.linear_pdl(x, weights[0], pdl=False, parts=parts, config=cfg)
                    got = y.float().sum(0) if parts > 1 else y.float()
                    err = float((got - want).abs().max() / want.abs().max())
                    fn = run_fn(parts, cfg)
                    us = 1000 * graph_time_ms(lambda: [fn(w) for w in weights]) / args.layers
                except Exception as exc:  # shared memory too small for the tile: recorded, not fatal
                    row["configs"][label] = type(exc).__name__
                    continue
                block_m = cfg[4] if len(cfg) > 4 else m
                programs = (-(-m // block_m)) * parts * n // cfg[0]
                l2_mb = programs * (min(block_m, m) * k // parts + cfg[0] * k // parts) * 2 / 1e6
                row["configs"][label] = {"us": round(us, 2), "programs": programs, "l2_mb": round(l2_mb, 1),
                                         "err": err}
            timed = {key: v for key, v in row["configs"].items() if isinstance(v, dict)}
            best = sorted(timed, key=lambda key: timed[key]["us"])[:5]
            rule_label = f"p{rule_parts}_" + "x".join(map(str, rule)) if rule else None
            row["best"] = best
            print(json.dumps({"proj": name, "rows": m, "rule": rule_label,
                              "rule_us": timed.get(rule_label, {}).get("us"),
                              "best": [(b, timed[b]["us"], timed[b]["programs"], timed[b]["l2_mb"]) for b in best],
                              "t": round(time.time() - t0)}), flush=True)
            results.append(row)
            if args.out:
                write_json(args.out, results)


if __name__ == "__main__":
    main()
