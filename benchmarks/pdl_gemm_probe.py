"""Can a skinny Triton GEMM launched as a programmatic dependent launch (PDL) beat cuBLAS inside a decode layer's
chain, by fetching its weight (which does not depend on the previous kernel) before it waits for that kernel?
Chain per "layer" (``--layers`` of them, each its own weights, so that they stream from memory as in a step):
RMSNorm (Triton) -> x @ W1^T (qkv's shape, 4,096 x 2,048) -> RMSNorm of its first 2,048 columns -> x @ W2^T
(gate_up's, 12,288 x 2,048) -> the next layer takes its first 2,048 columns. Variants, each timed as one CUDA graph,
interleaved over rounds:

* ``cublas``: the norms, then ``F.linear`` (cuBLAS) for both products;
* ``tri``: the Triton GEMM, plain launches;
* ``tri_pdl``: the norms signal their dependents at their start and the GEMM is a PDL launch waiting (``gdc_wait``)
  before its first load;
* ``tri_pdl_pf``: as ``tri_pdl``, and each GEMM program first asks L2 for its whole weight slice (PTX prefetch,
  fire and forget) before it waits, so that its weight streams while the norm runs.

Every Triton variant's chain output is checked against ``cublas``'s (bf16 tolerance: another accumulation order).
Session 24 (developer probe; nothing in kvroll uses it).

    PYTHONPATH=.:benchmarks python benchmarks/pdl_gemm_probe.py --out OUT [--rows 1,8,64,128]
    PYTHONPATH=.:benchmarks python benchmarks/pdl_gemm_probe.py --split --rows 1,8,64 --out OUT  # o / down
"""
from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

try:
    from kernel_decode import graph_time_ms
except ImportError:
    from benchmarks.kernel_decode import graph_time_ms


