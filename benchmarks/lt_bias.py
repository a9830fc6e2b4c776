"""The decode step's projections through cuBLASLt, scoped to one call: ``F.linear`` with a zero bias.

    PYTHONPATH=.:benchmarks python benchmarks/lt_bias.py --out OUT [--rows 16,32,...,256]

Session 18 measured cuBLASLt 14% faster than cuBLAS on the down projection at M = 64-128
(``gemm_decode.py``), but through ``torch.backends.cuda.preferred_blas_library``, a process-wide switch. A 1-D
bias sends ``F.linear`` (``addmm``) down ``gemm_and_bias``, a cuBLASLt call with a bias epilogue, for that call
alone. This times, per projection of Qwen3-1.7B (fused joins) and M: cuBLAS (``F.linear(x, W)``), cuBLASLt by the
process-wide switch, and the zero-bias call; medians of CUDA-graph replays over weight copies together past 400
MB (so no weight is read from L2), in interleaved rounds, each first checked against the fp32 product.
Writes lt_bias.json.

Session 19 (H100): the zero-bias call was 1.8 us faster than cuBLAS on the down projection at 64 rows, 2.7 us at
160, 0.7 us at 128, equal at 96, and 0.3-4.4 us slower at 16-48 and 192-256; no faster on qkv, o or gate_up. In the
engine's per-kernel profile (one eager step) the same down kernel of cuBLAS took 15.1 us at batch 64 on one H100
and 12.8 us on another, where the zero-bias kernel took 13.4 us on both: not adopted (docs/benchmarks/
engine_throughput.md, session 19).
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json

try:
    from gemm_decode import graph_ms
except ImportError:  # imported as benchmarks.lt_bias
    from benchmarks.gemm_decode import graph_ms

PROJECTIONS = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="16,32,48,64,96,128,160,192,256")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for name, (n, k) in PROJECTIONS.items():
        copies = max(2, math.ceil(400e6 / (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dt, generator=gen) * k ** -0.5 for _ in range(copies)]
        zero = torch.zeros(n, device=dev, dtype=dt)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dt, generator=gen)
            ref = x.float() @ weights[0].float().t()
            for label, out in (("cublas", F.linear(x, weights[0])), ("bias", F.linear(x, weights[0], zero))):
                err = float((out.float() - ref).norm() / ref.norm())
                assert err < 1e-2, (name, m, label, err)
            times = {"cublas": [], "lt_switch": [], "lt_bias": []}
            for r in range(args.rounds):
                order = ["cublas", "lt_switch", "lt_bias"]
                order = order[r % 3:] + order[:r % 3]
                for label in order:
                    if label == "lt_switch":
                        torch.backends.cuda.preferred_blas_library("cublaslt")
                    try:
                        fns = [(lambda w=w: F.linear(x, w, zero)) if label == "lt_bias" else (lambda w=w: F.linear(x, w))
                               for w in weights]
                        times[label].append(graph_ms(fns))
                    finally:
                        torch.backends.cuda.preferred_blas_library("cublas")
            row = {"projection": name, "rows": m, "n": n, "k": k, "weight_copies": copies,
                   "floor_ms": (n * k * 2 + m * k * 2 + m * n * 2) / bw * 1e3,
                   **{f"{key}_ms": sorted(v)[len(v) // 2] for key, v in times.items()}}
            rows_out.append(row)
            print(f"{name:8s} M={m:4d} floor {row['floor_ms'] * 1e3:5.1f} us  cublas {row['cublas_ms'] * 1e3:5.1f}  "
                  f"lt(switch) {row['lt_switch_ms'] * 1e3:5.1f}  lt(zero bias) {row['lt_bias_ms'] * 1e3:5.1f}",
                  flush=True)
        del weights
        torch.cuda.empty_cache()
    write_json(os.path.join(args.out, "lt_bias.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": rows_out})


if __name__ == "__main__":
    main()
