"""A decode step's cache write in one Triton kernel: each (slot, KV head) stores the step's K/V row at its write
index, with the row's ||v||_1, its true position, and the live count.

The torch reference (the CPU path, and the oracle of the tests) is what ``CompressedKVCache.update`` did as ~11
small kernels per layer (scatters of K, V, ||v||_1 and positions, the norm's cast / abs / sum, the count's add and
clamp); at 28 layers a step that is ~0.5 ms of launches at any batch:

    cache_write_torch(k, v, vnorm, pos, count, write_idx, cur_pos, key, value, capacity)

k, v: one layer's [S, Hkv, C, D] buffers; vnorm [S, Hkv, C] fp32 or None; pos [S, Hkv, C] int32; count and
write_idx [S, Hkv] int64; cur_pos [S] int64; key, value [S, Hkv, 1, D] (any strides, the head dim contiguous).
After the call, for every (s, h) with i = write_idx[s, h]: k[s, h, i] = key[s, h, 0] (cast to the cache dtype),
v likewise, vnorm[s, h, i] = sum |v[s, h, i]| in fp32 of the stored values, pos[s, h, i] = cur_pos[s],
count[s, h] = min(count[s, h] + 1, capacity), and with ``advance=True`` (a cache that appends: ``full``, the
periodic policies) write_idx[s, h] = min(count[s, h], capacity - 1), the next step's write index (a step policy
sets it after attention from its argmin). ``cache_write`` (same call) runs it as one kernel, one program per slot
for all its heads; the norm's sum order differs from torch's (fp32 rounding only).
"""
from __future__ import annotations

import torch

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def value_norm(v: torch.Tensor) -> torch.Tensor:
    """||v||_1 over the head dim in fp32, of the values as stored (the cache dtype): [..., D] -> [...]."""
    return v.float().abs().sum(dim=-1)


def cache_write_torch(k, v, vnorm, pos, count, write_idx, cur_pos, key, value, capacity: int,
                      advance: bool = False) -> None:
    """Reference of ``cache_write`` (see the module docstring); updates the buffers in place."""
    head_dim = k.shape[-1]
    idx = write_idx[:, :, None, None].expand(-1, -1, 1, head_dim)
    k.scatter_(2, idx, key.to(k.dtype))
    value = value.to(v.dtype)
    v.scatter_(2, idx, value)
    if vnorm is not None:
        vnorm.scatter_(2, write_idx[:, :, None], value_norm(value))
    new_pos = cur_pos.to(torch.int32)[:, None, None].expand(-1, pos.shape[1], 1)
    pos.scatter_(2, write_idx[:, :, None], new_pos)
    count.copy_((count + 1).clamp_(max=capacity))
    if advance:
        write_idx.copy_(count.clamp(max=capacity - 1))


if triton is not None:

    @triton.jit
    def _cache_write_kernel(
        k_ptr, v_ptr, vn_ptr, pos_ptr, count_ptr, idx_ptr, cur_pos_ptr, key_ptr, value_ptr,
        stride_ks, stride_kh, stride_kc, stride_vs, stride_vh, stride_vc, stride_ns, stride_nh,
        stride_ps, stride_ph, stride_cs, stride_is, stride_keys, stride_keyh, stride_vals, stride_valh,
        num_heads, capacity,
        HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, VNORM: tl.constexpr, ADVANCE: tl.constexpr,
    ):
        s = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        h_mask = offs_h < num_heads
        row_mask = h_mask[:, None]
        idx = tl.load(idx_ptr + s * stride_is + offs_h, mask=h_mask, other=0).to(tl.int64)  # [H]
        key = tl.load(key_ptr + s * stride_keys + offs_h[:, None] * stride_keyh + offs_d[None, :], mask=row_mask)
        val = tl.load(value_ptr + s * stride_vals + offs_h[:, None] * stride_valh + offs_d[None, :], mask=row_mask)
        key = key.to(k_ptr.dtype.element_ty)
        val = val.to(v_ptr.dtype.element_ty)
        tl.store(k_ptr + s * stride_ks + offs_h[:, None] * stride_kh + idx[:, None] * stride_kc + offs_d[None, :],
                 key, mask=row_mask)
        tl.store(v_ptr + s * stride_vs + offs_h[:, None] * stride_vh + idx[:, None] * stride_vc + offs_d[None, :],
                 val, mask=row_mask)
        if VNORM:
            norm = tl.sum(tl.abs(val.to(tl.float32)), axis=1)  # of the values as stored
            tl.store(vn_ptr + s * stride_ns + offs_h * stride_nh + idx, norm, mask=h_mask)
        cur = tl.load(cur_pos_ptr + s).to(tl.int32)
        tl.store(pos_ptr + s * stride_ps + offs_h * stride_ph + idx, tl.zeros([HEADS_PAD], tl.int32) + cur,
                 mask=h_mask)
        count = tl.load(count_ptr + s * stride_cs + offs_h, mask=h_mask, other=0)
        count = tl.minimum(count + 1, capacity)
        tl.store(count_ptr + s * stride_cs + offs_h, count, mask=h_mask)
        if ADVANCE:
            tl.store(idx_ptr + s * stride_is + offs_h, tl.minimum(count, capacity - 1), mask=h_mask)


def cache_write(k, v, vnorm, pos, count, write_idx, cur_pos, key, value, capacity: int, advance: bool = False) -> None:
    """One kernel for ``cache_write_torch`` (see the module docstring). Asserts the layout contract."""
    assert triton is not None, "cache_write needs Triton; use cache_write_torch on CPU"
    slots, num_heads, cap, head_dim = k.shape
    assert cap == capacity and v.shape == k.shape and pos.shape == k.shape[:3], (k.shape, v.shape, pos.shape)
    assert key.shape == (slots, num_heads, 1, head_dim) and value.shape == key.shape, (key.shape, value.shape)
    assert head_dim == triton.next_power_of_2(head_dim), f"head_dim {head_dim} is not a power of two"
    assert all(t.stride(-1) == 1 for t in (k, v, key, value)) and pos.stride(-1) == 1, "the last dim is contiguous"
    assert count.shape == write_idx.shape == (slots, num_heads) and cur_pos.shape == (slots,)
    assert cur_pos.dtype == torch.int64 and cur_pos.is_contiguous(), (cur_pos.dtype, cur_pos.stride())
    assert count.stride(-1) == 1 and write_idx.stride(-1) == 1
    assert pos.dtype == torch.int32 and count.dtype == write_idx.dtype == torch.int64, (pos.dtype, count.dtype)
    if vnorm is not None:
        assert vnorm.shape == pos.shape and vnorm.dtype == torch.float32 and vnorm.stride(-1) == 1
    if slots == 0:
        return
    vn = vnorm if vnorm is not None else pos  # unused pointer when there is no norm
    _cache_write_kernel[(slots,)](
        k, v, vn, pos, count, write_idx, cur_pos, key, value,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), vn.stride(0), vn.stride(1),
        pos.stride(0), pos.stride(1), count.stride(0), write_idx.stride(0), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), num_heads, capacity,
        HEADS_PAD=triton.next_power_of_2(num_heads), HEAD_DIM=head_dim, VNORM=vnorm is not None,
        ADVANCE=bool(advance), num_warps=4,
    )
