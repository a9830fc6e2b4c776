"""Rotary position embedding of a decode step's queries and keys in one Triton kernel (optionally after Qwen3's
per-head q_norm / k_norm), rounding as HF does.

HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` computes ``q * cos + rotate_half(q) * sin`` and the same for k:
a slice, a negation, a concatenation, two products and a sum per tensor, ~10 small kernels per layer per step.
Here one program per (row, group of heads) of q or k reads its heads, the rotated partner of each element and the
row's cos/sin, and writes the rotated heads once (one head a program at small batches; 2-16 where that would make
too many programs, ``_heads_per_program``; on a GPU the per-head sums of the norms below may then round in another
order, so their last bit can depend on the batch size, as cuBLAS's choice of kernel by batch size already does):

    q_rot, k_rot = rotary(q, k, cos, sin)          # q [..., Hq, D], k [..., Hkv, D], cos/sin [..., D]
    q_ref, k_ref = rotary_torch(q, k, cos, sin)    # HF's apply_rotary_pos_emb on the same layout (the oracle)

The layout is the projections' before HF's ``transpose(1, 2)``: heads next to the last dim (``unsqueeze_dim=2``),
so ``q`` may be a strided slice of a joined QKV row; the outputs are new contiguous tensors of that shape.
``rotate_half`` is HF's for any D: element i pairs with ``-x[D//2 + i]`` for i < D - D//2, else ``x[i - (D - D//2)]``.

Rounding: HF's two products and the sum each round to the input dtype (cos and sin are already in it: HF's rotary
module casts them). The kernel does the same three roundings: each product of two fp16/bf16 values is exact in
fp32 and rounded once, and the fp32 sum of two fp16/bf16 values rounded to the dtype is the correctly rounded
sum (fp32 carries more than 2p + 2 bits, so the double rounding is innocuous). In fp32 the products and the sum
are single fp32 operations, and the launch turns off FMA contraction (``enable_fp_fusion=False``), which would
round once where HF rounds twice. So the output is HF's bit for bit in fp32, fp16 and bf16.

Qwen3 normalises each head of q and k (``q_norm`` / ``k_norm``, an RMSNorm over D) before the rotary. The program
already holds the whole head, so ``q_norm=(weight, eps)`` / ``k_norm=(weight, eps)`` run that norm first in the same
program, with ``rms_norm``'s roundings (``rmsnorm.py``): the sum of squares in fp32, the normalised head rounded to
the dtype before the weight, the weight product rounded to the dtype; the rotated partner is normalised the same way
with the same per-head scale. Then the rotary's three roundings above:

    q_rot, k_rot = rotary(q, k, cos, sin, q_norm=(wq, eps), k_norm=(wk, eps))  # HF: q_norm, k_norm, then rotary
    q_ref, k_ref = rotary_torch(q, k, cos, sin, q_norm=(wq, eps), k_norm=(wk, eps))

The decode step's cache write can ride along (``write=CacheWrite(...)``): the key heads' programs then store each
rotated head straight into the cache at the head's write index, copies the value row beside it with its
||v||_1, position and live count, and (an appending cache) advances the write index, which is
``cache_write.cache_write`` on the rotated key, bit for bit (||v||_1 up to the order of its fp32 sum: on a GPU the
two kernels' reductions may differ in the last bit), with one launch fewer and no key round trip:

    q_rot, _ = rotary(q, k, cos, sin, write=CacheWrite(v, k_cache, v_cache, vnorm, pos, count, write_idx, cur_pos,
                                                       capacity, advance))

As in ``rms_norm`` only the order of the sum of squares differs from HF (and under the interpreter NumPy's rsqrt
from torch's): in fp16/bf16 a normalised value rarely sits one ulp from HF's (the output is then HF's function of
that neighbour); in fp32 the per-head scale may move by an ulp or two, the output by a few ulps. Without the norms
the kernel is the plain rotary, unchanged.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvroll.kernels.decode_launch import sm_count
from kvroll.kernels.pdl_gemm import gdc_launch_dependents, gdc_wait, launch_options
from kvroll.kernels.rmsnorm import rms_norm_torch

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class CacheWrite(NamedTuple):
    """Where a decode step's rotated keys go (``cache_write.cache_write``'s arguments, one layer): ``value`` the
    step's values [rows, Hkv, D] (any strides, D contiguous; a slice of the joined QKV row), the layer's
    ``k_cache`` / ``v_cache`` [rows, Hkv, C, D], ``vnorm`` [rows, Hkv, C] fp32 or None, ``pos`` int32, ``count``
    and ``write_idx`` [rows, Hkv] int64, ``cur_pos`` [rows] int64, ``capacity``, ``advance``; ``q_ring`` (R-KV's and
    SnapKV's observation window, ``policies/window.py``) [rows, W, Hq, D] of the cache's dtype or None: the rotated
    queries are also stored at ring index ``cur_pos % W``, as ``window.ring_write`` stores them."""

    value: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    vnorm: torch.Tensor | None
    pos: torch.Tensor
    count: torch.Tensor
    write_idx: torch.Tensor
    cur_pos: torch.Tensor
    capacity: int
    advance: bool
    q_ring: torch.Tensor | None = None


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``: [-x2, x1] with x1 = x[..., :D//2]."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rotary_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm=None, k_norm=None):
    """HF's ``apply_rotary_pos_emb`` with heads at dim -2 (q [..., Hq, D], k [..., Hkv, D], cos/sin [..., D]),
    after HF's RMSNorm of each head when ``q_norm`` / ``k_norm`` = (weight [D], eps) are given (Qwen3)."""
    if q_norm is not None:
        q, k = rms_norm_torch(q, *q_norm), rms_norm_torch(k, *k_norm)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


if triton is not None:

    @triton.jit
    def _normed(x, scale, w):
        """HF's RMSNorm after the scale: (x_fp32 * scale) rounded to the dtype, times the weight, rounded again."""
        normed = (x.to(tl.float32) * scale).to(x.dtype)
        return (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _rotate_heads(src, src_heads, dst, dst_heads, hmask, cos_ptr, sin_ptr, w_ptr, eps, head_dim,
                      NORM: tl.constexpr, BLOCK: tl.constexpr):
        """Rotate a group of heads [G, BLOCK]: head g at ``src + src_heads[g]``, written to ``dst + dst_heads[g]``
        (heads where ``hmask`` is False are neither read nor written); returns the rotated heads (fp32)."""
        cols = tl.arange(0, BLOCK)
        cmask = cols < head_dim
        mask = hmask[:, None] & cmask[None, :]
        rest = head_dim - head_dim // 2  # rotate_half's first block: the negated upper part
        first = cols < rest
        partner = tl.where(first, cols + head_dim // 2, cols - rest)
        x = tl.load(src + src_heads[:, None] + cols[None, :], mask=mask, other=0.0)
        xp = tl.load(src + src_heads[:, None] + partner[None, :], mask=mask, other=0.0)
        if NORM:  # Qwen3's q_norm / k_norm, as rms_norm computes it; the partner with the head's same scale
            xf = x.to(tl.float32)
            scale = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / head_dim + eps)[:, None]
            x = _normed(x, scale, tl.load(w_ptr + cols, mask=cmask, other=0.0)[None, :])
            xp = _normed(xp, scale, tl.load(w_ptr + partner, mask=cmask, other=0.0)[None, :])
        c = tl.load(cos_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        xp = tl.where(first[None, :], -xp.to(tl.float32), xp.to(tl.float32))
        a = (x.to(tl.float32) * c).to(x.dtype)  # HF rounds q * cos,
        b = (xp * s).to(x.dtype)  # rotate_half(q) * sin,
        out = a.to(tl.float32) + b.to(tl.float32)  # and their sum, each to the dtype
        tl.store(dst + dst_heads[:, None] + cols[None, :], out.to(dst.dtype.element_ty), mask=mask)
        return out

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, q_eps, k_eps, stride_qr,
                       stride_qh, stride_kr, stride_kh, stride_cr, stride_sr, n_q_heads, n_k_heads, head_dim,
                       v_ptr, vc_ptr, vn_ptr, pos_ptr, count_ptr, idx_ptr, cur_pos_ptr, stride_vr, stride_vh,
                       stride_kcs, stride_kch, stride_kcc, stride_vcs, stride_vch, stride_vcc, stride_ns, stride_nh,
                       stride_ps, stride_ph, stride_cs, stride_is, capacity,
                       ring_ptr, stride_rs, stride_rw, stride_rh, ring_size,
                       NORM: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr, VNORM: tl.constexpr,
                       ADVANCE: tl.constexpr, RING: tl.constexpr = False, HEADS: tl.constexpr = 1,
                       PDL: tl.constexpr = False, PDL_LATE: tl.constexpr = False):
        # one program per (row, group of HEADS heads): the query heads' groups first, then the key heads'
        row = tl.program_id(0).to(tl.int64)
        # in the chain of PDL launches (kvroll.kernels.pdl_gemm): wait, then let the next launch (PDL_LATE: only once
        # this program is done, below)
        if PDL:
            gdc_wait()
            if not PDL_LATE:
                gdc_launch_dependents()
        group = tl.program_id(1)
        q_groups = tl.cdiv(n_q_heads, HEADS)
        cos_row, sin_row = cos_ptr + row * stride_cr, sin_ptr + row * stride_sr
        g = tl.arange(0, HEADS)
        if group < q_groups:
            head = group * HEADS + g
            hmask = head < n_q_heads
            out = _rotate_heads(q_ptr + row * stride_qr, head * stride_qh, qo_ptr + row * n_q_heads * head_dim,
                                head * head_dim, hmask, cos_row, sin_row, qw_ptr, q_eps, head_dim, NORM, BLOCK)
            if RING:  # the observation window's slot of this step, cur_pos % W: a second copy
                cols = tl.arange(0, BLOCK)
                ring_row = ring_ptr + row * stride_rs + (tl.load(cur_pos_ptr + row) % ring_size) * stride_rw
                tl.store(ring_row + head[:, None] * stride_rh + cols[None, :], out.to(ring_ptr.dtype.element_ty),
                         mask=hmask[:, None] & (cols < head_dim)[None, :])
        elif CACHE:  # ko_ptr is the layer's K cache: these heads' rows go to their write indices, V and metadata too
            kh = (group - q_groups) * HEADS + g
            hmask = kh < n_k_heads
            idx = tl.load(idx_ptr + row * stride_is + kh, mask=hmask, other=0)
            _rotate_heads(k_ptr + row * stride_kr, kh * stride_kh, ko_ptr + row * stride_kcs,
                          kh * stride_kch + idx * stride_kcc, hmask, cos_row, sin_row, kw_ptr, k_eps, head_dim,
                          NORM, BLOCK)
            cols = tl.arange(0, BLOCK)
            mask = hmask[:, None] & (cols < head_dim)[None, :]
            val = tl.load(v_ptr + row * stride_vr + kh[:, None] * stride_vh + cols[None, :], mask=mask, other=0.0)
            val = val.to(vc_ptr.dtype.element_ty)
            tl.store(vc_ptr + row * stride_vcs + kh[:, None] * stride_vch + idx[:, None] * stride_vcc + cols[None, :],
                     val, mask=mask)
            if VNORM:  # of the values as stored
                tl.store(vn_ptr + row * stride_ns + kh * stride_nh + idx, tl.sum(tl.abs(val.to(tl.float32)), axis=1),
                         mask=hmask)
            cur = tl.load(cur_pos_ptr + row).to(tl.int32)
            tl.store(pos_ptr + row * stride_ps + kh * stride_ph + idx, cur + g * 0, mask=hmask)
            count = tl.minimum(tl.load(count_ptr + row * stride_cs + kh, mask=hmask, other=0) + 1, capacity)
            tl.store(count_ptr + row * stride_cs + kh, count, mask=hmask)
            if ADVANCE:
                tl.store(idx_ptr + row * stride_is + kh, tl.minimum(count, capacity - 1), mask=hmask)
        else:
            kh = (group - q_groups) * HEADS + g
            _rotate_heads(k_ptr + row * stride_kr, kh * stride_kh, ko_ptr + row * n_k_heads * head_dim,
                          kh * head_dim, kh < n_k_heads, cos_row, sin_row, kw_ptr, k_eps, head_dim, NORM, BLOCK)
        if PDL and PDL_LATE:  # the next kernel (the decode kernel) launches once every program has got here
            gdc_launch_dependents()


HEADS_PER_PROGRAM: int | None = None  # None: ``_heads_per_program``'s rule (a benchmark or test may fix it)
ONE_HEAD_PER_SM = 12  # one head a program while there are at most this many programs per SM, ...
GROUPS_PER_SM = 20  # ... else the fewest heads (2, 4, ...) a program that keep the programs within this many per SM


def _heads_per_program(rows: int, n_q: int, n_k: int, block: int, device: torch.device) -> int:
    """Heads per program, from session 20's H200 sweep (``benchmarks/rotary_heads_ab.py``: 1-384 rows, Qwen3's
    16/8 x 128 heads and 32/8 x 128, 16/2 and 14/2 x 64): one head while the programs are few (at most
    ``ONE_HEAD_PER_SM`` per SM: batches up to 66 of Qwen3-1.7B's 24 heads on 132 SMs), else the fewest of 2, 4,
    ... (up to 1,024 elements a program) that keep them within ``GROUPS_PER_SM`` per SM (2 at batches 67-220 of
    Qwen3-1.7B, 4 at 221-440). On an H100: 0.56-0.93x the one-head time at 128-384 rows. Under the interpreter
    (CPU tests) the most heads a program: the fewest programs to run one after another."""
    if HEADS_PER_PROGRAM is not None:
        return HEADS_PER_PROGRAM
    most = min(triton.next_power_of_2(max(n_q, n_k, 1)), max(1, 1024 // block))
    if device.type != "cuda":
        return most
    sms = sm_count(device)
    if rows * (n_q + n_k) <= ONE_HEAD_PER_SM * sms:
        return 1
    heads = 2
    while heads < most and rows * (-(-n_q // heads) - (-n_k // heads)) > GROUPS_PER_SM * sms:
        heads *= 2
    return min(heads, most)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H, D] as [rows, H, D] (a view for a slice of a joined row; a copy only if the leading dims can't merge)."""
    return x.reshape(-1, *x.shape[-2:])


def _check_norm(norm, x: torch.Tensor):
    """``(weight [D], eps)`` of x's dtype and device (HF's output dtype is then x's, which the rotary keeps)."""
    assert isinstance(norm, tuple) and len(norm) == 2, "q_norm / k_norm are (weight, eps)"
    weight, eps = norm
    assert weight.shape == x.shape[-1:] and weight.stride(0) == 1, (weight.shape, x.shape)
    assert weight.dtype == x.dtype and weight.device == x.device, (weight.dtype, x.dtype, weight.device)
    return weight, float(eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm=None, k_norm=None,
           write: CacheWrite | None = None, pdl: bool = False, late_signal: bool = False):
    """Rotary embedding of ``q`` [..., Hq, D] and ``k`` [..., Hkv, D] in one kernel (see the module docstring).

    ``cos`` / ``sin`` [..., D] (HF's rotary module's output for the rows' positions) share q's leading dims and
    dtype. ``q_norm`` / ``k_norm`` (both or neither): ``(weight [D], eps)`` of Qwen3's per-head RMSNorms, run on
    each head before the rotary. Returns new contiguous (q_rot, k_rot) of q's and k's shapes; with ``write``
    (``CacheWrite``: one cache row per row of q) the rotated keys go to the cache instead: (q_rot, None).
    ``pdl``: a programmatic dependent launch (``kvroll.kernels.pdl_gemm``; the caller checks ``pdl_available``).
    ``late_signal`` (with ``pdl``): the next kernel may launch only once every program has written its heads, not
    at once (``pdl_gemm.rotary_signal_late``, where the decode kernel's early start lost). No value changes.
    """
    assert triton is not None, "rotary needs Triton; use rotary_torch on CPU"
    assert q.dtype in DTYPES and k.dtype == cos.dtype == sin.dtype == q.dtype, (q.dtype, k.dtype, cos.dtype)
    head_dim = q.shape[-1]
    assert k.shape[:-2] == q.shape[:-2] and k.shape[-1] == head_dim, (q.shape, k.shape)
    assert cos.shape == sin.shape == (*q.shape[:-2], head_dim), (cos.shape, sin.shape, q.shape)
    assert all(t.stride(-1) == 1 for t in (q, k, cos, sin)), "the head dim must be contiguous"
    assert len({t.device for t in (q, k, cos, sin)}) == 1, (q.device, k.device, cos.device)
    assert (q_norm is None) == (k_norm is None), "pass both q_norm and k_norm, or neither"
    norm = q_norm is not None
    (q_weight, q_eps), (k_weight, k_eps) = (_check_norm(q_norm, q), _check_norm(k_norm, k)) if norm else \
        ((q, 0.0), (k, 0.0))  # without norms the kernel never reads the weight pointers
    q_rows, k_rows = _rows(q), _rows(k)
    cos_rows, sin_rows = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [..., Hq, D]
    n_rows, n_q, n_k = q_rows.shape[0], q_rows.shape[1], k_rows.shape[1]
    k_out = _check_write(write, k_rows) if write is not None else \
        torch.empty(k.shape, dtype=k.dtype, device=k.device)  # [..., Hkv, D]
    assert write is None or write.q_ring is None or write.q_ring.shape[2] == n_q, \
        f"q_ring {tuple(write.q_ring.shape)} holds {write.q_ring.shape[2]} query heads, q has {n_q}"
    if n_rows == 0 or n_q + n_k == 0 or head_dim == 0:
        return q_out, (None if write is not None else k_out)
    w = write or CacheWrite(k_rows, q_rows, q_rows, None, q_rows, q_rows, q_rows, q_rows, 0, False)  # unused
    vn = w.vnorm if w.vnorm is not None else w.pos
    ring = w.q_ring if w.q_ring is not None else q_out
    v_rows = _rows(w.value)
    block = triton.next_power_of_2(head_dim)
    heads = _heads_per_program(n_rows, n_q, n_k, block, q.device)
    _rotary_kernel[(n_rows, triton.cdiv(n_q, heads) + triton.cdiv(n_k, heads))](
        q_rows, k_rows, cos_rows, sin_rows, q_out, k_out, q_weight, k_weight, q_eps, k_eps, q_rows.stride(0),
        q_rows.stride(1), k_rows.stride(0), k_rows.stride(1), cos_rows.stride(0), sin_rows.stride(0), n_q, n_k,
        head_dim, v_rows, w.v_cache, vn, w.pos, w.count, w.write_idx, w.cur_pos, v_rows.stride(0), v_rows.stride(1),
        *k_out.stride()[:3], *w.v_cache.stride()[:3], vn.stride(0), vn.stride(1), w.pos.stride(0), w.pos.stride(1),
        w.count.stride(0), w.write_idx.stride(0), w.capacity,
        ring, ring.stride(0), ring.stride(1), ring.stride(2) if ring.dim() == 4 else 0,
        ring.shape[1] if w.q_ring is not None else 1,
        NORM=norm, RING=w.q_ring is not None, BLOCK=block, CACHE=write is not None, HEADS=heads,
        VNORM=write is not None and write.vnorm is not None, ADVANCE=write is not None and bool(write.advance),
        PDL=pdl, PDL_LATE=pdl and late_signal, num_warps=max(1 if block <= 128 else 2, min(4, heads * block // 256)),
        enable_fp_fusion=False,
        **launch_options(pdl))
    return q_out, (None if write is not None else k_out)


def _check_write(write: CacheWrite, k_rows: torch.Tensor) -> torch.Tensor:
    """The layout ``cache_write`` asserts, for the rows of k; returns the K cache (the kernel's key destination)."""
    rows, heads, head_dim = k_rows.shape
    kc, vc = write.k_cache, write.v_cache
    assert kc.shape == vc.shape == (rows, heads, write.capacity, head_dim), (kc.shape, vc.shape, k_rows.shape)
    assert write.value.shape[-2:] == (heads, head_dim) and _rows(write.value).shape[0] == rows, write.value.shape
    assert kc.dtype == vc.dtype == k_rows.dtype, \
        f"the K/V cache's dtype {kc.dtype} / {vc.dtype} is not k's {k_rows.dtype}: the fused write stores the " \
        "rotated key as HF rounds it in k's dtype; make the cache in the model's dtype or call rotary, then cache_write"
    assert kc.stride(-1) == vc.stride(-1) == write.value.stride(-1) == 1
    assert write.pos.shape == kc.shape[:3] and write.pos.dtype == torch.int32 and write.pos.stride(-1) == 1
    assert write.count.shape == write.write_idx.shape == (rows, heads) and write.cur_pos.shape == (rows,)
    assert write.count.dtype == write.write_idx.dtype == write.cur_pos.dtype == torch.int64
    assert write.count.stride(-1) == write.write_idx.stride(-1) == write.cur_pos.stride(-1) == 1
    if write.vnorm is not None:
        assert write.vnorm.shape == write.pos.shape and write.vnorm.dtype == torch.float32
        assert write.vnorm.stride(-1) == 1
    if write.q_ring is not None:
        ring = write.q_ring
        assert ring.dim() == 4 and ring.shape[0] == rows and ring.shape[3] == head_dim and ring.stride(-1) == 1, \
            f"q_ring {tuple(ring.shape)}: [rows={rows}, W, Hq, D={head_dim}] with D contiguous"
        assert ring.dtype == kc.dtype and ring.shape[1] >= 1, (ring.dtype, kc.dtype)
    return kc
