"""R-KV redundancy (Eqs. 5-6 of papers/r-kv.txt) without the [n, Hkv, C, C] similarity matrix.

The reference (``kvroll.policies.rkv.rkv_redundancy``) builds S = cosine similarity of the normalised keys
(eps 1e-8) of every live pair, diagonal zeroed, zeroes for each row u its similarity to its ``beta`` most
recent tokens v with S[u, v] > T, takes the column mean and a softmax over the live tokens. At n = 224 rows,
8 heads and C = 1152 that is ~20 GB of fp32 sims, int64 ranks and masks per layer. Two bounded versions:

* ``rkv_redundancy_blocked`` (torch, any ``beta``, the CPU path): the reference over blocks of rows u, each
  block's column sums accumulated; memory ~ ``block_elems`` similarities at a time.
* ``rkv_redundancy_triton`` (CUDA, ``beta`` in {0, 1}): S is symmetric, so column v's sum over u equals row
  v's sum; with beta = 1 each row u exempts one entry, (u, ex(u)), the live v != u of largest position with
  S[u, v] > T. Hence col[v] = rowsum[v] - sum_{u: ex(u) = v} S[u, v]. One program per (row * head, block of
  u rows) loops over tiles of v with ``tl.dot`` on the raw keys (scaled by the inverse norms afterwards) and
  writes rowsum[u], ex(u) (-1: none) and S[u, ex(u)]; torch then subtracts the exemptions (a scatter in fp64:
  the exempted values lie in (T, 1], so their sums are exact and the result does not depend on the order of
  the scatter's atomics) and takes the mean and the softmax.

Exactly like the reference, a candidate for the exemption is any v with pos[v] >= 0 whose *masked* S[u, v]
(0 on the diagonal and for non-live pairs) exceeds T, so with T < 0 the diagonal can take the exemption (it
removes 0). Positions of live tokens are unique per (row, head), as in the cache; ties would be broken
differently from ``topk``.

Precision: bf16/fp16 keys are multiplied on the tensor cores with fp32 accumulation; their products are exact
in fp32, so the sims differ from the fp32 reference by summation order only (~1e-7 relative), as do the
outputs. fp32 keys use ``dot_precision`` ("ieee" by default; the interpreter tests run fp32 "ieee").

    red = rkv_redundancy_triton(k, pos >= 0, pos, threshold=0.5, beta=1)   # [n, Hkv, C] fp32, on CUDA
    red = rkv_redundancy_blocked(k, pos >= 0, pos, threshold=0.5, beta=1)  # the same on CPU
"""
from __future__ import annotations

import torch

try:  # Triton is optional on CPU-only installs; the blocked torch version is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_EPS = 1e-8


