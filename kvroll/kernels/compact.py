"""Compaction of the static cache: move each (slot, KV head)'s kept tokens to the front of its rows, in place.

One call handles one layer's buffers: k, v [S, Hkv, C, D] (any dtype), pos [S, Hkv, C] int32 and, optionally,
vnorm [S, Hkv, C] fp32. For the compacted slots ``slots`` [n] with keep_idx [n, Hkv, K] and keep_count [n, Hkv]:

    buf[slots[i], h, j] = buf[slots[i], h, keep_idx[i, h, j]]   for j < keep_count[i, h], every buffer
    pos[slots[i], h, j] = -1                                     for j >= keep_count[i, h] (dead rows)

Other slots are untouched. K/V/vnorm rows at or past keep_count are dead (pos = -1; the cache's attention never
reads them): the torch reference gathers keep_idx's tail entries there, the kernel leaves them as they were.

    gather_to_front_torch(k, v, pos, vnorm, slots, keep_idx, keep_count)   # any order; the CPU path, the oracle
    keep_idx = ascending_keep(keep_idx, keep_count, capacity)              # the kernel's precondition
    gather_to_front(k, v, pos, vnorm, slots, keep_idx, keep_count)         # Triton, no temporary

How the kernel runs in place: one program per (slot, KV head) walks j in blocks of BLOCK_J, in ascending order,
loading keep_idx[j0:j0+B], gathering those rows of K, V, pos and vnorm, then storing them at rows j0..j0+B-1.
With keep_idx strictly ascending below keep_count (what ``ascending_keep`` makes of any keep set of distinct
slots), keep_idx[j] >= j: a block's sources are at or after its own first row and after every row an earlier
block wrote, and later blocks read only rows past this block's. So the only overlap is inside a block (a source
that is also a destination of the same block); a barrier between the block's loads and its stores orders
them across the program's warps. Rows already in place (keep_idx[j] == j: sinks, an untouched prefix) are
skipped, since no other row reads or writes them.
"""
from __future__ import annotations

import torch

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def _gather_rows(buf: torch.Tensor, slots: torch.Tensor, keep_idx: torch.Tensor) -> None:
    """In place: buf[slots[i], h, j] = buf[slots[i], h, keep_idx[i, h, j]] for every j < K, through a temporary
    (so any order and sources that are also destinations are fine). buf [S, Hkv, C, ...]."""
    num_slots, num_heads, capacity = buf.shape[:3]
    flat = buf.view(num_slots * num_heads * capacity, -1)  # a view: the cache's layer buffers are contiguous
    heads = torch.arange(num_heads, device=buf.device)
    base = ((slots[:, None] * num_heads + heads) * capacity)[..., None]  # [n, Hkv, 1]
    src = (base + keep_idx.long()).flatten()
    dst = (base + torch.arange(keep_idx.shape[-1], device=buf.device)).flatten()
    flat.index_copy_(0, dst, flat.index_select(0, src))


def gather_to_front_torch(k, v, pos, vnorm, slots, keep_idx, keep_count) -> None:
    """Reference of the compaction (module docstring), in place: every keep_idx entry is gathered (the tail past
    keep_count into the dead rows too), then pos is set to -1 at and past keep_count. keep_idx in any order."""
    slots = slots.to(k.device)
    for buf in (k, v, pos, vnorm):
        if buf is not None:
            _gather_rows(buf, slots, keep_idx)
    dead = torch.arange(pos.shape[-1], device=pos.device) >= keep_count.to(pos.device)[..., None]  # [n, Hkv, C]
    pos[slots] = pos[slots].masked_fill(dead, -1)


def ascending_keep(keep_idx: torch.Tensor, keep_count: torch.Tensor, capacity: int) -> torch.Tensor:
    """keep_idx [n, Hkv, K] sorted per (slot, head), int32, entries at or past keep_count replaced by
    ``capacity`` first so they sort last: the same keep sets, in the order ``gather_to_front`` needs."""
    dead = torch.arange(keep_idx.shape[-1], device=keep_idx.device) >= keep_count.to(keep_idx.device)[..., None]
    return keep_idx.to(torch.int32).masked_fill(dead, capacity).sort(dim=-1).values


