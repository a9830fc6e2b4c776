"""A decode step's skinny projection split over K, in one strided-batched cuBLAS call, its partial sums in fp32.

At a decode step's few rows cuBLAS tiles a projection by its output columns: Qwen3-1.7B's down projection (2,048 x
6,144) runs ~64 programs on an H100's 132 SMs and streams its weight at ~1.7 TB/s. ``linear_parts`` runs it as
``parts`` products over K slices of the input and the weight, one ``torch.bmm`` on strided views (no copy) with
fp32 outputs: twice the programs, each half the K. The slices' sum is left to the kernel that reads the projection's
output next, the residual add fused into the RMSNorm (``add_rms_norm`` takes ``x`` as [parts, ..., D] fp32).

    parts = split_k_parts(rows, n, k, "down")         # 2 where measured faster, else 1 ("down" / "o")
    partial = linear_parts(x, weight, parts)          # [parts, ..., N] fp32; sum over dim 0 = x @ weight.T

Numerics: the sum of the fp32 partials, rounded once to the model's dtype, is the projection's output with its K
reduction in another order (as cuBLAS's own split-K at some shapes): equal to ``F.linear``'s up to a rounding.

Where (``split_k_parts``, session 22's H100 sweeps, ``benchmarks/gemm_ksplit_bmm.py``, the weight read from HBM
each call, and the engine's A/B; docs/benchmarks/engine_throughput.md): the down projection at 1-128 rows, the o
projection at 1-128 rows of models up to 2,560 wide and at 1-16 rows of wider ones; never qkv or gate_up. The
decoder layer (``fused_add_norm``) asks for it where the MLP (``fused_mlp``) or the attention
(``fused_qkv_rotary``) is fused too and the projection is a plain bias-free row-major ``Linear``, in half precision
on a GPU (an fp32 model keeps cuBLAS's whole product: not measured).
"""
from __future__ import annotations

import torch
from torch import nn

from kvroll.kernels.pdl_gemm import chain_applies, linear_pdl, pdl_available

SPLIT_K = True  # False: every projection as one F.linear (before session 22; the engine A/B's "old")
MIN_K = 1024  # K per slice at least (the sweep's shortest: o's 2 x 1,024)


def _bmm_fp32_out() -> bool:
    """Whether this torch has ``bmm(..., out_dtype=)`` (2.8+) and is a CUDA build, not ROCm (measured on NVIDIA)."""
    try:
        torch.ops.aten.bmm.dtype
    except (AttributeError, RuntimeError):
        return False
    return torch.version.hip is None


SUPPORTED = _bmm_fp32_out()


def split_k_parts(rows: int, n: int, k: int, kind: str) -> int:
    """K slices for a projection of ``kind`` ("down", "o") of N = ``n`` outputs over ``rows`` rows: 2 where the
    H100 measurements found them faster, where K splits evenly into slices of at least ``MIN_K``; else 1.

    * down, up to 128 rows. The microbenchmark: 0.72-0.95x cuBLAS's time on 34 of 35 shapes (Qwen3-0.6B / 1.7B /
      4B / 8B, Qwen2.5-0.5B / 7B, Llama-3-8B x 1-256 rows), 1.11x at Qwen3-8B's 128 rows. In the engine (Qwen3-1.7B)
      shorter steps at batches 1, 8, 64 and 128, but at 256 the split down kernel took 15.9 us against 14.6: the
      rule stops at 128.
    * o, N <= 2,560, up to 128 rows: 0.80-0.96x (Qwen3-0.6B / 1.7B / 4B; Qwen3-1.7B at 256 rows 1.06x).
    * o, N > 2,560, up to 16 rows: 0.86-0.99x (Qwen2.5-7B, Qwen3-8B); at 64-128 rows 1.01-1.05x.
    * qkv and gate_up: 0.91-1.10x and 0.97-1.64x (Qwen3-1.7B): never.

    Never on a torch without ``bmm(..., out_dtype=)`` (before 2.8) or a ROCm build (``SUPPORTED``)."""
    if not SPLIT_K or not SUPPORTED or k % 2 or k // 2 < MIN_K or n < 1:
        return 1
    limit = 128 if kind == "down" else (128 if n <= 2560 else 16) if kind == "o" else 0
    return 2 if rows <= limit else 1


def plain_linear(module) -> torch.Tensor | None:
    """The weight of a bias-free ``nn.Linear`` (exactly that class, no hook, a plain 2-D weight tensor laid out
    row-major, as ``linear_parts`` reads it), whose output is exactly ``x @ weight.T``; None for anything else (a
    LoRA wrapper, a quantized weight, a bias, a transposed view)."""
    if type(module) is not nn.Linear or module.bias is not None or module._forward_hooks \
            or module._forward_pre_hooks:
        return None
    weight = module.weight
    if type(weight.data) is not torch.Tensor or weight.dim() != 2:
        return None
    return weight if weight.stride(1) == 1 and weight.stride(0) == weight.shape[1] else None


def linear_parts(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, *x.shape[:-1], N] fp32: the products of x's and weight's ``parts`` K slices (x [..., K] with its last
    dim contiguous, weight [N, K] row-major); their sum over dim 0 is ``x @ weight.T`` up to fp32 roundings."""
    k = x.shape[-1]
    n = weight.shape[0]
    assert k % parts == 0 and weight.shape[1] == k, (x.shape, weight.shape, parts)
    rows = x.reshape(-1, k)
    assert rows.stride(-1) == 1 and weight.stride(-1) == 1 and weight.stride(0) == k, "K must be contiguous"
    xs = rows.view(rows.shape[0], parts, k // parts).transpose(0, 1)  # [P, M, K/P]: views of rows' strides
    ws = weight.view(n, parts, k // parts).transpose(0, 1).transpose(1, 2)  # [P, K/P, N]
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):
        out = torch.bmm(xs, ws, out_dtype=torch.float32)  # fp32 accumulators kept, one cuBLAS call
    else:  # CPU (the tests' interpreter path) and fp32: the same products in fp32
        out = torch.bmm(xs.float(), ws.float())
    return out.view(parts, *x.shape[:-1], n)


def project(linear: nn.Module, x: torch.Tensor, parts: int, chain: bool = False) -> torch.Tensor:
    """``linear(x)``, or, for ``parts`` > 1 and a ``plain_linear``, its fp32 partial sums over that many K slices
    (``linear_parts``: [parts, *x.shape[:-1], N]; where ``chain`` (the caller's layer is chained) and the chain's
    GEMM takes the shape, ``pdl_gemm.linear_pdl``'s, the same layout) for the next ``add_rms_norm`` to add; any
    other module (a bias, a hook, a wrapper) runs its own forward, whole."""
    weight = plain_linear(linear) if parts > 1 else None
    if weight is None:
        return linear(x)
    if chain and chain_applies(x, weight, None, parts):  # the PDL chain's GEMM writes the same partials
        return linear_pdl(x, weight, pdl=pdl_available(x.device), parts=parts)
    return linear_parts(x, weight, parts)
