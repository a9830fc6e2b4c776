"""An experiment, not used by kvroll: ``y = x @ W^T (+ b)`` for the few rows of a decode step (M <= 16) in one
Triton kernel, timed against cuBLAS by ``gemm_skinny.py --skinny [--tune]``. Session 13 on an H200: slower than
cuBLAS on three of Qwen3-1.7B's four projections at M = 1-16 and 8% faster on gate_up only at its best
configuration; its split-K version (``skinny_linear_splitk``) 10% faster on down only
(docs/benchmarks/engine_throughput.md). Kept to reproduce those measurements.

At batch 1-8 a decode step is bound by reading the weights, and cuBLAS's kernels for M = 1-8 reach ~60% of the
copy bandwidth on Qwen3-1.7B's projections (docs/benchmarks/engine_throughput.md, session 13: 38.8 µs per layer
against 23.4 µs of weight bytes). Here each program owns ``BLOCK_N`` output columns, streams their weight rows over
K in ``BLOCK_K`` tiles (``evict_first``: each weight byte is read once per step) and multiplies them against the
input rows padded to 16 on the tensor cores, the weight tile as the MMA's M side (the "swap AB" layout of GEMV
kernels); fp32 accumulation, one rounding to the output dtype, bias added in fp32 before it.

    y = skinny_linear(x, weight, bias)          # x [..., K] with <= 16 rows, weight [N, K]; as F.linear
    skinny_applies(x, weight)                   # whether the kernel serves these (else call F.linear)

Numerics: the products are summed in another order than cuBLAS's, so outputs may differ from ``F.linear`` by a
rounding of the output dtype (fp32 accumulation in both); the CPU reference (``skinny_linear_torch``) is the fp32
product rounded once, which the kernel matches to fp32 summation order under the interpreter.
"""
from __future__ import annotations

import torch

from kvroll.kernels.decode_attention import _arrival_counters  # self-resetting arrival counters, shared

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_ROWS = 16  # the padded rows of the MMA's N side


def skinny_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the fp32 product (+ bias in fp32) rounded once to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROWS: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            else:
                k_mask = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if w.dtype == tl.float32:
                acc += tl.dot(w, tl.trans(x), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(x))
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])


if triton is not None:
    @triton.jit
    def _skinny_splitk_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, k_chunk, stride_xm, stride_wn,
                              stride_ym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              ROWS: tl.constexpr, SPLIT_K: tl.constexpr):
        """Program (column block, K chunk): a partial [BLOCK_N, ROWS] product over its chunk of K into the fp32
        workspace; the last of a column block's SPLIT_K programs to arrive sums the partials in split order
        (deterministic), adds the bias and stores the output, then resets the block's arrival counter."""
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, ROWS)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k_lo + offs_k[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + k_lo + offs_k[None, :]
        acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_mask = (k0 + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(w, tl.trans(x))
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        tile = (offs_n[:, None] * ROWS + offs_m[None, :])  # [BLOCK_N, ROWS] within one split's [N_pad, ROWS]
        n_pad = tl.num_programs(0) * BLOCK_N
        tl.store(ws_ptr + pid_k * n_pad * ROWS + tile, acc)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N, ROWS], tl.float32)
            for sk in range(SPLIT_K):
                total += tl.load(ws_ptr + sk * n_pad * ROWS + tile, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


def skinny_linear_splitk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, split_k: int = 4,
                         block_n: int = 16, block_k: int = 256, num_stages: int = 3,
                         num_warps: int = 4) -> torch.Tensor:
    """``F.linear`` for <= 16 rows with K split over ``split_k`` programs per column block (see the kernel)."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, block_n)
    k_chunk = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_chunk)
    ws = torch.empty((split_k, blocks * block_n, MAX_ROWS), dtype=torch.float32, device=x.device)
    _skinny_splitk_kernel[(blocks, split_k)](
        x2, weight, bias if bias is not None else weight, y, ws, _arrival_counters(x.device, blocks), m, n, k, k_chunk,
        x2.stride(0), weight.stride(0), n, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        ROWS=MAX_ROWS, SPLIT_K=split_k, num_warps=num_warps, num_stages=num_stages)
    return y


def skinny_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A CUDA (or, under the interpreter, CPU) half-precision input of <= 16 rows against a contiguous weight of
    its dtype; the caller takes ``F.linear`` otherwise."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return False
    k = weight.shape[-1] if weight.dim() == 2 else -1
    return (x.shape[-1] == k and x.numel() // max(k, 1) <= MAX_ROWS and weight.is_contiguous()
            and x.device == weight.device and k % 16 == 0)


def _config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages): 16 output columns per program (>= 128 programs from N = 2,048), K tiles of
    256-512 so that each program keeps ~32-64 KB of weight loads in flight."""
    block_k = 512 if k >= 4096 else 256
    return 16, min(block_k, max(16, triton.next_power_of_2(k))), 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, block_n: int | None = None,
                  block_k: int | None = None, num_stages: int | None = None, num_warps: int = 4) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K] of at most 16 rows (``skinny_applies``), in one kernel.
    ``block_n`` / ``block_k`` / ``num_stages`` / ``num_warps``: tuning switches (None: ``_config``'s)."""
    assert triton is not None, "skinny_linear needs Triton; use F.linear on CPU"
    assert skinny_applies(x, weight), (x.shape, x.dtype, weight.shape, weight.dtype)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous(), bias.shape
    cfg_n, cfg_k, cfg_stages = _config(n, k)
    block_n, block_k, stages = block_n or cfg_n, min(block_k or cfg_k, cfg_k if block_k is None else block_k), \
        num_stages or cfg_stages
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), n,
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, ROWS=MAX_ROWS, EVEN_K=k % block_k == 0,
        num_warps=num_warps, num_stages=stages)
    return y