if triton is not None:

    @triton.jit
    def _gather_to_front_kernel(
        k_ptr, v_ptr, pos_ptr, vn_ptr, slots_ptr, idx_ptr, count_ptr, stride_ks, stride_kh, stride_kc,
        stride_ps, stride_ph, num_kv_heads, capacity, kept,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_J: tl.constexpr, VNORM: tl.constexpr,
    ):
        i, h = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        count = tl.minimum(tl.load(count_ptr + i * num_kv_heads + h).to(tl.int32), kept)
        kv_base = slot * stride_ks + h * stride_kh
        p_base = slot * stride_ps + h * stride_ph
        idx_row = idx_ptr + (i * num_kv_heads + h).to(tl.int64) * kept
        offs_j = tl.arange(0, BLOCK_J)
        offs_d = tl.arange(0, DIM_PAD)
        d_mask = offs_d < HEAD_DIM
        for j0 in range(0, count, BLOCK_J):
            rows = j0 + offs_j
            src = tl.load(idx_row + rows, mask=rows < count, other=0)
            move = (rows < count) & (src != rows)  # rows already in place are neither read nor written
            m2 = move[:, None] & d_mask[None, :]
            src_kv = kv_base + src.to(tl.int64)[:, None] * stride_kc + offs_d[None, :]
            k = tl.load(k_ptr + src_kv, mask=m2)
            v = tl.load(v_ptr + src_kv, mask=m2)
            p = tl.load(pos_ptr + p_base + src, mask=move)
            if VNORM:
                n = tl.load(vn_ptr + p_base + src, mask=move)
            tl.debug_barrier()  # every warp's loads of this block precede any store: sources may be its rows
            dst_kv = kv_base + rows.to(tl.int64)[:, None] * stride_kc + offs_d[None, :]
            tl.store(k_ptr + dst_kv, k, mask=m2)
            tl.store(v_ptr + dst_kv, v, mask=m2)
            tl.store(pos_ptr + p_base + rows, p, mask=move)
            if VNORM:
                tl.store(vn_ptr + p_base + rows, n, mask=move)
        dead = tl.full([BLOCK_J], -1, tl.int32)
        # sources may lie in [count, C); every load above precedes the last block's barrier, hence these stores
        for j0 in range(count, capacity, BLOCK_J):
            rows = j0 + offs_j
            tl.store(pos_ptr + p_base + rows, dead, mask=rows < capacity)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gather_to_front(k, v, pos, vnorm, slots, keep_idx, keep_count, block_j=None, num_warps=4) -> None:
    """The compaction (module docstring) in one Triton launch, in place, grid [n, Hkv].

    keep_idx [n, Hkv, K] int32 must be strictly ascending per (slot, head) below keep_count (``ascending_keep``
    makes it so), or in ``hole_fill_slots``'s order (each entry j below keep_count j itself or a slot at or past
    keep_count, which no entry writes: as safe in place) (unchecked: checking would synchronise); keep_count
    [n, Hkv] integer; slots [n] int64.
    ``block_j``: rows per block (default: 16 KB of each of K and V).
    """
    assert triton is not None, "gather_to_front needs Triton; use gather_to_front_torch on CPU"
    num_slots, num_kv_heads, capacity, head_dim = k.shape
    n, kept = slots.shape[0], keep_idx.shape[-1]
    assert v.shape == k.shape and v.dtype == k.dtype and v.stride() == k.stride(), "k and v: same layout"
    assert k.stride(-1) == 1, "the head dim must be contiguous"
    assert pos.shape == (num_slots, num_kv_heads, capacity) and pos.dtype == torch.int32, (pos.shape, pos.dtype)
    assert pos.stride(-1) == 1, pos.stride()
    if vnorm is not None:
        assert vnorm.shape == pos.shape and vnorm.stride() == pos.stride(), (vnorm.shape, vnorm.stride())
    assert keep_idx.shape == (n, num_kv_heads, kept) and kept <= capacity, (keep_idx.shape, slots.shape)
    assert keep_idx.dtype == torch.int32 and keep_idx.is_contiguous(), "keep_idx: contiguous int32"
    assert keep_count.shape == (n, num_kv_heads) and keep_count.is_contiguous(), keep_count.shape
    assert slots.dtype == torch.int64 and slots.is_contiguous(), slots.dtype
    assert all(t.device == k.device for t in (v, pos, slots, keep_idx, keep_count)), "one device"
    if n == 0:
        return
    dim_pad = _pow2(head_dim)
    block_j = block_j or max(16, min(128, 16384 // (dim_pad * k.element_size())))
    _gather_to_front_kernel[(n, num_kv_heads)](
        k, v, pos, vnorm if vnorm is not None else pos, slots, keep_idx, keep_count,
        k.stride(0), k.stride(1), k.stride(2), pos.stride(0), pos.stride(1), num_kv_heads, capacity, kept,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_J=block_j, VNORM=vnorm is not None, num_warps=num_warps,
    )
