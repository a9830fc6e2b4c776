"""The gated MLP's activation, SiLU(gate) * up, in one Triton kernel over the fused gate+up projection's output.

HF's Llama / Qwen2 / Qwen3 / Mistral MLP computes ``act_fn(gate_proj(x)) * up_proj(x)``: a SiLU kernel and a
multiply kernel per layer per step (56 of a Qwen3-1.7B decode step's elementwise kernels). With the two projections
fused into one matmul against [gate_proj.weight; up_proj.weight] (``kvroll/kernels/fused_mlp.py``) their output is
one row ``gate_up`` [..., 2I] = [gate | up], and this kernel reads both halves and writes [..., I] once:

    out = silu_mul(gate_up)          # gate_up: [..., 2I] fp16/bf16/fp32, last dim contiguous -> [..., I]
    ref = silu_mul_torch(gate_up)    # HF's math, the oracle of the tests (fp32 in, the fp32 reference)

Rounding, as HF's two kernels round: ``F.silu`` of a bf16/fp16 tensor computes x / (1 + exp(-x)) in fp32 and
rounds the activation to the input dtype; the product of two bf16/fp16 tensors is exact in fp32 and rounded once
to the dtype. The kernel does the same: silu in fp32, rounded to the input dtype, product in fp32, one rounding.
Only ``exp`` differs (Triton's against torch's, each within a few fp32 ulp), so an activation that lies within that
of a rounding boundary can round to its neighbour: the output is HF's, or (rarely) HF's with the activation one
ulp of the input dtype away, i.e. <= ~2 ulp of the output. In fp32 the two agree to a few fp32 ulp.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 1024  # columns of the output per program


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's ``act_fn(gate) * up`` on ``gate_up`` [..., 2I] = [gate | up] -> [..., I] (see the module docstring)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


if triton is not None:
    from kvroll.kernels.pdl_gemm import gdc_launch_dependents, gdc_wait, launch_options

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        if PDL:  # in the chain of PDL launches (kvroll.kernels.pdl_gemm): wait, then let the next launch
            gdc_wait()
            gdc_launch_dependents()
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # HF rounds the activation to the input dtype
        out = act.to(tl.float32) * up.to(tl.float32)  # exact in fp32 for 16-bit inputs: one rounding below
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """SiLU(gate) * up of ``gate_up`` [..., 2I] in one kernel; returns a new [..., I] tensor of its dtype.
    ``pdl``: a programmatic dependent launch (``kvroll.kernels.pdl_gemm``; the caller checks ``pdl_available``)."""
    assert triton is not None, "silu_mul needs Triton; use silu_mul_torch on CPU"
    assert gate_up.dtype in DTYPES, gate_up.dtype
    assert gate_up.shape[-1] % 2 == 0, f"gate_up's last dim {gate_up.shape[-1]} is not [gate | up]"
    assert gate_up.stride(-1) == 1, "the last dim must be contiguous"
    n_cols = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * n_cols)  # a view for the usual layouts; a copy only if dims can't merge
    out = torch.empty(*gate_up.shape[:-1], n_cols, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] == 0 or n_cols == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(n_cols))
    grid = (rows.shape[0], triton.cdiv(n_cols, block))
    _silu_mul_kernel[grid](rows, out, rows.stride(0), n_cols, n_cols, BLOCK=block, PDL=pdl, num_warps=4,
                           **launch_options(pdl))
    return out