@triton.jit
def _norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()  # the GEMM may launch now: it fetches its weight, then waits for this grid
        gdc_wait()  # ... as this waits for the previous GEMM
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + offs, ((x * rstd).to(y_ptr.dtype.element_ty) * w), mask=mask)


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    if PREFETCH:  # this program's weight rows, 128-byte lines, into L2 before the wait
        lines_per_row = K * 2 // 128
        total = BLOCK_N * lines_per_row
        base = w_ptr.to(tl.pointer_type(tl.int8)) + (pid * BLOCK_N).to(tl.int64) * stride_w * 2
        offs_l = tl.arange(0, 256)
        for l0 in range(0, total, 256):
            line = l0 + offs_l
            ptrs = base + (line // lines_per_row).to(tl.int64) * stride_w * 2 + (line % lines_per_row) * 128
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [ptrs, (line < total).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    m_mask = offs_m < M
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_w + (k0 + offs_k)[None, :])
        acc += tl.dot(x, tl.trans(w))
    if PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def norm(x, w, out, pdl):
    _norm_kernel[(x.shape[0],)](x, w, out, x.stride(0), out.stride(0), x.shape[1], 1e-6, BLOCK=triton.next_power_of_2(
        x.shape[1]), PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
    return out


def gemm(x, w, out, cfg, pdl, prefetch):
    m, k = x.shape
    n = w.shape[0]
    bn, bk, warps, stages = cfg
    _gemm_kernel[(n // bn,)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                             BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                             PREFETCH=prefetch, num_warps=warps, num_stages=stages,
                             **({"launch_pdl": True} if pdl else {}))
    return out


class Chain:
    def __init__(self, m, layers, hidden=2048, n1=4096, n2=12288):
        dev, dt = "cuda", torch.bfloat16
        g = torch.Generator(device=dev).manual_seed(0)
        self.w1 = [(torch.randn(n1, hidden, generator=g, device=dev) * 0.02).to(dt) for _ in range(layers)]
        self.w2 = [(torch.randn(n2, hidden, generator=g, device=dev) * 0.02).to(dt) for _ in range(layers)]
        self.nw = torch.ones(hidden, device=dev, dtype=dt)
        self.x0 = torch.randn(m, hidden, generator=g, device=dev).to(dt)
        self.h = torch.empty(m, hidden, device=dev, dtype=dt)
        self.y1 = torch.empty(m, n1, device=dev, dtype=dt)
        self.y2 = torch.empty(m, n2, device=dev, dtype=dt)
        self.out = torch.empty(m, hidden, device=dev, dtype=dt)

    def run(self, variant, cfg1=None, cfg2=None):
        x = self.x0
        pdl, pf = variant in ("tri_pdl", "tri_pdl_pf"), variant == "tri_pdl_pf"
        for w1, w2 in zip(self.w1, self.w2):
            h = norm(x, self.nw, self.h, pdl)
            y1 = torch.mm(h, w1.t(), out=self.y1) if variant == "cublas" else gemm(h, w1, self.y1, cfg1, pdl, pf)
            h = norm(y1[:, :x.shape[1]], self.nw, self.h, pdl)
            y2 = torch.mm(h, w2.t(), out=self.y2) if variant == "cublas" else gemm(h, w2, self.y2, cfg2, pdl, pf)
            x = y2[:, :x.shape[1]]
        self.out.copy_(x)
        return self.out


CONFIGS = [(bn, bk, 4, s) for bn, bk, s in itertools.product((32, 64, 128), (128, 256), (3, 4))] + \
    [(128, 128, 8, 3), (128, 256, 8, 3)]


def single_us(fn, reps=7):
    return graph_time_ms(fn, calls=4, reps=reps) * 1e3


def split_sweep(rows, out_dir, copies=8):
    """o (2,048 x 2,048) and down (2,048 x 6,144) as 2 K slices' fp32 partials: ``linear_pdl(parts=2)`` over tile
    configs against cuBLAS's batched product (``split_k.linear_parts``), each alone, the weight rotated past L2."""
    from kvroll.kernels import pdl_gemm, split_k

    result = []
    for name, (n, k) in {"o": (2048, 2048), "down": (2048, 6144)}.items():
        ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = split_k.linear_parts(x, ws[0], 2)
            cub = single_us(lambda: [split_k.linear_parts(x, w, 2) for w in ws]) / copies
            timed = []
            for cfg in [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4,) for st in (3, 4, 5)]:
                if k % (2 * cfg[1]) or bn_too_big(cfg, m):
                    continue
                try:
                    got = pdl_gemm.linear_pdl(x, ws[0], pdl=False, parts=2, config=cfg)
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    t = single_us(lambda c=cfg: [pdl_gemm.linear_pdl(x, w, pdl=False, parts=2, config=c) for w in ws])
                except Exception:  # a config this shape cannot take (shared memory)
                    continue
                timed.append((t / copies, cfg, err))
            timed.sort()
            print(f"split {name} M={m}: cuBLAS bmm {cub:.2f} us, Triton best {timed[0][0]:.2f} {timed[0][1]} "
                  f"(err {timed[0][2]:.1e}), next {[(round(t, 2), c) for t, c, _ in timed[1:4]]}", flush=True)
            result.append(dict(proj=name, m=m, cublas_us=cub, triton=[dict(us=t, config=c, rel_err=e)
                                                                      for t, c, e in timed]))
    with open(os.path.join(out_dir, "pdl_gemm_split_sweep.json"), "w") as f:
        json.dump(result, f, indent=1)


def bn_too_big(cfg, m):
    return cfg[0] * cfg[1] * 2 * cfg[3] + max(16, m) * cfg[1] * 2 * cfg[3] > 200 * 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default=os.environ.get("ROWS", "1,8,64,128"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--split", action="store_true", help="only the o / down sweep in 2 K slices")
    args = ap.parse_args()
    if args.split:
        return split_sweep([int(r) for r in args.rows.split(",")], args.out)
    result = []
    for m in (int(r) for r in args.rows.split(",")):
        chain = Chain(m, args.layers)
        # pick each product's config by its time in the chain's PDL form (one product alone, weights rotated)
        best = []
        for which, ws, n in ((1, chain.w1, 4096), (2, chain.w2, 12288)):
            h = chain.h.normal_()
            y = chain.y1 if which == 1 else chain.y2
            timed = []
            for cfg in CONFIGS:
                if n // cfg[0] < 32:
                    continue
                try:
                    t = single_us(lambda c=cfg: [gemm(h, w, y, c, False, False) for w in ws]) / len(ws)
                except Exception as err:  # a config this shape cannot take (shared memory)
                    continue
                timed.append((t, cfg))
            timed.sort()
            cub = single_us(lambda: [torch.mm(h, w.t(), out=y) for w in ws]) / len(ws)
            print(f"M={m} product {which}: cuBLAS {cub:.2f} us, Triton best {timed[0][0]:.2f} {timed[0][1]}, "
                  f"next {[(round(t, 2), c) for t, c in timed[1:4]]}", flush=True)
            best.append(timed[0][1])
        ref = chain.run("cublas").float().clone()
        variants = ["cublas", "tri", "tri_pdl", "tri_pdl_pf"]
        errs = {}
        for v in variants[1:]:
            got = chain.run(v, *best).float()
            errs[v] = ((got - ref).abs().max() / ref.abs().max()).item()
        times = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants[r % 4:] + variants[:r % 4]:
                times[v].append(graph_time_ms(lambda vv=v: chain.run(vv, *best), calls=2, reps=7))
        med = {v: sorted(ts)[len(ts) // 2] * 1e3 / args.layers for v, ts in times.items()}
        print(f"M={m} us per layer: " + " ".join(f"{v} {med[v]:.2f} ({med[v] / med['cublas']:.3f})" for v in variants)
              + f"  rel err {errs}", flush=True)
        result.append(dict(m=m, configs=best, us_per_layer=med, rel_err=errs))
        del chain
    with open(os.path.join(args.out, "pdl_gemm_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=result), f, indent=1)


if __name__ == "__main__":
    main()
