"""The decode step's projections split over concurrent CUDA-graph branches: does running a projection's K halves
(or N halves) as two cuBLAS calls on two streams, forked and joined inside the graph, beat one cuBLAS call?

    PYTHONPATH=.:benchmarks python benchmarks/gemm_branches.py --out OUT [--rows 8,64,128,256]

At M = 64 cuBLAS's kernels for Qwen3-1.7B's down (K = 6,144) and o projections run 64-128 programs on 132 SMs at
~1.7 TB/s (engine_throughput.md); a split over K gives twice the programs, each half on its own stream, the halves'
sum left to the next kernel (the residual add reads both). Each variant is timed by ``kernel_decode.interleaved``
(CUDA graphs of 10 calls, each call on the next of 10 weight copies so that no weight is read from L2; medians
over rotated rounds) against the weight bytes over the copy bandwidth of the run, and first checked against the
fp32 product. Writes gemm_branches.json.
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
except ImportError:  # imported as benchmarks.gemm_branches
    from benchmarks.kernel_decode import interleaved

PROJECTIONS = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}
COPIES = 10


def _mm(x, w, fp32: bool):
    return torch.mm(x, w.T, out_dtype=torch.float32) if fp32 else torch.mm(x, w.T)


def branches(x, weights, parts: int, axis: str, fp32: bool, streams):
    """The call on weight copy i: ``parts`` slices over K (axis "k") or N ("n"), each a cuBLAS call on its own
    stream forked from and joined back to the current one. Returns the parts' outputs."""
    counter = itertools.count()

    def call():
        w = weights[next(counter) % len(weights)]
        cur = torch.cuda.current_stream()
        size = (w.shape[1] if axis == "k" else w.shape[0]) // parts
        outs = []
        for j in range(parts):
            s = streams[j]
            if j:
                s.wait_stream(cur)
            with torch.cuda.stream(s if j else cur):
                sl = slice(j * size, (j + 1) * size)
                outs.append(_mm(x[:, sl], w[:, sl], fp32) if axis == "k" else _mm(x, w[sl], fp32))
        for j in range(1, parts):
            cur.wait_stream(streams[j])
        return outs
    return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="8,64,128,256")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    streams = [torch.cuda.Stream() for _ in range(4)]
    out = []
    for name, (n, k) in PROJECTIONS.items():
        weights = [(torch.randn(n, k, device=dev, generator=gen) * 0.02).bfloat16() for _ in range(COPIES)]
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device=dev, generator=gen).bfloat16()
            ref = x.float() @ weights[0].float().T
            counter = itertools.count()
            variants = {"cublas": lambda: F.linear(x, weights[next(counter) % COPIES])}
            for parts, axis, fp32 in [(2, "k", True), (2, "k", False), (3, "k", True), (4, "k", True),
                                      (2, "n", False), (3, "n", False)]:
                if (k if axis == "k" else n) % parts:
                    continue
                label = f"{axis}{parts}_{'fp32' if fp32 else 'bf16'}"
                call = branches(x, weights, parts, axis, fp32, streams)
                got = call()
                got = sum(g.float() for g in got) if axis == "k" else torch.cat(got, dim=1).float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, (name, rows, label, err)
                variants[label] = branches(x, weights, parts, axis, fp32, streams)
            times = interleaved(variants, args.rounds)
            floor = n * k * 2 / bw * 1e3
            row = {"projection": name, "n": n, "k": k, "rows": rows, "floor_ms": floor, "times_ms": times}
            out.append(row)
            best = min(times, key=times.get)
            print(f"{name:8s} M {rows:4d}: floor {floor * 1e3:5.1f} us  " + "  ".join(
                f"{lab} {t * 1e3:5.1f}" for lab, t in times.items()) + f"  -> best {best}", flush=True)
        del weights
    write_json(os.path.join(args.out, "gemm_branches.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": out})


if __name__ == "__main__":
    main()
