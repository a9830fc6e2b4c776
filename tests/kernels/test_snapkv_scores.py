"""The SnapKV window-score kernel (``kvroll/kernels/snapkv_scores.py``) against the torch path it replaces on CUDA
(``snapkv_window_scores``'s fp32 logits, mask, softmax and sums), interpreted on CPU: GQA groups 1-8, windows
4-32, head_dim 16-64, odd capacities, dead slots, keys newer than some window queries, a row whose window sees no
key, strided (ring-read) queries; and a SnapKV compression through the kernel keeps what the torch path keeps."""

import pytest
import torch

from kvroll.kernels import snapkv_scores as sk
from kvroll.policies.snapkv import snapkv_window_scores
from tests.conftest import needs_interpreter


def inputs(n, kv_heads, group, window, dim, capacity, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, window, kv_heads * group, dim, generator=gen).transpose(1, 2)  # the ring's layout
    k = torch.randn(n, kv_heads, capacity, dim, generator=gen)
    cur = torch.randint(capacity + window, 3 * capacity, (n,), generator=gen)
    pos = torch.empty(n, kv_heads, capacity, dtype=torch.int32)
    for i in range(n):
        for h in range(kv_heads):  # distinct positions below cur, ascending; the window's own keys newest
            old = torch.randperm(int(cur[i]) - window, generator=gen)[:capacity - window].sort().values
            pos[i, h] = torch.cat([old, torch.arange(int(cur[i]) - window, int(cur[i]))]).int()
    dead = torch.rand(n, kv_heads, capacity, generator=gen) < 0.15
    pos[dead] = -1
    return q, k, pos, cur


def reference(q, k, pos, cur, scale):
    """snapkv_window_scores's torch path, before its pooling (pool_kernel=1), in fp32."""
    saved, sk.kernel_on_cpu = sk.kernel_on_cpu, False
    try:
        return snapkv_window_scores(q, k, pos, cur, scale, pool_kernel=1)
    finally:
        sk.kernel_on_cpu = saved


@needs_interpreter
@pytest.mark.parametrize("n,kv_heads,group,window,dim,capacity", [
    (2, 2, 2, 8, 16, 37),     # odd capacity: a partial last tile
    (1, 1, 1, 4, 32, 64),     # GQA group 1
    (3, 2, 4, 32, 16, 100),   # a 128-query block
    (2, 1, 8, 16, 64, 70),    # GQA group 8
    (1, 4, 3, 5, 16, 23),     # group x window not a power of two: padded query rows
])
def test_kernel_equals_the_torch_path(n, kv_heads, group, window, dim, capacity):
    q, k, pos, cur = inputs(n, kv_heads, group, window, dim, capacity, seed=n * 100 + capacity)
    scale = dim ** -0.5
    got = sk.snapkv_scores_triton(q, k, pos, cur, scale, block_c=16)
    want = reference(q, k, pos, cur, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (got[pos < 0] == 0).all() and got.sum() > 0


@needs_interpreter
def test_keys_newer_than_a_query_and_a_window_that_sees_nothing():
    """Window queries see only keys at or before their own position (causal inside the window); a row whose
    live keys are all newer than its window (and a row with no live key) scores 0 everywhere, as nan_to_num
    makes it in torch."""
    q, k, pos, cur = inputs(3, 2, 2, 8, 16, 40, seed=7)
    pos[1] = (int(cur[1]) + torch.arange(40)).int()  # every key newer than every window query
    pos[2] = -1                                      # no live key
    got = sk.snapkv_scores_triton(q, k, pos, cur, 0.25, block_c=16)
    torch.testing.assert_close(got, reference(q, k, pos, cur, 0.25), rtol=1e-5, atol=1e-6)
    assert (got[1:] == 0).all() and (got[0] > 0).any()


@needs_interpreter
def test_a_snapkv_compression_through_the_kernel_keeps_what_torch_keeps(monkeypatch):
    from kvroll import CompressionConfig
    from kvroll.rollout.cache import CompressedKVCache

    keeps, calls = [], []
    kernel_fn = sk.snapkv_scores_triton
    monkeypatch.setattr(sk, "snapkv_scores_triton", lambda *a, **kw: (calls.append(1), kernel_fn(*a, **kw))[1])
    for kernel in (False, True):
        monkeypatch.setattr(sk, "kernel_on_cpu", kernel)
        policy = CompressionConfig("snapkv", budget=20, window=8, buffer=12).build()
        policy.num_q_heads = 4
        cap = policy.capacity(20, 0)
        cache = CompressedKVCache(3, 4, 2, cap, 16, torch.float32, "cpu", policy, 20, 0.25)
        gen = torch.Generator().manual_seed(11)
        cache.k.normal_(generator=gen), cache.v.normal_(generator=gen)
        cache.pos.copy_(torch.arange(cap, dtype=torch.int32))
        cache.count.fill_(cap)
        cache.cur_pos.fill_(cap)
        cache.state["queries"].normal_(generator=gen)
        cache.compress_slots(torch.tensor([0, 2, 3]))
        keeps.append((cache.pos.clone(), cache.k.clone()))
    assert len(calls) == 1  # the kernel run: one layer-batched call (3 layers x 3 slots), the torch path none
    assert torch.equal(keeps[0][0], keeps[1][0]) and torch.equal(keeps[0][1], keeps[1][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_equals_the_torch_path_on_the_engine_shape(dtype):
    """Qwen3-1.7B's event shape (8 KV heads, GQA 2, window 32, head_dim 128, 1,152 slots), and GQA 8 at
    head_dim 64: the compiled kernel against the torch path on the same device and dtype."""
    for n, kv_heads, group, dim, capacity in [(16, 8, 2, 128, 1152), (4, 2, 8, 64, 300)]:
        q, k, pos, cur = (t.cuda() for t in inputs(n, kv_heads, group, 32, dim, capacity, seed=capacity))
        q, k = q.to(dtype), k.to(dtype)
        got = sk.snapkv_scores_triton(q, k, pos, cur, dim ** -0.5)
        saved, sk.enabled = sk.enabled, False
        try:
            want = snapkv_window_scores(q, k, pos, cur, dim ** -0.5, pool_kernel=1)
        finally:
            sk.enabled = saved
        torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)
