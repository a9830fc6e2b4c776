"""An experiment, not used by kvroll: a decode step's narrow projections, ``y = x @ W^T``, as one split-K Triton
kernel, the gated MLP's SiLU·mul optionally fused in as its prologue; timed against cuBLAS by
``benchmarks/gemm_decode.py``. Session 18 on an H100 (docs/benchmarks/kernel_decode.md), its best configuration
of ~25 timed against cuBLAS: qkv within 1-2% at M <= 64, o_proj slower at every M, gate_up 2-6% faster at M = 1-32,
down_proj 6-7% faster at M = 1-64, both slower from M = 128; with the SiLU·mul prologue 1.3-6x slower than cuBLAS
after ``silu_mul`` (every column block recomputes the activation of its whole input). Not adopted; kept to
reproduce those measurements.

At batch 16-256 a decode step's projections whose output is the hidden size (o_proj [H, Hq·D], down_proj [H, I])
have few output columns for many SMs: cuBLAS's kernels for Qwen3-1.7B's o_proj at M = 64 read the weight at ~36-46%
of the copy bandwidth, its down_proj at ~56-64%. Here program (column block, K chunk, row block) multiplies its
[BLOCK_M, chunk] slice of x against the [BLOCK_N, chunk] slice of W on the tensor cores (fp32 accumulation) and,
when K is split, stores the fp32 partial; the last of a tile's ``split_k`` programs to arrive (self-resetting
arrival counters) sums the partials in split order (deterministic) and stores the output once, rounded to x's
dtype.

``prologue="silu_mul"``: x is the fused gate+up projection's output [M, 2I] = [gate | up] and the product is taken
with ``silu(gate) * up`` computed as each tile is loaded, rounded exactly as ``kvroll/kernels/silu_mul.py`` (HF's
two roundings).

    y = linear_splitk(x, weight)                          # x [..., K], weight [N, K] -> [..., N], as F.linear
    y = linear_splitk(gate_up, down.weight, prologue="silu_mul")   # = F.linear(silu_mul(gate_up), down.weight)
    ref = linear_torch(x, weight, prologue)               # the fp32 product of the (rounded) input, rounded once

Numerics: the products are summed in another order than cuBLAS's, so outputs may differ from ``F.linear`` by a
rounding of the output dtype (fp32 accumulation in both). Under the interpreter the kernel matches
``linear_torch`` to fp32 summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvroll.kernels.decode_attention import _arrival_counters  # self-resetting arrival counters, shared

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

PROLOGUES = (None, "silu_mul")


def linear_torch(x: torch.Tensor, weight: torch.Tensor, prologue: str | None = None) -> torch.Tensor:
    """The reference: the input (``silu_mul_torch`` of it with the prologue, HF's roundings), its fp32 product with
    the weight, rounded once to x's dtype."""
    assert prologue in PROLOGUES, prologue
    if prologue == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return (x.float() @ weight.float().t()).to(x.dtype)


if triton is not None:

    @triton.jit
    def _linear_splitk_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_chunk, stride_xm, stride_wn,
                              stride_ym, SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        n_mask = offs_n < N
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_lo + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_lo + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:  # every chunk is whole tiles: no K mask
                x_mask, w_mask = m_mask[:, None], n_mask[:, None]
            else:
                k_mask = (k0 + offs_k) < k_hi
                x_mask, w_mask = m_mask[:, None] & k_mask[None, :], n_mask[:, None] & k_mask[None, :]
            w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")  # each byte read once
            if SILU:  # x is [gate | up]: silu(gate) rounded to the dtype, times up in fp32, rounded once
                gate = tl.load(x_ptrs, mask=x_mask, other=0.0)
                up = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
                g = gate.to(tl.float32)
                act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
                a = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
            else:
                a = tl.load(x_ptrs, mask=x_mask, other=0.0)
            if a.dtype == tl.float32:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT:
            n_splits = tl.num_programs(1)
            tile = pid_m * tl.num_programs(0) + pid_n
            part = ws_ptr + (tile * n_splits).to(tl.int64) * (BLOCK_M * BLOCK_N) \
                + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(part + pid_k * (BLOCK_M * BLOCK_N), acc)
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == n_splits - 1:
                tl.atomic_xchg(cnt_ptr + tile, 0)  # self-resetting: zero between launches
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sk in range(n_splits):  # in split order, whichever arrived last: deterministic
                    total += tl.load(part + sk * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def default_config(m: int, n: int, k: int) -> dict:
    """(block_m, block_n, block_k, split_k, num_stages, num_warps) for M rows against an [N, K] weight."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = max(1, min(8, 132 // max(tiles, 1), k // 512))
    return dict(block_m=block_m, block_n=block_n, block_k=128, split_k=split_k, num_stages=4, num_warps=4)


def linear_splitk(x: torch.Tensor, weight: torch.Tensor, prologue: str | None = None, block_m: int | None = None,
                  block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                  num_stages: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (of ``silu_mul(x)`` with ``prologue="silu_mul"``) in one kernel; see the module
    docstring. The rest are tuning switches (None: ``default_config``'s)."""
    assert triton is not None, "linear_splitk needs Triton; use linear_torch on CPU"
    assert prologue in PROLOGUES, f"prologue={prologue!r}: use None or 'silu_mul'"
    n, k = weight.shape
    width = 2 * k if prologue == "silu_mul" else k
    assert x.shape[-1] == width, f"x's last dim {x.shape[-1]} must be {width} for a weight of {k} columns" \
        + (" ([gate | up])" if prologue else "")
    assert x.dtype == weight.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1, (x.dtype, weight.dtype)
    x2 = x.reshape(-1, width)
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = default_config(m, n, k)
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_stages=num_stages,
                 num_warps=num_warps)
    cfg.update({key: v for key, v in given.items() if v is not None})
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    k_chunk = triton.cdiv(triton.cdiv(k, cfg["split_k"]), bk) * bk
    splits = triton.cdiv(k, k_chunk)
    grid = (triton.cdiv(n, bn), splits, triton.cdiv(m, bm))
    tiles = grid[0] * grid[2]
    ws = torch.empty((tiles * splits * bm * bn,), dtype=torch.float32, device=x.device) if splits > 1 else y
    cnt = _arrival_counters(x.device, tiles) if splits > 1 else y
    _linear_splitk_kernel[grid](x2, weight, y, ws, cnt, m, n, k, k_chunk, x2.stride(0), weight.stride(0), n,
                                SILU=prologue == "silu_mul", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=splits > 1,
                                EVEN_K=k % k_chunk == 0 and k_chunk % bk == 0, num_warps=cfg["num_warps"],
                                num_stages=cfg["num_stages"])
    return y