def redundancy_softmax(col: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Eq. 6 from the column sums col [n, Hkv, C]: mean over the live rows, softmax over the live tokens."""
    mean = col / live.sum(dim=-1, keepdim=True).clamp_min(1)
    return mean.masked_fill(~live, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


def rkv_redundancy_blocked(k: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, threshold: float, beta: int,
                           block_elems: int = 1 << 24) -> torch.Tensor:
    """The reference over blocks of rows u: k [n, Hkv, C, D]; live, pos [n, Hkv, C]. Returns [n, Hkv, C] fp32.

    Each block holds about ``block_elems`` similarities (fp32, plus an int64 rank when ``beta > 0``).
    """
    n, heads, capacity, _ = k.shape
    kf = k.float()
    normed = kf / (kf.norm(dim=-1, keepdim=True) + _EPS)  # [n, Hkv, C, D]
    rows = max(1, min(capacity, block_elems // max(1, n * heads * capacity)))
    col = torch.zeros(n, heads, capacity, dtype=torch.float32, device=k.device)
    pos_v = pos.long()[..., None, :]  # [n, Hkv, 1, C]
    columns = torch.arange(capacity, device=k.device)
    for u0 in range(0, capacity, rows):
        u1 = min(capacity, u0 + rows)
        sim = normed[:, :, u0:u1] @ normed.transpose(-1, -2)  # [n, Hkv, B, C]: rows u0..u1, every column v
        pair = live[..., u0:u1, None] & live[..., None, :]
        diag = columns[u0:u1, None] == columns[None, :]
        sim = sim.masked_fill(~pair | diag, 0.0)
        if beta > 0:
            rank = torch.where(sim > threshold, pos_v, -1)  # position of each similar v
            top = rank.topk(min(beta, capacity), dim=-1)
            exempt = torch.zeros_like(pair).scatter_(-1, top.indices, top.values >= 0)
            sim = sim.masked_fill(exempt, 0.0)
        col += sim.sum(dim=-2)
    return redundancy_softmax(col, live)


if triton is not None:

    @triton.jit
    def _rkv_rows_kernel(
        k_ptr, inv_ptr, live_ptr, pos_ptr, rowsum_ptr, ex_idx_ptr, ex_val_ptr,
        stride_kr, stride_kc, capacity, threshold,
        HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        r, ub = tl.program_id(0), tl.program_id(1)  # r = row * Hkv + head; ub = block of u rows
        offs_u = ub * BLOCK_U + tl.arange(0, BLOCK_U)
        offs_d = tl.arange(0, HEAD_DIM)
        u_mask = offs_u < capacity
        k_base = k_ptr + r.to(tl.int64) * stride_kr  # int64: large batches pass 2^31 elements
        meta = r * capacity  # inv, live, pos and the outputs are contiguous [rows * Hkv, C]
        k_u = tl.load(k_base + offs_u[:, None] * stride_kc + offs_d[None, :], mask=u_mask[:, None], other=0.0)
        inv_u = tl.load(inv_ptr + meta + offs_u, mask=u_mask, other=0.0)
        live_u = tl.load(live_ptr + meta + offs_u, mask=u_mask, other=0) != 0
        rowsum = tl.zeros([BLOCK_U], tl.float32)
        best_pos = tl.full([BLOCK_U], -1, tl.int32)
        best_idx = tl.full([BLOCK_U], -1, tl.int32)
        best_val = tl.zeros([BLOCK_U], tl.float32)
        for v0 in range(0, capacity, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            v_mask = offs_v < capacity
            k_v = tl.load(k_base + offs_v[:, None] * stride_kc + offs_d[None, :], mask=v_mask[:, None], other=0.0)
            inv_v = tl.load(inv_ptr + meta + offs_v, mask=v_mask, other=0.0)
            live_v = tl.load(live_ptr + meta + offs_v, mask=v_mask, other=0) != 0
            pos_v = tl.load(pos_ptr + meta + offs_v, mask=v_mask, other=-1)
            sim = tl.dot(k_u, tl.trans(k_v), input_precision=DOT_PREC) * inv_u[:, None] * inv_v[None, :]
            pair = live_u[:, None] & live_v[None, :] & (offs_u[:, None] != offs_v[None, :])
            sim = tl.where(pair, sim, 0.0)  # [BLOCK_U, BLOCK_V], masked as in the reference
            rowsum += tl.sum(sim, 1)
            if EXEMPT:  # the candidate of largest position in this tile, kept if newer than the best so far
                cand = (sim > threshold) & (pos_v >= 0)[None, :]
                key = tl.where(cand, pos_v[None, :], -1)
                tile_pos = tl.max(key, 1)
                hit = cand & (key == tile_pos[:, None])
                tile_idx = tl.max(tl.where(hit, offs_v[None, :], -1), 1)
                tile_val = tl.sum(tl.where(offs_v[None, :] == tile_idx[:, None], sim, 0.0), 1)
                newer = tile_pos > best_pos
                best_pos = tl.where(newer, tile_pos, best_pos)
                best_idx = tl.where(newer, tile_idx, best_idx)
                best_val = tl.where(newer, tile_val, best_val)
        tl.store(rowsum_ptr + meta + offs_u, rowsum, mask=u_mask)
        if EXEMPT:
            tl.store(ex_idx_ptr + meta + offs_u, best_idx, mask=u_mask)
            tl.store(ex_val_ptr + meta + offs_u, best_val, mask=u_mask)


def rkv_redundancy_triton(k: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, threshold: float, beta: int,
                          block_u: int = 64, block_v: int = 64, dot_precision: str = "ieee", num_warps: int = 4,
                          num_stages: int = 2) -> torch.Tensor:
    """The reference's contract (see the module docstring) for ``beta`` in {0, 1}; [n, Hkv, C] fp32.

    k [n, Hkv, C, D] bf16/fp16/fp32 with a contiguous head dim; live bool and pos int32 [n, Hkv, C].
    ``dot_precision`` applies to fp32 keys only ("ieee" or "tf32").
    """
    assert triton is not None, "rkv_redundancy_triton needs Triton; use rkv_redundancy_blocked on CPU"
    assert beta in (0, 1), f"the kernel exempts at most one token per row (beta={beta}); use the blocked version"
    n, heads, capacity, head_dim = k.shape
    assert live.shape == pos.shape == (n, heads, capacity), (live.shape, pos.shape, k.shape)
    assert live.dtype == torch.bool and pos.dtype == torch.int32, (live.dtype, pos.dtype)
    assert k.dtype in (torch.bfloat16, torch.float16, torch.float32), k.dtype
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim} must be a power of two in [16, 256]"
    assert dot_precision in ("ieee", "tf32"), dot_precision
    rows = k.reshape(n * heads, capacity, head_dim)
    assert rows.stride(-1) == 1, "the head dim must be contiguous"
    inv = 1.0 / (torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32) + _EPS)  # [n * Hkv, C]
    live8 = live.reshape(n * heads, capacity).to(torch.int8)
    pos32 = pos.reshape(n * heads, capacity).contiguous()
    rowsum = torch.empty(n * heads, capacity, dtype=torch.float32, device=k.device)
    ex_idx = torch.full((n * heads, capacity), -1, dtype=torch.int32, device=k.device)
    ex_val = torch.zeros(n * heads, capacity, dtype=torch.float32, device=k.device)
    grid = (n * heads, triton.cdiv(capacity, block_u))
    _rkv_rows_kernel[grid](
        rows, inv, live8, pos32, rowsum, ex_idx, ex_val, rows.stride(0), rows.stride(1), capacity, float(threshold),
        HEAD_DIM=head_dim, BLOCK_U=block_u, BLOCK_V=block_v, EXEMPT=beta == 1,
        DOT_PREC=dot_precision if k.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )
    col = rowsum
    if beta == 1:  # col[v] = rowsum[v] - sum of the exempted S[u, v] (ex_val = 0 where ex_idx = -1)
        exempt = torch.zeros_like(rowsum, dtype=torch.float64)
        exempt.scatter_add_(-1, ex_idx.clamp_min(0).long(), ex_val.double())
        col = (rowsum.double() - exempt).float()
    return redundancy_softmax(col.view(n, heads, capacity), live)
