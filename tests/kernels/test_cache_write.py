"""The fused decode-step cache write against its torch reference (the scatters ``CompressedKVCache.update`` used).

CPU (CI): the Triton kernel under ``TRITON_INTERPRET=1``. It only moves data, so K, V, positions and counts must be
bitwise equal; ||v||_1 is an fp32 sum in another order (1e-6 relative). GPU (``gpu``): the same in bf16.
"""

import pytest
import torch

from kvroll.kernels import cache_write as cw
from tests.conftest import needs_interpreter



def make_layer(slots, heads, capacity, head_dim, seed, dtype=torch.float32, device="cpu", extra_slots=2):
    """One layer's buffers as a slot view (the first ``slots`` of a larger cache) and a step's K/V as HF hands
    them over ([S, 1, H, D] transposed to [S, H, 1, D]: not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    total = slots + extra_slots
    k = torch.randn(total, heads, capacity, head_dim, generator=g)
    v = torch.randn(total, heads, capacity, head_dim, generator=g)
    vnorm = torch.rand(total, heads, capacity, generator=g)
    pos = torch.randint(-1, 4 * capacity, (total, heads, capacity), generator=g, dtype=torch.int32)
    count = torch.randint(capacity - 2, capacity + 1, (total, heads), generator=g)  # some at capacity: clamp
    write_idx = torch.randint(0, capacity, (total, heads), generator=g)
    cur_pos = torch.randint(capacity, 8 * capacity, (total,), generator=g)
    key = torch.randn(slots, 1, heads, head_dim, generator=g).transpose(1, 2)
    value = torch.randn(slots, 1, heads, head_dim, generator=g).transpose(1, 2)
    bufs = [t.to(device) for t in (k, v, vnorm, pos, count, write_idx, cur_pos)]
    bufs[0], bufs[1] = bufs[0].to(dtype), bufs[1].to(dtype)
    return bufs, key.to(device=device, dtype=dtype), value.to(device=device, dtype=dtype)


def run_both(slots, heads, capacity, head_dim, seed, with_norm, dtype=torch.float32, device="cpu", advance=False):
    bufs, key, value = make_layer(slots, heads, capacity, head_dim, seed, dtype, device)
    ref = [t.clone() for t in bufs]
    got = [t.clone() for t in bufs]
    for fn, b in ((cw.cache_write_torch, ref), (cw.cache_write, got)):
        k, v, vnorm, pos, count, write_idx, cur_pos = b
        view = lambda t: t[:slots]  # noqa: E731 - the slot view the decode step writes through
        fn(view(k), view(v), view(vnorm) if with_norm else None, view(pos), view(count), view(write_idx),
           view(cur_pos), key, value, capacity, advance=advance)
    return ref, got


@needs_interpreter
@pytest.mark.parametrize("slots,heads,capacity,head_dim", [
    (1, 1, 37, 16), (3, 3, 37, 64), (3, 8, 50, 128), (2, 2, 1, 32),
])
@pytest.mark.parametrize("with_norm, advance", [(True, False), (False, False), (False, True)])
def test_kernel_matches_reference(slots, heads, capacity, head_dim, with_norm, advance):
    ref, got = run_both(slots, heads, capacity, head_dim, seed=slots * 7 + heads, with_norm=with_norm,
                        advance=advance)
    names = ("k", "v", "vnorm", "pos", "count", "write_idx", "cur_pos")
    for name, r, g in zip(names, ref, got):
        if name == "vnorm" and with_norm:
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(g, r), name
    # the slots past the view are untouched, and the write really happened
    before, _, _ = make_layer(slots, heads, capacity, head_dim, seed=slots * 7 + heads)
    for b, g in zip(before, got):
        assert torch.equal(b[slots:], g[slots:])
    assert not torch.equal(before[0][:slots], got[0][:slots])
    count, write_idx = got[4][:slots], got[5][:slots]
    if advance:  # an appending cache's next write: the new count, the last slot once full
        assert torch.equal(write_idx, count.clamp(max=capacity - 1)) and (count == capacity).any()
    else:
        assert torch.equal(write_idx, before[5][:slots])


@needs_interpreter
def test_fp16_values_are_stored_exactly():
    ref, got = run_both(3, 4, 29, 64, seed=3, with_norm=True, dtype=torch.float16)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and torch.equal(got[3], ref[3])
    torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-6)


@needs_interpreter
def test_contract_is_checked():
    bufs, key, value = make_layer(2, 2, 9, 16, seed=0)
    k, v, vnorm, pos, count, write_idx, cur_pos = bufs
    with pytest.raises(AssertionError):
        cw.cache_write(k[:2], v[:2], None, pos[:2].long(), count[:2], write_idx[:2], cur_pos[:2], key, value, 9)
    with pytest.raises(AssertionError):
        cw.cache_write(k[:2], v[:2], None, pos[:2], count[:2], write_idx[:2], cur_pos[:2], key, value, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_norm", [True, False])
def test_bf16_on_gpu(with_norm):
    ref, got = run_both(64, 8, 1152, 128, seed=11, with_norm=with_norm, dtype=torch.bfloat16, device="cuda")
    for i, (r, g) in enumerate(zip(ref, got)):
        if i == 2 and with_norm:
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-5)
        else:
            assert torch.equal(g, r), i


@needs_interpreter
def test_cache_update_kernel_path_equals_torch_path():
    """``CompressedKVCache.update`` through the kernel writes what its torch path writes, in a slot view."""
    from kvroll import CompressionConfig
    from kvroll.rollout.cache import CompressedKVCache

    policy = CompressionConfig("longflow", budget=24).build()
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(3, 1, 2, 16, generator=gen), torch.randn(3, 1, 2, 16, generator=gen)
    caches = []
    for kernel in (False, True):
        cache = CompressedKVCache(2, 4, 2, 24, 16, torch.float32, "cpu", policy, 24, 0.25)
        cache.kernel_on_cpu = kernel
        cache.count.copy_(torch.tensor([[3, 24], [24, 0], [7, 7], [1, 2]]).expand(2, -1, -1))
        cache.write_idx.copy_(torch.tensor([[3, 9], [17, 0], [7, 7], [1, 2]]).expand(2, -1, -1))
        cache.cur_pos.copy_(torch.tensor([30, 40, 50, 60]))
        view = cache.slot_view(3)
        view.update(key.transpose(1, 2), value.transpose(1, 2), 1)
        caches.append(cache)
    a, b = caches
    for name in ("k", "v", "pos", "count"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    torch.testing.assert_close(a.vnorm, b.vnorm, rtol=1e-6, atol=1e-6)
    assert int(a.pos[1, 0, 0, 3]) == 30 and int(a.count[1, 1, 0]) == 24 and int(a.count[1, 3, 0]) == 1


def test_a_strided_cur_pos_is_refused():
    """The kernel reads row r's position at ``cur_pos + r``: a column of a wider tensor (stride 2) was read as
    [10, 99, 11] and written to the wrong ring slots; the launcher now refuses it, as decode_attention's does."""
    bufs, key, value = make_layer(3, 2, 4, 16, seed=0, extra_slots=0)
    k, v, vnorm, pos, count, write_idx, _ = bufs
    cur_pos = torch.tensor([[10, 99], [11, 98], [12, 97]])[:, 0]
    with pytest.raises(AssertionError):
        cw.cache_write(k, v, vnorm, pos, count, write_idx, cur_pos, key, value, 4)
