"""How does the chain's GEMM stream as its program count nears the SM count? Session 39 (developer probe).

At 64 rows Qwen3-1.7B's gate_up (with SiLU * up) runs 96 programs of 128 x 128 tiles on an H100's 132 SMs; qkv, o
and down run 128. If a program's stream is bounded per SM, 96 programs leave a quarter of the SMs' share idle and
the projection streams below the copy bandwidth. This probe times ``linear_pdl`` on weights of the same width (K)
and tile with more or fewer output columns, so that the program count runs from 64 to 264 at a fixed tile, and
prints each one's bandwidth (weight bytes over time) beside the copy bandwidth measured in the run. Each weight set
is streamed from memory (``--layers`` copies in one CUDA graph, plain launches).

    PYTHONPATH=.:benchmarks python benchmarks/gemm_waves_probe.py --rows 64 --out OUT/gemm_waves.json
"""
from __future__ import annotations

import argparse
import json

import torch

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.gemm_waves_probe
    from benchmarks.kernel_decode import graph_time_ms

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels import pdl_gemm

# (name, K, tile (BLOCK_N, BLOCK_K, warps, stages), silu_mul, program counts)
CASES = [("gate_up+silu", 2048, (128, 128, 4, 3), True, (64, 80, 96, 112, 120, 128, 132, 144, 176, 192, 264)),
         ("qkv-like", 2048, (32, 256, 4, 4), False, (64, 96, 112, 128, 132, 144, 192, 264)),
         ("down-like (K 3072)", 3072, (32, 256, 4, 4), False, (64, 96, 112, 128, 132, 144, 192, 264))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))
    results = {"copy_bandwidth_tb_s": bw / 1e12, "rows": args.rows, "cases": []}
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    for name, k, cfg, silu, counts in CASES:
        x = torch.randn(args.rows, k, device="cuda").bfloat16()
        for programs in counts:
            n = programs * cfg[0]
            ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
            us = 1000 * graph_time_ms(lambda ws=ws: [pdl_gemm.linear_pdl(x, w, pdl=False, config=cfg, silu_mul=silu)
                                                     for w in ws]) / args.layers
            nbytes = n * k * 2
            row = {"case": name, "programs": programs, "n": n, "us": round(us, 2),
                   "tb_s": round(nbytes / us / 1e6, 3), "floor_us": round(nbytes / bw * 1e6, 2)}
            print(json.dumps(row), flush=True)
            results["cases"].append(row)
            del ws
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
