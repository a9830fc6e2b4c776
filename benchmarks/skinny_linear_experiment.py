"""An experiment, not used by kvroll: ``y = x @ W^T (+ b)`` for the few rows of a decode step (M <= 16) in one
Triton kernel, timed against cuBLAS by ``gemm_skinny.py --skinny [--tune]``. Session 13 on an H200: slower than
cuBLAS on three of Qwen3-1.7B's four projections at M = 1-16 and 8% faster on gate_up only at its best
configuration (docs/benchmarks/engine_throughput.md); kept to reproduce that and as the start of a split-K version.

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
