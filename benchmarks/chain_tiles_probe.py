"""The chain's GEMM (``kvroll.kernels.pdl_gemm.linear_pdl``) at a model's four decode projections under several
tile configurations, against cuBLAS (``F.linear``; o and down as ``split_k.linear_parts``' 2 K slices), each
product timed alone with its weight streamed from memory (``--layers`` copies, each its own weight, one CUDA graph).
Every configuration is first checked against cuBLAS's product. The configurations' program counts are printed
beside them (132 SMs on an H100: counts of 1.15-1.45 waves are the suspects of session 25's Qwen3-4B loss).
Session 25 (developer probe). ``--wide`` (session 27): the rows in tiles (a fifth entry, BLOCK_M) for 128-256 rows,
and gate_up also with SiLU * up in its epilogue against cuBLAS's gate_up and ``silu_mul``.

    PYTHONPATH=.:benchmarks python benchmarks/chain_tiles_probe.py --model qwen3-4b --rows 8,64 --out OUT
    PYTHONPATH=.:benchmarks python benchmarks/chain_tiles_probe.py --model qwen3-1.7b --rows 128,256 --wide

``--deep`` (session 40, on an H200, whose memory streams ~1.4x an H100's: are deeper pipelines better there?):
``DEEP``'s tiles with more stages, gate_up with SiLU * up at every row count too, the rule's own tile always timed;
past 64 rows each tile takes rows in tiles of 64 (``SHAPE_TILES``' BLOCK_M).
"""
from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.chain_tiles_probe
    from benchmarks.kernel_decode import graph_time_ms

from kvroll.bench.models import ARCHITECTURES
from kvroll.kernels import pdl_gemm, split_k
from kvroll.kernels.silu_mul import silu_mul

NAMES = ("qkv", "o", "gate_up", "down")
CONFIGS = [(32, 128, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4),
           (256, 64, 4, 3), (256, 64, 8, 3), (32, 128, 4, 5), (32, 256, 4, 5)]
WIDE = [(64, 128, 4, 3, 128), (128, 64, 4, 3, 128), (128, 64, 8, 3, 128), (128, 128, 8, 3, 128),
        (256, 64, 8, 3, 128), (64, 64, 4, 4, 128), (128, 128, 4, 3, 64), (128, 64, 4, 4, 64), (64, 128, 4, 4, 64),
        (128, 64, 8, 3, 256),
        # c2: the <= 64-row rule's tiles over row tiles of 64 and 32, and neighbours of c1's best (c2 listed
        # (128, 128, 4, 3, 64) here a second time, so it ran twice; the later time was kept)
        (32, 256, 4, 4, 64), (32, 128, 4, 5, 64), (64, 256, 4, 3, 64), (64, 128, 4, 5, 64),
        (32, 256, 4, 4, 32), (64, 128, 4, 4, 32), (128, 64, 8, 4, 128), (256, 64, 8, 4, 128), (128, 128, 8, 4, 128)]

DEEP = [(32, 256, 4, 4), (32, 256, 4, 5), (32, 256, 4, 6), (32, 128, 4, 5), (32, 128, 4, 6), (32, 128, 4, 8),
        (64, 128, 4, 4), (64, 128, 4, 5), (64, 128, 4, 6), (128, 128, 4, 3), (128, 128, 4, 4), (128, 64, 4, 4),
        (128, 64, 4, 6), (128, 64, 4, 8), (64, 256, 4, 3), (64, 256, 4, 4), (256, 64, 8, 4), (64, 64, 4, 8)]


def projections(arch: str) -> list[tuple[int, int, int]]:
    """(N, K, parts) of an architecture's qkv, o, gate_up and down as the engine's decode step runs them (joined
    qkv and gate_up whole; o and down in the chain's 2 K slices)."""
    spec = ARCHITECTURES[arch]
    hidden, heads, kv_heads, dim = (spec[key] for key in ("hidden_size", "num_attention_heads",
                                                           "num_key_value_heads", "head_dim"))
    inter = spec["intermediate_size"]
    return [((heads + 2 * kv_heads) * dim, hidden, 1), (hidden, heads * dim, 2), (2 * inter, hidden, 1),
            (hidden, inter, 2)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-4b", choices=sorted(ARCHITECTURES))
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--wide", action="store_true", help="the row-tiled configurations (WIDE) instead of CONFIGS")
    ap.add_argument("--deep", action="store_true", help="DEEP's deeper pipelines, gate_up with SiLU * up too")
    args = ap.parse_args()
    configs = WIDE if args.wide else DEEP if args.deep else CONFIGS
    torch.manual_seed(0)
    results = []
    for (n, k, parts), name in zip(projections(args.model), NAMES):
        weights = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
        for m, silu in [(m, s) for m in map(int, args.rows.split(",")) for s in (False, True)
                        if not s or ((args.wide or args.deep) and name == "gate_up")]:
            x = torch.randn(m, 1, k, device="cuda").bfloat16()
            ref = (lambda w: split_k.linear_parts(x, w, parts)) if parts > 1 else (lambda w: F.linear(x, w))
            if silu:  # cuBLAS's gate_up, then silu_mul's kernel: the pair the epilogue replaces
                ref = (lambda w: silu_mul(F.linear(x, w)))
            row = {"model": args.model, "proj": name + ("+silu" if silu else ""), "n": n, "k": k, "parts": parts,
                   "rows": m, "rule": pdl_gemm.gemm_config(m, n, k, parts, silu),
                   "cublas_us": round(1000 * graph_time_ms(lambda: [ref(w) for w in weights]) / args.layers, 2)}
            want = ref(weights[0]).float()
            run_configs = configs
            if args.deep:  # the rule's tile first; past 64 rows every tile over rows in tiles of 64
                run_configs = [tuple(c) + (64,) if m > 64 and len(c) == 4 else tuple(c) for c in configs]
                if row["rule"] is not None and tuple(row["rule"]) not in run_configs:
                    run_configs = [tuple(row["rule"])] + run_configs
            for cfg in run_configs:
                block_n, block_k = cfg[:2]
                if n % block_n or k % (parts * block_k):
                    continue
                label = "x".join(map(str, cfg))
                run = functools.partial(pdl_gemm.linear_pdl, pdl=False, parts=parts, config=cfg, silu_mul=silu)
                try:
                    got = run(x, weights[0]).float()
                    err = float((got - want).abs().max() / want.abs().max())
                    us = 1000 * graph_time_ms(lambda: [run(x, w) for w in weights]) / args.layers
                except Exception as exc:  # a tile that does not fit the shared memory: recorded, not fatal
                    row[label] = f"{type(exc).__name__}"
                    continue
                tiles = -(-m // cfg[4]) if len(cfg) > 4 else 1
                row[label] = {"us": round(us, 2), "programs": tiles * parts * n // block_n, "err": err}
            best = min((key for key, v in row.items() if isinstance(v, dict)), key=lambda key: row[key]["us"])
            row["best"] = best
            print(json.dumps({key: (v["us"], v["programs"]) if isinstance(v, dict) else v for key, v in row.items()}),
                  flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
