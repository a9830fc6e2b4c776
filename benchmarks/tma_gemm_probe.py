"""A decode step's four projections at 256 rows as a TMA GEMM (tensor descriptors, Hopper), against cuBLAS (session
29, developer probe: a lead of session 27, whose chain GEMM took 1.0-1.25x cuBLAS's time at 256 rows).

At batch 256 cuBLAS's projections take ~1.7x their weights' bytes over the copy bandwidth (session 26's c9 profile:
qkv 11.8 us for 16.8 MB, o and down 22.4 for 33.6 MB, gate_up 23.3 for 50.3 MB): each product is near the ridge
(256 rows: ~4.3 GFLOP for qkv) and its tiles fall in 1-2 waves. This probe times, each product alone with its weight
streamed from memory (``--layers`` copies in one CUDA graph, as ``chain_tiles_probe``):

* ``tma``: one program per (row tile, column tile), the row tiles of one weight tile adjacent in the grid, its loads
  through TMA descriptors (``TensorDescriptor``), K in a pipelined loop (``num_stages``);
* ``persistent``: as many programs as SMs, each walking the tiles (``tl.range`` with ``flatten``; ``ws``: with
  Triton's warp specialization where this Triton has it).

Every configuration is first checked against cuBLAS's product (its largest error relative to the product's
largest value is printed). o and down: cuBLAS both whole and as the engine runs them at 256 rows
(``split_k.linear_parts``' 2 K slices in one batched call); the probe's kernels compute the whole product.

    PYTHONPATH=.:benchmarks python benchmarks/tma_gemm_probe.py --rows 256 --out OUT.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:
    from chain_tiles_probe import NAMES, projections
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.tma_gemm_probe
    from benchmarks.chain_tiles_probe import NAMES, projections
    from benchmarks.kernel_decode import graph_time_ms

from kvroll.kernels import split_k

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
TILES = [(64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4),
         (128, 64, 128, 4, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
         (128, 128, 128, 8, 3), (256, 64, 64, 8, 3), (64, 64, 64, 4, 6), (128, 64, 64, 4, 6), (64, 32, 128, 4, 5)]
PERSISTENT = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)]


@triton.jit
def _tma_kernel(x_desc, w_desc, y_desc, K, ROW_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    off_m = (pid % ROW_TILES) * BLOCK_M  # the row tiles of one weight tile are neighbours: it comes from L2 again
    off_n = (pid // ROW_TILES) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
    y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@triton.jit
def _persistent_kernel(x_desc, w_desc, y_desc, K, TILES_TOTAL, PROGRAMS: tl.constexpr, ROW_TILES: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS: tl.constexpr):
    for tile in tl.range(tl.program_id(0), TILES_TOTAL, PROGRAMS, flatten=True, warp_specialize=WS):
        off_m = (tile % ROW_TILES) * BLOCK_M
        off_n = (tile // ROW_TILES) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


def tma_linear(x: torch.Tensor, w: torch.Tensor, tile, persistent: bool = False, ws: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T in x's dtype, one launch (module docstring)."""
    block_m, block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    y_desc = TensorDescriptor.from_tensor(y, [block_m, block_n])
    row_tiles = triton.cdiv(m, block_m)
    tiles = row_tiles * n // block_n
    if persistent:
        programs = min(tiles, torch.cuda.get_device_properties(x.device).multi_processor_count)
        _persistent_kernel[(programs,)](x_desc, w_desc, y_desc, k, tiles, programs, row_tiles, block_m, block_n,
                                        block_k, ws, num_warps=warps, num_stages=stages)
    else:
        _tma_kernel[(tiles,)](x_desc, w_desc, y_desc, k, row_tiles, block_m, block_n, block_k, stages,
                              num_warps=warps)
    return y


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-1.7b")
    ap.add_argument("--rows", default="256")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    results = []
    for (n, k, parts), name in zip(projections(args.model), NAMES):
        weights = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k, device="cuda").bfloat16()
            row = {"model": args.model, "proj": name, "n": n, "k": k, "rows": m,
                   "weight_mb": round(n * k * 2 / 1e6, 2),
                   "cublas_us": round(1000 * graph_time_ms(lambda: [F.linear(x, w) for w in weights]) / args.layers, 2)}
            if parts > 1:
                row["cublas_split_us"] = round(1000 * graph_time_ms(
                    lambda: [split_k.linear_parts(x, w, parts) for w in weights]) / args.layers, 2)
            want = F.linear(x, weights[0]).float()
            variants = [("tma", t, False, False) for t in TILES]
            variants += [(kind, t, True, ws) for t in PERSISTENT for kind, ws in (("pers", False), ("pers_ws", True))]
            for kind, tile, persistent, ws in variants:
                block_m, block_n, block_k = tile[:3]
                if m % block_m or n % block_n or k % block_k:
                    continue
                label = kind + ":" + "x".join(map(str, tile))
                try:
                    got = tma_linear(x, weights[0], tile, persistent, ws).float()
                    err = float((got - want).abs().max() / want.abs().max())
                    us = 1000 * graph_time_ms(lambda: [tma_linear(x, w, tile, persistent, ws) for w in weights])
                    us /= args.layers
                except Exception as exc:  # out of shared memory, no warp specialization here: recorded
                    row[label] = f"{type(exc).__name__}: {str(exc)[:80]}"
                    continue
                row[label] = {"us": round(us, 2), "programs": (m // block_m) * (n // block_n), "err": err}
            timed = [key for key, v in row.items() if isinstance(v, dict)]
            if timed:
                best = min(timed, key=lambda key: row[key]["us"])
                row["best"], row["best_us"] = best, row[best]["us"]
                row["best_over_cublas"] = round(row[best]["us"] / min(row["cublas_us"],
                                                                      row.get("cublas_split_us", 1e9)), 3)
            print(json.dumps({key: (v["us"], v["programs"], f"{v['err']:.1e}") if isinstance(v, dict) else v
                              for key, v in row.items()}), flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
