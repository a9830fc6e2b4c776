"""Does a kernel boundary inside the decode layer cost more than a grid barrier? The MLP half of a chained layer
(gate_up with SiLU * up, then down in 2 K slices) as one persistent kernel against the chain's two PDL launches.
Session 39 (developer probe); nothing in kvroll uses it.

Sessions 24-38 left the chain's GEMMs at ~1.37x their weight bytes at 64 rows: each of a layer's four projections
pays ~3.5 us over its bytes, and loading the next projection's weight before the PDL wait lost (session 31). A
persistent kernel (one program per SM, all resident) runs both products with a grid barrier between them (an
arrival counter and a generation flag in global memory, self-resetting), so the second product's programs need no
launch, and ``--preload`` has each program load its first tile of down's weight into registers before it waits at
the barrier (the programs with no gate_up tile, 36 of 132 at 64 rows, arrive at once and load theirs while the
others still stream gate_up). Arms, each over ``--layers`` weight sets in one CUDA graph (weights streamed from
memory), every arm's output checked against the chain's:

- ``chain``: ``linear_pdl(x, gate_up, silu_mul=True)`` then ``linear_pdl(act, down, parts=2)``, PDL launches as in
  the engine (the tiles of ``gemm_config``);
- ``chain_plain``: the same, plain launches;
- ``persistent`` / ``persistent_preload``: the one kernel;
- ``gate_up_alone`` / ``down_alone``: each product of the chain by itself.

    PYTHONPATH=.:benchmarks python benchmarks/persistent_mlp_probe.py --rows 64 --out OUT/persistent_mlp.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.persistent_mlp_probe
    from benchmarks.kernel_decode import graph_time_ms

from kvroll.bench.report import write_json
from kvroll.kernels import pdl_gemm


@triton.jit
def _grid_barrier(cnt_ptr, gen_ptr, nprog):
    """Every program of the grid arrives before any leaves (all resident); self-resetting across launches."""
    tl.debug_barrier()  # this program's stores are issued before it arrives
    gen = tl.atomic_add(gen_ptr, 0, sem="acquire")
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if arrived == nprog - 1:
        tl.atomic_xchg(cnt_ptr, 0)
        tl.atomic_add(gen_ptr, 1, sem="release")
    else:
        cur = gen
        spins = 0
        while (cur == gen) & (spins < 4000000):  # bounded: a broken barrier shows as a wrong output, not a hang
            cur = tl.atomic_add(gen_ptr, 0, sem="acquire")
            spins += 1
    tl.debug_barrier()


@triton.jit
def _mlp_persistent(x_ptr, wgu_ptr, wd_ptr, act_ptr, out_ptr, cnt_ptr, gen_ptr, M, inter, hidden, k_part,
                    stride_part, BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr,
                    BK2: tl.constexpr, PRELOAD: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < M
    HALF: tl.constexpr = BN1 // 2
    units1 = inter // HALF
    # phase 1: act[:, u * HALF:(u + 1) * HALF] = silu(x @ gate^T) * (x @ up^T), rounded as silu_mul rounds
    if pid < units1:
        offs_n = pid * HALF + tl.arange(0, HALF)
        offs_k = tl.arange(0, BK1)
        g_rows = wgu_ptr + offs_n[:, None].to(tl.int64) * hidden
        u_rows = g_rows + inter.to(tl.int64) * hidden
        acc_g = tl.zeros([BM, HALF], tl.float32)
        acc_u = tl.zeros([BM, HALF], tl.float32)
        for k0 in range(0, hidden, BK1):
            xk = tl.load(x_ptr + offs_m[:, None] * hidden + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
            acc_g += tl.dot(xk, tl.trans(tl.load(g_rows + (k0 + offs_k)[None, :])))
            acc_u += tl.dot(xk, tl.trans(tl.load(u_rows + (k0 + offs_k)[None, :])))
        g = acc_g.to(act_ptr.dtype.element_ty).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(act_ptr.dtype.element_ty).to(tl.float32)
        out = a * acc_u.to(act_ptr.dtype.element_ty).to(tl.float32)
        tl.store(act_ptr + offs_m[:, None] * inter + offs_n[None, :], out.to(act_ptr.dtype.element_ty),
                 mask=m_mask[:, None])
    # phase 2's tile: down's output columns [c * BN2, (c + 1) * BN2) over K slice p
    units2 = (hidden // BN2) * 2
    c = pid % (hidden // BN2)
    p = pid // (hidden // BN2)
    offs_c = c * BN2 + tl.arange(0, BN2)
    offs_k2 = tl.arange(0, BK2)
    d_rows = wd_ptr + offs_c[:, None].to(tl.int64) * inter
    k_lo = p * k_part
    if PRELOAD:
        w0 = tl.load(d_rows + (k_lo + offs_k2)[None, :], mask=(pid < units2), other=0.0)
    _grid_barrier(cnt_ptr, gen_ptr, nprog)
    if pid < units2:
        acc = tl.zeros([BM, BN2], tl.float32)
        start = k_lo
        if PRELOAD:
            a0 = tl.load(act_ptr + offs_m[:, None] * inter + (k_lo + offs_k2)[None, :], mask=m_mask[:, None],
                         other=0.0, cache_modifier=".cg")
            acc += tl.dot(a0, tl.trans(w0))
            start = k_lo + BK2
        for k0 in range(start, k_lo + k_part, BK2):
            ak = tl.load(act_ptr + offs_m[:, None] * inter + (k0 + offs_k2)[None, :], mask=m_mask[:, None],
                         other=0.0, cache_modifier=".cg")
            acc += tl.dot(ak, tl.trans(tl.load(d_rows + (k0 + offs_k2)[None, :])))
        tl.store(out_ptr + p * stride_part + offs_m[:, None] * hidden + offs_c[None, :], acc, mask=m_mask[:, None])


def persistent_mlp(x, wgu, wd, bar, preload, cfg):
    m, hidden = x.shape
    inter = wd.shape[1]
    bn1, bk1, bn2, bk2, warps, stages = cfg
    act = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(2, m, hidden, dtype=torch.float32, device=x.device)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    assert inter // (bn1 // 2) <= sms and 2 * hidden // bn2 <= sms, "one tile a program"
    _mlp_persistent[(sms,)](x, wgu, wd, act, out, bar[0:1], bar[1:2], m, inter, hidden, inter // 2, out.stride(0),
                            BM=max(16, triton.next_power_of_2(m)), BN1=bn1, BK1=bk1, BN2=bn2, BK2=bk2,
                            PRELOAD=preload, num_warps=warps, num_stages=stages)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", default="128,128,32,128,4,3;128,64,32,128,4,3;128,128,32,256,4,2",
                    help="BN1,BK1,BN2,BK2,warps,stages of the persistent kernel, ';'-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    hidden, inter = 2048, 6144  # Qwen3-1.7B
    wgus = [(torch.randn(2 * inter, hidden, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
    wds = [(torch.randn(hidden, inter, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    results = []
    for m in map(int, args.rows.split(",")):
        x = torch.randn(m, hidden, device="cuda").bfloat16()

        def chain(wgu, wd, pdl=True):
            act = pdl_gemm.linear_pdl(x, wgu, pdl=pdl, silu_mul=True)
            return pdl_gemm.linear_pdl(act, wd, pdl=pdl, parts=2)

        want = chain(wgus[0], wds[0], pdl=False)
        row = {"rows": m, "us": {}, "err": {}}
        arms = {"chain": lambda: [chain(a, b) for a, b in zip(wgus, wds)],
                "chain_plain": lambda: [chain(a, b, pdl=False) for a, b in zip(wgus, wds)],
                "gate_up_alone": lambda: [pdl_gemm.linear_pdl(x, a, silu_mul=True) for a in wgus]}
        act0 = pdl_gemm.linear_pdl(x, wgus[0], pdl=False, silu_mul=True)
        arms["down_alone"] = lambda: [pdl_gemm.linear_pdl(act0, b, parts=2) for b in wds]
        for cfg_s in args.configs.split(";"):
            cfg = tuple(int(v) for v in cfg_s.split(","))
            for preload in (False, True):
                name = ("persistent_preload_" if preload else "persistent_") + "x".join(map(str, cfg))
                try:
                    got = persistent_mlp(x, wgus[0], wds[0], bar, preload, cfg)
                    torch.cuda.synchronize()
                    row["err"][name] = float((got.sum(0) - want.sum(0)).abs().max() / want.sum(0).abs().max())
                except Exception as exc:  # a tile that does not fit: recorded, not fatal
                    row["us"][name] = type(exc).__name__ + ": " + str(exc)[:120]
                    continue
                arms[name] = (lambda c=cfg, p=preload: [persistent_mlp(x, a, b, bar, p, c) for a, b in zip(wgus, wds)])
        for name, fn in arms.items():
            if isinstance(row["us"].get(name), str):
                continue
            row["us"][name] = round(1000 * graph_time_ms(fn) / args.layers, 2)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
