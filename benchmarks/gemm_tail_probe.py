"""Where does a chained projection's time over its weight's bytes go? Per-program timestamps of the chain's GEMM.

Each of Qwen3-1.7B's four decode projections (qkv, gate_up, o and down in 2 K slices, the tiles ``pdl_gemm`` picks)
runs alone, plainly launched, on a weight rotated past L2 (so it streams from memory), as a copy of
``pdl_gemm._gemm_kernel``'s loop that also records each program's SM and its start and end on the GPU's global
timer (PTX ``%globaltimer``). Reported per projection and row count: the kernel's time (CUDA events over a graph of
``--copies`` calls), the weight's bytes over the copy bandwidth measured in the same run (``kvroll.bench``'s
``copy_bandwidth``, the engine floor's; session 31's c3 measured its own, a mean of 10 copies of 1 GiB: 3.015
TB/s), and from the timestamps the spread of the programs' starts, their durations (min / median / max) and the
spread of their ends: a launch ramp shows as start spread, unequal bandwidth per SM as duration spread, a tail as
the last end past the median end.
gate_up is the plain product on ``gemm_config``'s plain tiles, not the engine's SiLU * up epilogue (the same tiles
at 64 rows, others at <= 16). The global timer ticks every 0.256 us on an H100.
Developer probe (session 31); nothing in kvroll uses it.

    PYTHONPATH=.:benchmarks python benchmarks/gemm_tail_probe.py --rows 1,8,64 --out OUT
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from kvroll.bench.measure import copy_bandwidth
from kvroll.kernels import pdl_gemm

SHAPES = {"qkv": (4096, 2048, 1), "gate_up": (12288, 2048, 1), "o": (2048, 2048, 2), "down": (2048, 6144, 2)}


@triton.jit
def _timer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _timed_gemm(x_ptr, w_ptr, y_ptr, ts_ptr, M, N, K, k_part, stride_x, stride_w, stride_y, stride_part,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid, part = tl.program_id(0), tl.program_id(1)
    t0 = _timer()
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(part * k_part, (part + 1) * k_part, BLOCK_K):
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        w = tl.load(w_rows + (k0 + offs_k)[None, :])
        acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + part * stride_part + offs_m[:, None] * stride_y + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])
    t1 = _timer()
    slot = (part * tl.num_programs(0) + pid) * 3
    tl.store(ts_ptr + slot, t0)
    tl.store(ts_ptr + slot + 1, t1)
    tl.store(ts_ptr + slot + 2, _smid().to(tl.int64))


def run(name, m, copies, bandwidth):
    n, k, parts = SHAPES[name]
    cfg = pdl_gemm.gemm_config(m, n, k, parts, device=torch.device("cuda"))  # the tile linear_pdl takes here
    block_n, block_k, warps, stages = cfg[:4]
    block_m = max(16, triton.next_power_of_2(m))
    ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(m, k, device="cuda").bfloat16()
    out = torch.empty(parts, m, n, device="cuda", dtype=torch.float32 if parts > 1 else torch.bfloat16)
    grid = (n // block_n, parts)
    ts = torch.zeros(copies, grid[0] * parts * 3, dtype=torch.int64, device="cuda")

    def call(i):
        _timed_gemm[grid](x, ws[i], out, ts[i], m, n, k, k // parts, x.stride(0), ws[i].stride(0), out.stride(1),
                          out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                          num_stages=stages)
    for i in range(copies):
        call(i)
    ref = pdl_gemm.linear_pdl(x, ws[-1], pdl=False, parts=parts)
    same = torch.equal(out.view_as(ref), ref)  # the same products as the chain's kernel (recorded)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    t = ts.view(copies, -1, 3).cpu()[1:]  # the first call of each replay follows the previous replay's last: kept out
    starts, ends, sms = t[..., 0].double(), t[..., 1].double(), t[..., 2]
    first = starts.min(1, keepdim=True).values
    starts, ends = (starts - first) / 1e3, (ends - first) / 1e3  # us from each call's first program start
    dur = ends - starts
    floor_us = n * k * 2 / bandwidth * 1e6
    q = lambda v, p: float(v.quantile(p))  # noqa: E731
    return dict(proj=name, rows=m, config=list(cfg), programs=grid[0] * parts, same_as_chain=same,
                kernel_us=sorted(times)[3],
                floor_us=floor_us, start_spread_us=q(starts.max(1).values, 0.5),
                start_p90_us=q(starts, 0.9), dur_min_us=q(dur, 0.0), dur_med_us=q(dur, 0.5), dur_max_us=q(dur, 1.0),
                end_med_us=q(ends.median(1).values, 0.5), end_max_us=q(ends.max(1).values, 0.5),
                distinct_sms=int(sms[0].unique().numel()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    bandwidth = copy_bandwidth("cuda")  # the engine's floor's measure (kvroll bench)
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    result = []
    for m in [int(r) for r in args.rows.split(",")]:
        for name in SHAPES:
            r = run(name, m, args.copies, bandwidth)
            result.append(r)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    with open(os.path.join(args.out, "gemm_tail_probe.json"), "w") as f:
        json.dump(dict(bandwidth=bandwidth, rows=result), f, indent=1)


if __name__ == "__main__":
    main()
