"""A decode step's qkv and gate_up projections as a Triton GEMM in a chain of programmatic dependent launches.

Inside a decode layer the kernels run back to back, each waiting for the previous one to end: the next kernel's
launch and first loads are latency on the critical path. On Hopper a kernel launched as a programmatic dependent
launch (PDL) may start while the previous one still runs and waits for it in the kernel (``gdc_wait``,
PTX ``griddepcontrol.wait``), once the previous kernel has signalled its dependents (``gdc_launch_dependents``) or
ended. cuBLAS's kernels neither wait nor signal that way, so the chain needs kvroll's own kernels on both sides of
each boundary. With ``linear_pdl`` for the qkv and gate_up projections, a layer's kernels

    add_rms_norm -> qkv -> rotary (+ cache write) -> attention -> o -> add_rms_norm -> gate_up -> silu_mul -> down

have four Triton -> Triton boundaries under PDL (around qkv and gate_up): ``add_rms_norm``, ``rotary`` and
``silu_mul`` wait for their predecessor first and signal their dependents at once; the GEMM waits before its first
load and signals once its products are done, before its store. Every kernel of the chain waits before it reads or
writes anything, in every program, so each one's wait also covers every earlier kernel (the previous one could not
end before its own wait returned).

    rows = chain_rows(x)                       # the GEMM's rows if the chain applies to x (a GPU it was measured on)
    y = linear_pdl(x, weight)                  # x [..., K] @ weight [N, K]^T, bf16 / fp16, a PDL launch

Numerics: fp32 accumulation over K in 128- or 256-wide steps and one rounding to the input's dtype, as
``F.linear``; the order of the K reduction may differ from cuBLAS's, so outputs are equal up to a rounding.

Where (``gemm_config``, session 24's H100 probe ``benchmarks/pdl_gemm_probe.py``: a chain of RMSNorm -> qkv ->
RMSNorm -> gate_up layers of Qwen3-1.7B's shapes, weights streamed from memory): at 1 and 64 rows the PDL chain took
0.906 and 0.934x cuBLAS's time per layer (the Triton GEMM alone 0.965 / 1.002x), at 8 rows 0.981x; at 128 rows
1.021x (the GEMM alone 1.088x), so the chain stops at 64 rows. Compute capability 9.x only (PDL needs 9.0+; other
GPUs not measured), half precision, no bias.
"""
from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the chain then never applies
    gdc_launch_dependents = gdc_wait = None

PDL_CHAIN = True  # False: cuBLAS for qkv / gate_up and plain launches (before session 24; the engine A/B's "old")
PDL_LAUNCH = True  # False: the chain's kernels launched plainly (the GPU test's reference)
MAX_ROWS = 64  # the probe's gain stops here (128 rows: 1.021x)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def gemm_config(m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of ``linear_pdl`` for [m, k] @ [n, k]^T, or None where it does not
    apply. Session 24's sweep (Qwen3-1.7B, K = 2,048; 14 tiles per product per row count, each product timed
    alone with its weight streamed from memory): qkv (N = 4,096) best at 32 x 256 tiles, 4 stages (M = 1-64);
    gate_up (N = 12,288) at 32 x 128, 4 stages for M <= 8 and 128 x 128, 3 stages at 64."""
    if m < 1 or m > MAX_ROWS:
        return None
    if n <= 6144:
        cfg = (32, 256, 4, 4)
    else:
        cfg = (32, 128, 4, 4) if m <= 16 else (128, 128, 4, 3)
    block_n, block_k = cfg[:2]
    return cfg if n % block_n == 0 and k % block_k == 0 and n // block_n >= 64 else None


def gemm_available(device) -> bool:
    """Where ``linear_pdl`` serves the chain: an NVIDIA GPU of compute capability 9.x (where it was measured, an
    H100), Triton with ``gdc_wait`` and ``launch_pdl``, not the interpreter."""
    if triton is None or gdc_wait is None or _INTERPRET or torch.version.hip is not None:
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper(index: int) -> bool:
    from kvroll.kernels.decode_attention import _pdl_ok  # Triton's launcher takes ``launch_pdl``
    device = torch.device("cuda", index)
    return _pdl_ok(device) and torch.cuda.get_device_capability(device)[0] == 9


def pdl_available(device) -> bool:
    """Whether the chain's kernels are launched as programmatic dependent launches on ``device``: ``PDL_CHAIN``
    and ``PDL_LAUNCH`` on, and ``gemm_available``. (``PDL_LAUNCH = False`` keeps the chain's kernels but launches
    them plainly: the same values, the tests' check of the launches' ordering.)"""
    return PDL_CHAIN and PDL_LAUNCH and gemm_available(device)


def chain_applies(x: torch.Tensor, weight: torch.Tensor, bias=None) -> bool:
    """Whether the projection x [..., K] @ weight^T takes ``linear_pdl``: ``PDL_CHAIN`` on, ``gemm_available``,
    half precision, no bias, a row-major weight, rows and shape ``gemm_config`` covers."""
    if not PDL_CHAIN or bias is not None or x.dtype not in (torch.float16, torch.bfloat16) \
            or weight.dtype != x.dtype or weight.dim() != 2 or weight.stride(1) != 1 \
            or weight.stride(0) != weight.shape[1] or x.shape[-1] != weight.shape[1]:
        return False
    rows = x.numel() // max(1, x.shape[-1])
    return gemm_config(rows, weight.shape[0], weight.shape[1]) is not None and gemm_available(x.device)


def launch_options(pdl: bool) -> dict:
    """Triton launch keywords of a kernel in the chain: a PDL launch where ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


if triton is not None:

    @triton.jit
    def _gemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        if PDL:  # x comes from the previous kernel: wait for its end (and every earlier kernel's) first
            gdc_wait()
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (k0 + offs_k)[None, :])
            acc += tl.dot(x, tl.trans(w))
        if PDL:  # the next kernel may launch; it waits for this grid's end before it reads y
            gdc_launch_dependents()
        tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None])


def linear_pdl(x: torch.Tensor, weight: torch.Tensor, pdl: bool | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, one Triton launch (a PDL launch where ``pdl``; None:
    ``pdl_available``). Rows and shape must be ``gemm_config``'s (``chain_applies`` says so)."""
    assert triton is not None, "linear_pdl needs Triton"
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    cfg = gemm_config(m, n, k)
    assert cfg is not None, f"linear_pdl: [{m}, {k}] @ [{n}, {k}]^T is not a shape gemm_config covers"
    assert weight.shape[1] == k and weight.stride(1) == 1 and weight.stride(0) == k, "weight: row-major [N, K]"
    assert rows.stride(-1) == 1 and x.dtype == weight.dtype, (rows.stride(), x.dtype, weight.dtype)
    pdl = pdl_available(x.device) if pdl is None else pdl
    block_n, block_k, warps, stages = cfg
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemm_kernel[(n // block_n,)](rows, weight, out, m, n, k, rows.stride(0), weight.stride(0), out.stride(0),
                                  BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
                                  PDL=pdl, num_warps=warps, num_stages=stages, **launch_options(pdl))
    return out.view(*x.shape[:-1], n)
