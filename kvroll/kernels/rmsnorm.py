"""RMSNorm in one Triton kernel, rounding as HF's ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` / ``Qwen3RMSNorm`` /
``MistralRMSNorm`` do (the four forwards are the same code in transformers 5.17).

HF's forward is ~8 small kernels (cast, pow, mean, add, rsqrt, mul, cast, mul); at 113 calls per decode step of
Qwen3-1.7B that is ~1.8 ms of a 12 ms step. The fp32 PyTorch reference (HF's math, the oracle of the tests):

    out = rms_norm_torch(x, weight, eps)     # x: [..., D] fp16/bf16/fp32; weight: [D]

out = weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(x.dtype), in torch's promotion of (weight, x)
dtypes. The kernel (``rms_norm``, same call) has one program per row with the whole row in one block, sums
in fp32, rounds the normalised row to x's dtype before the weight (as HF) and multiplies in fp32: a
(bf16|fp16) x (bf16|fp16) product is exact in fp32, so its one rounding to the output dtype is torch's.
Only the order of the sum of squares differs from HF: the output is HF's, or (a few bf16 elements in 1e6)
HF's with the normalised value rounded to its neighbour, i.e. weight x 1 ulp of it (<= 2 ulp of the output).

``install_fused_rmsnorm(model)`` points every HF RMSNorm instance of a model at the kernel for CUDA inputs
under no-grad (rollout decode); with grad enabled or on CPU the instance runs HF's own forward.
"""
from __future__ import annotations

import torch

from kvroll.kernels.class_swap import ClassSwap

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 1 << 16  # the whole row sits in registers: beyond this a row would need a loop


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm forward as a function (see the module docstring)."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


if triton is not None:

    @triton.jit
    def rms_norm_row(x, w_ptr, cols, mask, n_cols, eps):
        """HF's RMSNorm of one row ``x`` (its masked tail 0) in x's dtype: fp32 sum of squares, the normalised row
        rounded to x's dtype before the weight, the product in fp32 (returned, unrounded). Also add_rms_norm's."""
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)  # HF rounds here, before the weight
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        return w.to(tl.float32) * normed.to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        out = rms_norm_row(x, w_ptr, cols, mask, n_cols, eps)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm over the last dim of ``x`` [..., D] with ``weight`` [D]; see the module docstring.

    Returns a new tensor of x's shape in ``torch.promote_types(weight.dtype, x.dtype)`` (HF's output dtype).
    """
    assert triton is not None, "rms_norm needs Triton; use rms_norm_torch on CPU"
    assert x.dtype in DTYPES and weight.dtype in DTYPES, (x.dtype, weight.dtype)
    n_cols = x.shape[-1]
    assert weight.dim() == 1 and weight.shape[0] == n_cols, (weight.shape, x.shape)
    assert x.stride(-1) == 1 and weight.stride(0) == 1, "the normalised dim must be contiguous"
    assert x.device == weight.device, (x.device, weight.device)
    block = triton.next_power_of_2(n_cols)
    assert block <= MAX_BLOCK, f"rows of {n_cols} exceed one block ({MAX_BLOCK})"
    rows = x.reshape(-1, n_cols)  # a view for the usual layouts; a copy only if the leading dims can't merge
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0] == 0:
        return out
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), n_cols, n_cols, float(eps),
                                       BLOCK=block, num_warps=_num_warps(block))
    return out


def _fused_applies(x: torch.Tensor) -> bool:
    """The kernel serves CUDA inputs without autograd; everything else (training, CPU) takes HF's forward."""
    return x.is_cuda and not torch.is_grad_enabled()


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _fused_applies(hidden_states):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return super(type(self), self).forward(hidden_states)  # the HF class's own forward


_SWAP = ClassSwap(_fused_forward)


def _is_hf_rmsnorm(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), (int, float)))


def install_fused_rmsnorm(model: torch.nn.Module) -> int:
    """Route every HF RMSNorm of ``model`` through ``rms_norm`` for CUDA no-grad inputs; returns how many.

    Each instance's class becomes a subclass of its HF class (``FusedLlamaRMSNorm``) whose ``forward`` takes the
    kernel or else HF's own forward: with grad enabled or on CPU it runs exactly as before. A class swap rather than
    a bound method stored on the instance, which would be a reference cycle (module -> method -> module) that
    keeps a dropped engine's weights in GPU memory until the garbage collector runs. A second call patches
    nothing; without Triton nothing is patched.

        n = install_fused_rmsnorm(model)   # 113 on Qwen3-1.7B: 28 layers x (2 + q_norm, k_norm) + final
    """
    if triton is None:
        return 0
    return _SWAP.install(model, _is_hf_rmsnorm)
