"""A residual add and the RMSNorm that follows it, in one Triton kernel.

HF's decoder layer ends its attention half with ``hidden = residual + attn_out; residual = hidden;
hidden = post_attention_layernorm(hidden)``: an add kernel, then the norm (one fused kernel on CUDA,
``kvroll/kernels/rmsnorm.py``), with the sum written and read back in between. This kernel reads x and the
residual once and writes both outputs:

    summed, normed = add_rms_norm(x, residual, weight, eps)   # x, residual: [..., D] same dtype; weight: [D]
    ref = add_rms_norm_torch(x, residual, weight, eps)        # HF's math, the oracle of the tests

Rounding, as HF's two steps round: ``summed`` is x + residual in fp32 rounded once to the input dtype (what torch's
add of two fp16/bf16 tensors does; in fp32 it is the fp32 sum), and ``normed`` is ``rms_norm`` of that rounded sum,
with the roundings ``rmsnorm.py`` documents (normalised row rounded to the input dtype before the weight, output in
``torch.promote_types(weight.dtype, x.dtype)``). So ``summed`` is HF's bit for bit; ``normed`` differs from HF's
only by the order of the sum of squares, as ``rms_norm`` does. The row's reduction is written as ``rms_norm``'s
(one block, same warps), so on a GPU ``normed`` equals ``rms_norm(summed, ...)`` bit for bit.

``x`` may be a split-K projection's fp32 partial sums [P, ..., D] (``kvroll/kernels/split_k.py``): the kernel adds
them in order in fp32 and rounds the total once to the residual's dtype, the projection's own output rounding
(``sum_parts``), before the add above. The matmul writes the partials, and this kernel reads them, in place of
the projection's output in the model's dtype.
"""
from __future__ import annotations

import torch

from kvroll.kernels.rmsnorm import DTYPES, MAX_BLOCK, _num_warps, rms_norm_torch, triton

if triton is not None:
    import triton.language as tl

    from kvroll.kernels.pdl_gemm import gdc_launch_dependents, gdc_wait, launch_options
    from kvroll.kernels.rmsnorm import rms_norm_row


def sum_parts(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A split-K projection's fp32 partials [P, ..., D] added in order (p = 0, 1, ...) in fp32, rounded once to
    ``dtype``: the projection's output (``kvroll.kernels.split_k``), as the kernel forms it."""
    total = x[0]
    for part in x[1:]:
        total = total + part
    return total.to(dtype)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``residual + x`` then its RMSNorm of the sum, as a function (see the module docstring); ``x`` may be a
    split-K projection's fp32 partials [P, *residual.shape] (``sum_parts``)."""
    if x.dim() == residual.dim() + 1:
        x = sum_parts(x, residual.dtype)
    summed = residual + x
    return summed, rms_norm_torch(summed, weight, eps)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, out_ptr, stride_x, stride_r, stride_sum, stride_out,
                             n_cols, eps, stride_part, BLOCK: tl.constexpr, PARTS: tl.constexpr = 0,
                             PDL: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        if PDL:  # in the chain of PDL launches (kvroll.kernels.pdl_gemm): wait, then let the next launch
            gdc_wait()
            gdc_launch_dependents()
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if PARTS != 0:  # a split-K projection's fp32 partial sums: added in order, rounded once as its output would be
            for p in tl.static_range(1, PARTS):
                x += tl.load(x_ptr + p * stride_part + row * stride_x + cols, mask=mask, other=0.0)
            x = x.to(r.dtype)
        summed = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)  # HF's add: one rounding to the input dtype
        tl.store(sum_ptr + row * stride_sum + cols, summed, mask=mask)
        out = rms_norm_row(summed, w_ptr, cols, mask, n_cols, eps)  # rms_norm's own code, on the rounded sum
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    return t.reshape(-1, n_cols)  # a view for the usual layouts; a copy only if the leading dims can't merge


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, RMSNorm(x + residual))`` over the last dim in one kernel; see the module docstring.

    ``x`` and ``residual`` [..., D] share shape, dtype and device; ``weight`` is [D]. Returns new tensors: the sum
    in residual's dtype and the normed sum in ``torch.promote_types(weight.dtype, residual.dtype)`` (HF's).
    ``x`` may instead be a split-K projection's fp32 partial sums [P, *residual.shape] (``kvroll.kernels.split_k``,
    P <= 4): they are added in order in fp32 and rounded once to residual's dtype (``sum_parts``) before the add.
    ``pdl``: a programmatic dependent launch that waits for the previous kernel in the kernel and lets the next one
    launch at once (``kvroll.kernels.pdl_gemm``; the caller checks ``pdl_available``).
    """
    assert triton is not None, "add_rms_norm needs Triton; use add_rms_norm_torch on CPU"
    parts, part_stride = 0, 0
    if x.dim() == residual.dim() + 1:  # split-K partials [P, *residual.shape] fp32
        parts = x.shape[0]
        assert 1 <= parts <= 4 and x.dtype == torch.float32 and x.shape[1:] == residual.shape, \
            f"split-K partials must be [P <= 4, *{tuple(residual.shape)}] fp32, got {tuple(x.shape)} {x.dtype}"
        part_stride = x.stride(0)
        x = x[0]
    dtype = residual.dtype
    assert dtype in DTYPES and weight.dtype in DTYPES, (dtype, weight.dtype)
    assert residual.shape == x.shape and (parts or x.dtype == dtype), (residual.shape, dtype, x.shape, x.dtype)
    n_cols = x.shape[-1]
    assert weight.dim() == 1 and weight.shape[0] == n_cols, (weight.shape, x.shape)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1 and weight.stride(0) == 1, "the normed dim must be contiguous"
    assert x.device == residual.device == weight.device, (x.device, residual.device, weight.device)
    block = triton.next_power_of_2(n_cols)
    assert block <= MAX_BLOCK, f"rows of {n_cols} exceed one block ({MAX_BLOCK})"
    summed = torch.empty(x.shape, dtype=dtype, device=x.device)
    normed = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, dtype), device=x.device)
    x_rows, r_rows = _rows(x, n_cols), _rows(residual, n_cols)
    if x_rows.shape[0] == 0:
        return summed, normed
    if parts:
        assert x_rows.data_ptr() == x.data_ptr() and part_stride >= x_rows.shape[0] * x_rows.stride(0), \
            "each part's rows must be one strided block"
    _add_rms_norm_kernel[(x_rows.shape[0],)](x_rows, r_rows, weight, summed, normed, x_rows.stride(0),
                                             r_rows.stride(0), n_cols, n_cols, n_cols, float(eps), part_stride,
                                             BLOCK=block, PARTS=parts, PDL=pdl, num_warps=_num_warps(block),
                                             **launch_options(pdl))
    return summed, normed
