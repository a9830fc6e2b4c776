"""A decode step's projection as one strided-batched cuBLAS call over K slices (split-K in one kernel, no copy:
the slices are strided views of the activations and the weight), against ``F.linear``: does the batch of K
slices give cuBLAS the programs that a skinny GEMM lacks (at 64 rows its down projection runs ~64 programs on 132
SMs)? The slices' partial products would be summed by the next kernel (the residual add, SiLU·mul, rotary), so
they are timed alone here. Each variant is timed by ``kernel_decode.interleaved`` (CUDA graphs of 10 calls, each
on the next of 10 weight copies so that no weight is read from L2) and first checked against the fp32 product.

    PYTHONPATH=.:benchmarks python benchmarks/gemm_ksplit_bmm.py --out OUT [--rows 1,8,64,256]
        [--shapes down_8b:4096x14336,o_8b:4096x4096 --variants k2_fp32]   # other models' projections
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json

try:
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.gemm_ksplit_bmm
    from benchmarks.kernel_decode import interleaved

PROJECTIONS = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}
COPIES = 10


def ksplit(x, w, parts: int, fp32: bool):
    """[parts, M, N] partial products of x [M, K] and w [N, K] over K slices: one bmm on strided views."""
    m, k = x.shape
    xs = x.view(m, parts, k // parts).transpose(0, 1)  # [P, M, K/P], rows K apart
    ws = w.view(w.shape[0], parts, k // parts).transpose(0, 1).transpose(1, 2)  # [P, K/P, N]
    return torch.bmm(xs, ws, out_dtype=torch.float32) if fp32 else torch.bmm(xs, ws)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="1,8,16,32,64,96,128,192,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default="", help="name:NxK,... instead of Qwen3-1.7B's four projections")
    parser.add_argument("--variants", default="", help="e.g. k2_fp32,k4_bf16 (default: every K split)")
    args = parser.parse_args()
    projections = PROJECTIONS
    if args.shapes:
        projections = {name: tuple(int(v) for v in dims.split("x"))
                       for name, dims in (item.split(":") for item in args.shapes.split(","))}
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, (n, k) in projections.items():
        weights = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16() for _ in range(COPIES)]
        zero = torch.zeros(n, device=dev, dtype=torch.bfloat16)
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=dev, generator=gen).bfloat16()
            ref = x.float() @ weights[0].float().T
            counter = itertools.count()
            variants = {"cublas": lambda: F.linear(x, weights[next(counter) % COPIES]),
                        "lt_bias": lambda: F.linear(x, weights[next(counter) % COPIES], zero)}
            for parts in (2, 3, 4):
                for fp32 in (False, True):
                    if k % parts:
                        continue
                    label = f"k{parts}_{'fp32' if fp32 else 'bf16'}"
                    if args.variants and label not in args.variants.split(","):
                        continue
                    try:
                        got = ksplit(x, weights[0], parts, fp32).float().sum(0)
                    except (RuntimeError, TypeError) as err:
                        print(name, rows, label, "failed:", str(err).splitlines()[0][:100])
                        continue
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    assert err < 2e-2, (name, rows, label, err)
                    variants[label] = (lambda p=parts, f=fp32: ksplit(x, weights[next(counter) % COPIES], p, f))
            times = interleaved(variants, args.rounds)
            floor = n * k * 2 / bw * 1e3
            row = {"projection": name, "n": n, "k": k, "rows": rows, "floor_ms": floor, "times_ms": times}
            out.append(row)
            base = times["cublas"]
            print(f"{name:8s} M {rows:4d}: floor {floor * 1e3:5.1f} us  cublas {base * 1e3:5.1f}  " + "  ".join(
                f"{lab} {t * 1e3:5.1f} ({t / base:.2f})" for lab, t in times.items() if lab != "cublas"), flush=True)
        del weights
    write_json(os.path.join(args.out, "gemm_ksplit_bmm.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": out})


if __name__ == "__main__":
    main()
