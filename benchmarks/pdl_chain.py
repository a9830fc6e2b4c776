"""Programmatic dependent launch (PDL) on a chain of small kernels, in a CUDA graph (H100 and newer).

    PYTHONPATH=. python benchmarks/pdl_chain.py --out OUT

A decode step at batch 64 is ~280 dependent kernels; each boundary costs the next kernel's launch and ramp. This
times chains of the same Triton row kernel ([rows, cols] bf16 in, out: a scaled copy), alone and after a cuBLAS
GEMM of the decode step's shape, with the Triton kernels launched plainly, with PDL and ``gdc_wait`` at their start
(the trigger implicit at the previous kernel's exit), and with ``gdc_launch_dependents`` at their start too. Each
chain is first checked against the same chain in torch. Writes pdl_chain.json.

Session 19 (H100, raw/sampler_lt_s19/pdl_chain.json): PDL with the wait at the start took 0.28-0.35 us off each
Triton-to-Triton boundary (1.70 -> 1.35 us per kernel at 64 x 2,048), the early trigger less (0.10-0.20 us), and a
Triton kernel after a cuBLAS GEMM gained nothing (0.03-0.21 us slower). A decode layer has 1-2 Triton-to-Triton
boundaries (the rest border a cuBLAS GEMM), so ~17 us of a 5 ms step at most: not taken further.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.pdl_chain
    from benchmarks.kernel_decode import graph_time_ms


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL >= 1:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, (x * 0.5 + 1.0).to(y_ptr.dtype.element_ty), mask=mask)


def scale(x, y, pdl: int):
    kw = {"launch_pdl": True} if pdl else {}
    _scale_kernel[(x.shape[0],)](x, y, x.shape[1], BLOCK=1024, PDL=pdl, num_warps=4, **kw)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(dev), "rows": []}
    for rows, cols in ((64, 2048), (64, 6144), (256, 6144)):
        bufs = [torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        n = 40
        ref = bufs[0].float()
        for _ in range(n):
            ref = (ref.bfloat16().float() * 0.5 + 1.0)
        for pdl in (0, 1, 2):
            ping, pong = bufs[0].clone(), torch.empty_like(bufs[0])

            def chain(pdl=pdl, ping=ping, pong=pong):
                src, dst = ping, pong
                for _ in range(n):  # src is never written while it is read: the chain alternates two buffers
                    scale(src, dst, pdl)
                    src, dst = dst, src
                return src

            got = chain().float()  # eager, from the original input: the check
            ok = torch.allclose(got, ref.bfloat16().float(), atol=1e-2, rtol=1e-2)
            ping.copy_(bufs[0])
            us = graph_time_ms(chain, calls=1, reps=50) * 1e3 / n  # the chain once per graph, per kernel
            out["rows"].append({"chain": "triton", "rows": rows, "cols": cols, "pdl": pdl, "us_per_kernel": us, "ok": ok})
            print(f"triton chain {rows}x{cols} pdl={pdl}: {us:.2f} us/kernel ok={ok}", flush=True)
        # GEMM -> Triton pairs: F.linear(x, W) [rows, 2048] then the row kernel on its output
        w = [torch.randn(cols, 2048, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        x = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
        y = torch.empty(rows, cols, device=dev, dtype=torch.bfloat16)
        for pdl in (0, 1, 2):
            def pairs(pdl=pdl):
                for i in range(16):
                    h = torch.nn.functional.linear(x, w[i % 8])
                    scale(h, y, pdl)
            us = graph_time_ms(pairs, calls=1, reps=50) * 1e3 / 16
            out["rows"].append({"chain": "gemm+triton", "rows": rows, "cols": cols, "pdl": pdl, "us_per_pair": us})
            print(f"gemm+triton {rows}x{cols} pdl={pdl}: {us:.2f} us/pair", flush=True)
    with open(os.path.join(args.out, "pdl_chain.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
