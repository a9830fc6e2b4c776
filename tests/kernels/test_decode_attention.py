"""The fused decode kernel against the fp32 torch reference.

CPU (CI): the Triton kernel runs under ``TRITON_INTERPRET=1`` (``./run test`` sets it without a GPU) on fp32
inputs over odd shapes. GPU (``gpu``): bf16, whose error must stay within twice torch-bf16's against fp32.
"""

import pytest
import torch

from kvroll import CompressionConfig
from kvroll.kernels import decode_attention as da
from kvroll.kernels import decode_launch as dl
from kvroll.rollout.cache import CompressedKVCache
from tests.conftest import needs_interpreter

# log2(||v||_1) of masked (zero) rows is -inf by design; the interpreter's NumPy warns about it
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def make_case(slots, kv_heads, group, head_dim, capacity, seed, holes=0.2, with_length=True, device="cpu",
              dtype=torch.float32):
    """Random q/K/V and cache metadata: shuffled true positions, holes (pos = -1), a live length per head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(slots, kv_heads * group, head_dim, generator=g)
    k = torch.randn(slots, kv_heads, capacity, head_dim, generator=g)
    v = torch.randn(slots, kv_heads, capacity, head_dim, generator=g)
    cur_pos = torch.randint(capacity, 3 * capacity, (slots,), generator=g)
    order = torch.stack([torch.randperm(capacity, generator=g) for _ in range(slots * kv_heads)])
    pos = (order.view(slots, kv_heads, capacity) + (cur_pos - capacity + 1)[:, None, None]).to(torch.int32)
    length = torch.randint(capacity // 2, capacity + 1, (slots, kv_heads), generator=g) if with_length else None
    if length is not None:
        pos = pos.masked_fill(torch.arange(capacity) >= length[..., None], -1)
    pos = pos.masked_fill(torch.rand(pos.shape, generator=g) < holes, -1)
    pos[..., 0] = torch.where(pos[..., 0] < 0, 5, pos[..., 0])  # every head keeps a live token
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), pos.to(**to),
            cur_pos.to(**to), None if length is None else length.to(**to))


def assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, sinks, window, layer_shared, rel=1e-6):
    """The chosen slot is evictable and its reference score ties the reference minimum within ``rel``."""
    _, evictable = da.metadata_masks(pos, cur_pos, sinks, window, length)
    score = ref_stat.double()
    if layer_shared:
        score, evictable = score.sum(1, keepdim=True), evictable[:, :1]
    masked = score.masked_fill(~evictable, float("inf"))
    best = masked.min(-1).values
    chosen = masked.gather(-1, evict[..., None])[..., 0]
    has_any = evictable.any(-1)
    assert torch.all(~has_any | (chosen <= best * (1 + rel) + 1e-30)), (chosen - best)
    assert torch.all(has_any | (evict == 0))


# variants: vn = ||v||_1 cached ("cache") or reduced in the kernel ("dot" on the tensor cores, "sum"); dense =
# no holes below the live length (the kernel then reads no positions for validity); finish = who finishes rows
CASES = [  # slots, kv_heads, group, head_dim, capacity, stat, layer_shared, splits, sinks, window, variant
    (1, 2, 1, 64, 37, "contrib", False, 1, 0, 1, dict(vn="cache", dense=True, finish="epilogue")),
    (3, 2, 2, 64, 75, "contrib", False, 3, 2, 4, dict(vn="cache", finish="last")),
    (3, 1, 4, 128, 50, "contrib", True, 2, 4, 8, dict(vn="cache", dense=True, finish="last")),
    (1, 3, 7, 64, 61, "mass", False, 2, 1, 3, dict(dense=True)),
    (3, 2, 8, 64, 45, "contrib", True, 1, 0, 1, dict(vn="dot", finish="last")),
    (1, 1, 8, 128, 100, "mass", True, 4, 3, 2, dict(finish="last")),
    (3, 2, 7, 128, 33, None, False, 2, 0, 1, dict(finish="last")),
    (3, 2, 1, 128, 70, None, False, 1, 0, 1, dict(dense=True)),
    (1, 2, 2, 128, 90, "mass", False, 1, 0, 16, dict(finish="epilogue")),
    (3, 1, 4, 64, 53, "contrib", False, 4, 2, 1, dict(vn="sum")),
    (3, 2, 7, 64, 77, "contrib", False, 2, 1, 2, dict(vn="cache", dense=True)),
    (1, 2, 4, 64, 40, "contrib", True, 1, 0, 1, dict(vn="cache", finish="epilogue")),  # layer: merge kernel
    # the merge kernel in chunks of 32 (with the block_stat=32 of the tests: a chunk per block) or 64 tokens, the
    # last to arrive reducing the partial argmins; with L2 eviction hints
    (3, 2, 4, 64, 75, "contrib", False, 2, 2, 4, dict(vn="cache", dense=True, chunk=32, hints=True)),
    (3, 2, 2, 128, 100, "contrib", True, 1, 1, 3, dict(vn="cache", chunk=64)),
    (2, 3, 7, 64, 90, "mass", False, 3, 0, 1, dict(chunk=32)),
    (1, 1, 4, 64, 37, "contrib", False, 1, 0, 1, dict(vn="cache", dense=True, finish="epilogue", hints=True)),
    # each tile's logits stored right after q.K (cached norms, "mass"; the "dot" norm keeps the late store)
    (3, 2, 2, 64, 75, "contrib", False, 2, 1, 2, dict(vn="cache", dense=True, early=True)),
    (2, 2, 4, 64, 50, "mass", True, 1, 0, 1, dict(early=True, finish="epilogue")),
    (2, 1, 2, 64, 40, "contrib", False, 2, 0, 1, dict(early=True)),
    # the L2 discard of consumed logits (PTX, GPUs only): accepted and without effect here
    (3, 2, 4, 64, 64, "contrib", False, 2, 2, 4, dict(vn="cache", dense=True, hints=True, discard=True)),
    # more than 16 splits (the merge loads its partial outputs 16 splits at a time): the long tail's grids
    (1, 2, 3, 64, 341, None, False, 21, 0, 1, dict(finish="last")),
    (2, 1, 2, 64, 300, "contrib", False, 18, 1, 2, dict(vn="cache", dense=True, chunk=64)),
    # fewer (slot, head) rows than SMs (4 under the interpreter): the merge kernel's programs split each head's
    # (query head, dim) elements into slices, beside or instead of the statistic's token chunks
    (1, 2, 7, 64, 90, "contrib", False, 5, 1, 2, dict(vn="cache", dense=True)),
    (1, 1, 4, 128, 200, None, False, 20, 0, 1, dict()),
    (1, 3, 2, 64, 64, "mass", True, 3, 0, 1, dict(chunk=32)),
]


def kernel_variant(v, vn="dot", dense=False, finish="merge", chunk=None, hints=False, early=False, asm=False,
                   discard=False):
    """decode_attention keyword arguments of a CASES variant (the cached norm computed independently here)."""
    norm = v.double().abs().sum(-1).float() if vn == "cache" else None
    return dict(vnorm=norm, vnorm_dot=vn != "sum", dense=dense, finish=finish, finish_chunk=chunk,
                cache_hints=hints, logit_store="asm" if asm else "early" if early else "late", logit_discard=discard)


@needs_interpreter
@pytest.mark.parametrize("slots,kv_heads,group,head_dim,capacity,stat,layer_shared,splits,sinks,window,variant",
                         CASES)
def test_kernel_matches_fp32_reference(slots, kv_heads, group, head_dim, capacity, stat, layer_shared, splits,
                                       sinks, window, variant):
    seed = hash((slots, kv_heads, group, head_dim, capacity)) % 1000
    dense = variant.get("dense", False)
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed,
                                              holes=0.0 if dense else 0.2, with_length=splits != 1)
    args = dict(stat=stat, argmin=stat is not None, sinks=sinks, window=window, layer_shared=layer_shared,
                length=length)
    out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, num_splits=splits, block_n=16,
                                         block_stat=32, **kernel_variant(v, **variant), **args)
    ref_out, ref_stat, ref_evict = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)  # fp32 inputs: fp32 arithmetic
    if stat is None:
        assert st is None and evict is None
        return
    torch.testing.assert_close(st, ref_stat, atol=1e-6 * float(ref_stat.abs().max()), rtol=1e-4)
    assert evict.shape == ref_evict.shape
    assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, sinks, window, layer_shared)
    # argmin only, as the engine calls it
    _, no_stat, evict_only = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, num_splits=splits,
                                                 block_n=16, block_stat=32, return_stat=False,
                                                 **kernel_variant(v, **variant), **args)
    assert no_stat is None
    assert_argmin_ok(evict_only, ref_stat, pos, cur_pos, length, sinks, window, layer_shared)
    if length is not None:  # the engine's call: the argmin becomes the cache's next write index in the kernel
        write_idx = torch.full((slots, kv_heads), -7, dtype=torch.int64)
        _, _, none = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, num_splits=splits, block_n=16,
                                         block_stat=32, return_stat=False, write_idx=write_idx,
                                         **kernel_variant(v, **variant), **args)
        assert none is None  # (heads at capacity and below it together: test_attend_kernel_path_...)
        assert torch.equal(write_idx, torch.where(length < capacity, length, evict_only.expand(-1, kv_heads)))


@needs_interpreter
@pytest.mark.parametrize("layer_shared", [False, True])
@pytest.mark.parametrize("finish, chunk", [("merge", 32), ("last", None)])
def test_write_idx_is_the_argmin_when_every_head_is_full(layer_shared, finish, chunk):
    """Every head at capacity (the steady state of a compressing cache): the next write index the kernel sets is
    the argmin of the fp32 reference's statistic, per head or (layer-shared) the layer's one for every head;
    the chunked merge's last arrival writes it."""
    slots, kv_heads, group, head_dim, capacity = 3, 2, 3, 32, 150
    q, k, v, pos, cur_pos, _ = make_case(slots, kv_heads, group, head_dim, capacity, seed=17, holes=0.0,
                                         with_length=False)
    length = torch.full((slots, kv_heads), capacity, dtype=torch.int64)
    args = dict(stat="contrib", argmin=True, sinks=2, window=4, layer_shared=layer_shared, length=length)
    _, ref_stat, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    write_idx = torch.full((slots, kv_heads), -7, dtype=torch.int64)
    cfg = dict(num_splits=3, block_n=16, block_stat=32, finish=finish, finish_chunk=chunk, return_stat=False)
    _, _, none = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, write_idx=write_idx, **cfg, **args)
    assert none is None and (write_idx >= 0).all() and (write_idx < capacity).all()
    chosen = write_idx[:, :1] if layer_shared else write_idx
    if layer_shared:
        assert torch.equal(write_idx, chosen.expand(-1, kv_heads))
    assert_argmin_ok(chosen, ref_stat, pos, cur_pos, length, 2, 4, layer_shared)
    _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **cfg, **args)
    assert torch.equal(chosen, evict)  # the same argmin as the kernel returns without write_idx


@needs_interpreter
@pytest.mark.parametrize("stat", [None, "contrib"])
def test_long_tail_defaults_match_reference(stat):
    """The launcher's own long-tail configuration (no tuning switch given): a row of more than 2,048 tokens and
    fewer (slot, head) rows than SMs takes 128-token tiles and one wave of splits; odd capacity, holes, GQA 4."""
    slots, kv_heads, group, head_dim, capacity = 1, 2, 4, 32, 4100
    assert dl.long_tail(slots, kv_heads, capacity, 64, torch.device("cpu"), stat=stat is not None)
    assert dl.tail_block_n(head_dim, capacity, torch.float32, torch.device("cpu"), 3) == 128
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed=5, holes=0.2,
                                              with_length=True)
    args = dict(stat=stat, argmin=stat is not None, sinks=2, window=3, length=length)
    out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    ref_out, ref_stat, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    if stat is not None:
        torch.testing.assert_close(st, ref_stat, atol=1e-6 * float(ref_stat.abs().max()), rtol=1e-4)
        assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, 2, 3, False)


@needs_interpreter
@pytest.mark.parametrize("group, layer_shared", [(2, False), (4, True), (8, False)])
def test_short_tail_defaults_match_reference(monkeypatch, group, layer_shared):
    """A compressed cache's steady state in the tail (few rows, <= 2,048 tokens), launcher defaults on a 132-SM
    device: groups <= 4 are finished by the last program to arrive (128-token splits), group 8 by the merge
    kernel; both against the fp32 reference, odd capacity, holes."""
    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    slots, kv_heads, head_dim, capacity = 2, 2, 32, 300
    assert dl.short_tail(slots * kv_heads, group, capacity) == (2 if group <= 4 else None)
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed=23, holes=0.2,
                                              with_length=True)
    args = dict(stat="contrib", argmin=True, sinks=2, window=3, length=length, layer_shared=layer_shared)
    out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    ref_out, ref_stat, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(st, ref_stat, atol=1e-6 * float(ref_stat.abs().max()), rtol=1e-4)
    assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, 2, 3, layer_shared)


def test_short_tail_rule():
    assert dl.short_tail(8, 2, 1024) == 8 and dl.short_tail(16, 4, 2048) == 8  # <= 16 rows: up to 8 splits
    assert dl.short_tail(32, 8, 1024) == 4 and dl.short_tail(64, 2, 512) == 4  # 32+ rows: up to 4
    assert dl.short_tail(8, 2, 256) == 2 and dl.short_tail(8, 1, 100) == 1  # 128 tokens per split at least
    assert dl.short_tail(64, 8, 1024) == 2  # 64+ rows with 8 query heads per KV head
    assert dl.short_tail(16, 8, 1024) is None and dl.short_tail(8, 2, 2049) is None  # the merge kernel's
    assert dl.short_tail(8, 2, 2048) is None  # one slot of 2,048 tokens: the merge kernel


@needs_interpreter
def test_bad_tuning_switches_name_the_field():
    q, k, v, pos, cur_pos, length = make_case(1, 2, 2, 64, 40, seed=11)
    with pytest.raises(AssertionError, match="logit_store='fast'"):
        da.decode_attention(q, k, v, pos, cur_pos, 0.125, stat="mass", logit_store="fast")
    with pytest.raises(AssertionError, match="finish_chunk=0"):
        da.decode_attention(q, k, v, pos, cur_pos, 0.125, stat="mass", finish_chunk=0)


@needs_interpreter
def test_argmin_only_skips_the_stat_and_agrees():
    q, k, v, pos, cur_pos, length = make_case(3, 2, 2, 64, 40, seed=11)
    args = dict(stat="contrib", argmin=True, sinks=1, window=2, length=length, block_n=16)
    _, st, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, return_stat=False, **args)
    _, _, evict_full = da.decode_attention(q, k, v, pos, cur_pos, 0.125, **args)
    _, _, evict_epilogue = da.decode_attention(q, k, v, pos, cur_pos, 0.125, finish="epilogue", vnorm_dot=False, **args)
    assert st is None and torch.equal(evict, evict_full) and torch.equal(evict, evict_epilogue)
    for _ in range(2):  # the arrival counters reset themselves: a second launch finishes every row again
        _, _, evict_last = da.decode_attention(q, k, v, pos, cur_pos, 0.125, return_stat=False, finish="last",
                                               num_splits=2, **args)
        assert torch.equal(evict_last, evict)
        _, _, evict_chunks = da.decode_attention(q, k, v, pos, cur_pos, 0.125, return_stat=False, finish_chunk=16,
                                                 block_stat=16, **args)
        assert torch.equal(evict_chunks, evict)


@needs_interpreter
@pytest.mark.parametrize("finish", ["merge", "last"])
def test_cached_norms_are_what_the_statistic_uses(finish):
    """The kernel takes ||v_i||_1 from ``vnorm`` (not from V): stat = attention mass x the given norms."""
    q, k, v, pos, cur_pos, length = make_case(3, 2, 4, 64, 50, seed=13)
    vnorm = torch.rand(pos.shape, generator=torch.Generator().manual_seed(1)) + 0.1  # unrelated to V
    args = dict(argmin=True, sinks=2, window=3, length=length, layer_shared=finish == "last")
    _, st, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, stat="contrib", vnorm=vnorm, block_n=16,
                                       num_splits=2, finish=finish, **args)
    _, mass, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, 0.125, stat="mass", **args)
    expected = mass * vnorm
    torch.testing.assert_close(st, expected, atol=1e-7, rtol=1e-4)
    assert_argmin_ok(evict, expected, pos, cur_pos, length, 2, 3, args["layer_shared"])


@needs_interpreter
@pytest.mark.parametrize("stat,variant", [("mass", dict()), ("contrib", dict(vn="cache", dense=True))])
def test_no_evictable_slot_gives_zero_and_dead_tail_is_not_read(stat, variant):
    q, k, v, pos, cur_pos, _ = make_case(1, 2, 2, 64, 40, seed=12, holes=0.0, with_length=False)
    length = torch.tensor([[20, 40]])
    v[0, 0, 20:] = float("nan")  # past the live length: must never be read (nor its norm)
    k[0, 0, 20:] = float("nan")
    pos[0, 0, 20:] = -1
    out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, stat=stat, argmin=True,
                                         window=10 ** 6, length=length, block_n=16, **kernel_variant(v, **variant))
    assert torch.isfinite(out).all() and torch.isfinite(st).all()
    assert evict.tolist() == [[0, 0]]  # the window protects everything
    _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, stat=stat, argmin=True, window=10 ** 6,
                                      length=length, block_n=16, return_stat=False, **kernel_variant(v, **variant))
    assert evict.tolist() == [[0, 0]]  # argmin only: the same


def torch_and_kernel_caches(policy, budget, counts):
    """Two caches (2 layers, 3 slots, 2 KV heads, 40 slots of head_dim 16) alike but for the path ``attend``
    takes: torch, then the Triton kernels on CPU; ``counts`` [3][2] live tokens per (slot, head) in each layer."""
    caches = []
    for kernel in (False, True):
        cache = CompressedKVCache(2, 3, 2, 40, 16, torch.float32, "cpu", policy, budget, 0.25)
        cache.kernel_on_cpu = kernel
        cache.cur_pos.copy_(torch.tensor([60, 45, 41]))
        cache.count.copy_(torch.tensor(counts).expand(2, -1, -1))
        caches.append(cache)
    return caches


@needs_interpreter
@pytest.mark.parametrize("finish, chunk, splits", [("merge", None, 3), ("merge", 32, 2), ("last", None, 3),
                                                   ("epilogue", None, 1)])
@pytest.mark.parametrize("layer_shared", [False, True])
def test_stat_into_adds_the_statistic_into_a_running_sum(finish, chunk, splits, layer_shared):
    """``stat_into``: the finishing pass adds the statistic into the caller's buffer (Hard-KV's votes) — bit for
    bit the kernel's own statistic added by torch, every finishing mode; the output is unchanged and no statistic
    is returned. Odd capacity, holes, GQA 3."""
    q, k, v, pos, cur_pos, length = make_case(2, 2, 3, 64, 77, seed=31, holes=0.2, with_length=True)
    args = dict(stat="mass", length=length, finish=finish, finish_chunk=chunk, num_splits=splits,
                block_stat=32, layer_shared=layer_shared)
    out, stat, _ = da.decode_attention(q, k, v, pos, cur_pos, 0.125, **args)
    running = torch.rand(2, 2, 77, generator=torch.Generator().manual_seed(2))
    want = running + stat
    out2, none, _ = da.decode_attention(q, k, v, pos, cur_pos, 0.125, stat_into=running, **args)
    assert none is None and torch.equal(out2, out)
    assert torch.equal(running, want)
    _, ref_stat, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, 0.125, stat="mass", length=length)
    torch.testing.assert_close(stat, ref_stat, atol=1e-6, rtol=1e-4)  # what is added is the statistic


@needs_interpreter
def test_attend_kernel_path_adds_hardkv_votes_as_the_torch_path():
    """Hard-KV's votes (``stat_sum``): the kernel path adds the step's attention mass into them in the kernel; the
    torch path through ``observe``. Same output, same votes."""
    policy = CompressionConfig("hardkv", budget=32, interval=8, window=4, sink_tokens=2).build()
    gen = torch.Generator().manual_seed(4)
    caches = torch_and_kernel_caches(policy, 32, [[40, 36], [37, 40], [30, 33]])
    k, v = torch.randn(2, 3, 2, 40, 16, generator=gen), torch.randn(2, 3, 2, 40, 16, generator=gen)
    pos = torch.arange(40).expand(2, 3, 2, 40) + 5
    votes = torch.rand(2, 3, 2, 40, generator=gen)
    q = torch.randn(3, 4, 16, generator=gen)
    for cache in caches:
        cache.k.copy_(k), cache.v.copy_(v)
        live = torch.arange(40) < cache.count[..., None]
        cache.pos.copy_(torch.where(live, pos, -1).to(torch.int32))
        cache.state["votes"].copy_(votes * live)
    outs = [cache.attend(1, q) for cache in caches]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(caches[1].state["votes"], caches[0].state["votes"], atol=1e-6, rtol=1e-5)
    assert not torch.equal(caches[1].state["votes"][1], votes[1] * (torch.arange(40) < caches[1].count[1, ..., None]))
    assert torch.equal(caches[1].state["votes"][0], caches[0].state["votes"][0])  # layer 0 untouched


@needs_interpreter
@pytest.mark.parametrize("granularity", ["head", "layer"])
def test_attend_kernel_path_with_cached_norms_equals_torch_path(granularity):
    """``attend`` hands the kernel the cache's norms and the dense promise: same output and next write slots."""
    policy = CompressionConfig("longflow", budget=40, granularity=granularity).build()
    gen = torch.Generator().manual_seed(3)
    caches = torch_and_kernel_caches(policy, 40, [[40, 40], [37, 40], [40, 33]])
    k, v = torch.randn(2, 3, 2, 40, 16, generator=gen), torch.randn(2, 3, 2, 40, 16, generator=gen)
    pos = torch.stack([torch.randperm(40, generator=gen) for _ in range(12)]).view(2, 3, 2, 40) + 5
    q = torch.randn(3, 4, 16, generator=gen)
    for cache in caches:
        cache.k.copy_(k), cache.v.copy_(v)
        cache.vnorm.copy_(v.abs().sum(-1))
        live = torch.arange(40) < cache.count[..., None]
        cache.pos.copy_(torch.where(live, pos, -1).to(torch.int32))
    outs = [cache.attend(1, q) for cache in caches]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)
    assert torch.equal(caches[1].write_idx[1], caches[0].write_idx[1])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [dict(), dict(vn="cache", finish="last"), dict(vn="cache", finish="epilogue"),
                                     dict(vn="cache", asm=True), dict(vn="cache", asm=True, chunk=512),
                                     dict(vn="cache", hints=True, discard=True),
                                     dict(vn="cache", asm=True, hints=True, chunk=512, discard=True),
                                     dict(vn="cache", finish="last", hints=True, discard=True),
                                     dict(vn="cache", finish="epilogue", discard=True)])
@pytest.mark.parametrize("shape", [(64, 16, 8, 128, 1152), (8, 32, 8, 128, 3200), (4, 14, 2, 64, 1000)])
def test_bf16_error_within_twice_torch_bf16(shape, variant):
    slots, num_q_heads, kv_heads, head_dim, capacity = shape
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, num_q_heads // kv_heads, head_dim, capacity,
                                              seed=3, device="cuda", dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    args = dict(stat="contrib", argmin=True, sinks=4, window=8, length=length)
    out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, scale, **kernel_variant(v, **variant), **args)
    ref_out, ref_stat, _ = da.decode_attention_ref(q.float(), k.float(), v.float(), pos, cur_pos, scale, **args)
    valid, _ = da.metadata_masks(pos, cur_pos, 4, 8, length)
    mask = valid.repeat_interleave(num_q_heads // kv_heads, dim=1)[:, :, None, :]  # [S, Hq, 1, C]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                                             enable_gqa=True)[:, :, 0]
    err = (out.float() - ref_out).norm() / ref_out.norm()
    torch_err = (sdpa.float() - ref_out).norm() / ref_out.norm()
    assert err <= 2 * torch_err, (err, torch_err)
    assert (st - ref_stat).norm() / ref_stat.norm() < 1e-2
    assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, 4, 8, False, rel=1e-4)
    _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, scale, return_stat=False,  # as the engine calls it
                                      **kernel_variant(v, **variant), **args)
    assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, 4, 8, False, rel=1e-4)


def test_default_splits_fill_the_sms_only_when_rows_are_few(monkeypatch):
    """The long-tail rule (fewer (slot, head) rows than SMs) raises the split count of small grids and leaves the
    benchmark shapes K1-K3 (the session-4/5 sweeps' picks) as they were; 132 SMs as on an H100 SXM / H200."""
    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    for stat, picks in ((True, (4, 8, 1)), (False, (2, 4, 1))):  # K1, K2, K3
        shapes = ((128, 8, 3200), (64, 8, 16384), (256, 8, 1152))
        assert tuple(dl.default_splits(s, h, c, 64, dev, stat=stat) for s, h, c in shapes) == picks
    # the tail: one wave of programs (2 per SM where a program's K/V tiles take <= 100 KB), at most 16 splits
    assert dl.default_splits(1, 8, 2048, 64, dev, stat=False) == 16  # 33 would fit: at most 16
    # with a statistic, splits of 128 tokens at least at fewer than 16 rows of fewer than 1,024 (query head, dim)
    # elements a head, else 256 (4 tiles)
    assert dl.default_splits(1, 8, 2048, 64, dev, stat=True) == 16
    assert dl.default_splits(1, 8, 2048, 64, dev, stat=True, head_dim=64, group=8) == 16
    assert dl.default_splits(2, 8, 2048, 64, dev, stat=True, head_dim=64, group=8) == 8
    assert dl.default_splits(1, 8, 2048, 64, dev, stat=True, head_dim=128, group=8) == 8
    assert dl.default_splits(3, 8, 2048, 64, dev, stat=True, head_dim=64, group=2) == 8
    assert dl.default_splits(1, 8, 2048, 32, dev, stat=True, head_dim=256, group=1) == 8  # not measured: 256 tokens
    monkeypatch.setattr(dl, "TAIL_SHORT_SPLITS", False)
    assert dl.default_splits(1, 8, 2048, 64, dev, stat=True) == 8
    monkeypatch.setattr(dl, "TAIL_SHORT_SPLITS", True)
    assert dl.default_splits(8, 8, 2048, 64, dev, stat=False) == 4  # 64 rows x 4 = 2 programs per SM
    # with a statistic, batch 8 at 2,048 tokens keeps the usual configuration (2 splits, the last arrival
    # finishes); at 8k it takes the tail's
    assert not dl.long_tail(8, 8, 2048, 64, dev, stat=True) and dl.default_splits(8, 8, 2048, 64, dev) == 2
    assert dl.long_tail(8, 8, 8192, 64, dev, stat=True) and dl.long_tail(1, 8, 2048, 64, dev, stat=True)
    assert not dl.long_tail(17, 8, 32768, 64, dev, stat=False)  # 136 rows: not fewer than the SMs
    # 128-token tiles at head_dim 128 (192 KB of K/V tiles): one program per SM, never a partial second wave
    assert dl.default_splits(1, 8, 32768, 128, dev, stat=True) == 16
    assert dl.default_splits(4, 8, 32768, 128, dev, stat=False) == 4  # 32 rows x 5 would be 160 programs
    assert dl.default_splits(8, 8, 8192, 128, dev, stat=False) == 2
    assert dl.default_splits(2, 8, 8192, 128, dev, stat=False, head_dim=64) == 16  # 96 KB: 2 per SM
    assert dl.default_splits(4, 8, 8192, 128, dev, stat=True, head_dim=64) == 8
    assert dl.tail_programs_per_sm(128, 128, 2, 3) == 1 and dl.tail_programs_per_sm(128, 64, 2, 3) == 2
    assert dl.default_splits(1, 8, 100, 64, dev, stat=True) == 1  # never below a tile per split
    # the tail's 128-token tile: rows over 2,048 tokens, where every stage's K and V tiles fit (227 KB on an H100)
    bf16, f32 = torch.bfloat16, torch.float32
    assert dl.tail_block_n(128, 8192, bf16, dev, 3) == 128 and dl.tail_block_n(64, 32768, bf16, dev, 4) == 128
    assert dl.tail_block_n(128, 2048, bf16, dev, 3) is None  # short rows keep 64-token tiles
    assert dl.tail_block_n(128, 8192, f32, dev, 3) is None and dl.tail_block_n(128, 8192, bf16, dev, 4) is None
    assert dl.tail_block_n(256, 8192, bf16, dev, 3) is None


def test_attention_alone_takes_one_split_from_a_third_of_a_wave(monkeypatch):
    """Attention alone (no statistic), rows >= SMs: one split (no merge kernel) from a third of a wave of
    programs up to 1.5 waves at any length, and from a third of a wave up at <= 1,152 tokens (session 18's H100
    sweep); elsewhere the old rule's splits. A wave: 132 SMs x 2 programs at head_dim 128, x 4 at head_dim 64."""
    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    dev = torch.device("cpu")
    assert dl.resident_programs(64, 128, 2, 3) == 2 and dl.resident_programs(64, 64, 2, 3) == 4
    assert dl.resident_programs(128, 128, 2, 3) == 1 and dl.resident_programs(32, 64, 2, 3) == 4  # 1 to 4
    # the engine's batch 64 at budget 1,024 (+ a 128-token buffer): 512 rows, ~2 waves, one split (was 2)
    assert dl.default_splits(64, 8, 1024, 64, dev, stat=False) == 1
    assert dl.default_splits(64, 8, 1152, 64, dev, stat=False) == 1
    assert dl.default_splits(64, 8, 1024, 64, dev, stat=True) == 1  # the statistic's rule: unchanged
    assert dl.default_splits(64, 8, 2048, 64, dev, stat=False) == 4  # ~2 waves past 1,152 tokens: as before
    assert dl.default_splits(128, 8, 8192, 64, dev, stat=False) == 2  # ~3.9 waves: as before
    for slots in (17, 24, 32, 48):  # 0.5-1.45 waves at head_dim 128: one split at every length
        assert all(dl.default_splits(slots, 8, c, 64, dev, stat=False) == 1 for c in (1024, 4096, 8192))
    assert dl.default_splits(64, 8, 8192, 64, dev, stat=False, head_dim=64) == 1  # ~1 wave of 4 per SM
    assert dl.default_splits(17, 8, 4096, 64, dev, stat=False, head_dim=64) == 8  # a quarter of a wave: split
    # with the statistic: one split from 0.7 to 1.5 waves of 2 programs per SM at 2,048-4,096 tokens
    assert dl.default_splits(17, 8, 4096, 64, dev, stat=True) == 5  # 136 rows: the old rule
    for slots in (24, 32, 48):
        assert dl.default_splits(slots, 8, 2048, 64, dev, stat=True) == 1  # was 2
        assert dl.default_splits(slots, 8, 4096, 64, dev, stat=True, head_dim=64) == 1  # was 5
        assert dl.default_splits(slots, 8, 8192, 64, dev, stat=True) > 1  # 8k tokens: the old rule
    assert dl.default_splits(64, 8, 2048, 64, dev, stat=True, head_dim=64) == 2  # ~2 waves: the old rule
    assert not dl._one_split(131, 1024, 132, 1, stat=False)  # fewer rows than SMs: the long tail's rule


def test_launch_config_follows_the_session_22_sweep(monkeypatch):
    """4 warps and 3 stages but where the H100 sweep found better at rows >= SMs: attention alone at head_dim 128
    with 1.2-2.1 waves of the 3-stage tiles (2 per SM) takes 2 stages, at head_dim 64 from 1.4 waves (4 per SM);
    the statistic keeps 4 and 3 (8 warps were faster in the sweep, slower in the engine). 132 SMs, an H100's."""
    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    dev = torch.device("cpu")

    def pick(slots, cap, hd, stat, **kw):  # cap: the sweep's lengths; the rule does not depend on them
        return dl.launch_config(slots * 8, hd, stat, dev, **kw)
    assert [pick(s, 1152, 128, False) for s in (17, 33, 48, 64, 66, 96, 256)] == \
        [(4, 3), (4, 3), (4, 2), (4, 2), (4, 2), (4, 3), (4, 3)]
    assert [pick(s, 1024, 64, False) for s in (33, 64, 96, 128, 256)] == [(4, 3), (4, 3), (4, 2), (4, 2), (4, 2)]
    assert all(pick(s, c, hd, True) == (4, 3) for s in (33, 64, 128) for c in (1024, 4096) for hd in (64, 128))
    assert pick(64, 1024, 256, False) == (4, 3) and pick(64, 1024, 32, False) == (4, 3)  # not measured
    assert pick(64, 1024, 128, False, elem_size=4) == (4, 3) and pick(64, 1024, 128, False, block_n=32) == (4, 3)
    assert pick(16, 8192, 128, False) == (4, 3)  # 128 rows: the long tail's own rules
    monkeypatch.setattr(dl, "LAUNCH_RULE", False)
    assert pick(64, 1152, 128, False) == (4, 3) and pick(96, 1024, 64, False) == (4, 3)


def test_stat_two_stages_follows_the_session_23_probe(monkeypatch):
    """With a statistic, 2 stages and the register-layout logit store at head_dim 128 where rows fill 1.09-2.0
    waves of the 3-stage tiles (2 per SM: 36-66 slots of 8 KV heads), up to 2,048 tokens and 4 query heads per KV
    head, 2-byte elements, the usual 64-token tiles and a store before the softmax update: where the H100 probe
    found it 0.83-1.00x the time; not at 4,096 tokens, 8 query heads per KV head, head_dim 64, other fills (69
    slots: 1.14x), fp32, other tiles, the late-only store (norms reduced in the hot loop), nor with the switch off.
    132 SMs, an H100's (the CPU device stands in for one)."""
    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    dev = torch.device("cpu")

    def takes(slots, cap=1024, hd=128, group=2, **kw):
        return dl.stat_two_stages(slots * 8, hd, cap, group, dev, **kw)
    assert [takes(s) for s in (17, 33, 35, 36, 48, 64, 66, 67, 69, 80, 128, 256)] == \
        [False, False, False, True, True, True, True, False, False, False, False, False]
    assert takes(64, 2048) and not takes(64, 4096) and not takes(48, 4096)
    assert takes(64, group=1) and takes(64, group=4) and not takes(64, group=8)
    assert not takes(64, hd=64)
    assert takes(64, block_n=64) and not takes(64, block_n=32) and not takes(64, elem_size=4)
    assert not takes(64, early_store=False)
    monkeypatch.setattr(dl, "STAT_LAUNCH_RULE", False)
    assert not takes(64)


def test_few_rows_at_head_dim_64_take_four_splits(monkeypatch):
    """With a statistic at head_dim 64 and 1,536-2,048 tokens, where the base rule's 2 splits give at most 1.25
    programs per SM (40-80 rows on 132 SMs, outside the long tail): 4 splits (the H100 probe: 0.89-0.97x the time);
    not at 96+ rows, head_dim 128, 1,024 or 4,096 tokens, attention alone, nor with the switch off."""
    monkeypatch.setattr(dl, "sm_count", lambda device: 132)
    dev = torch.device("cpu")

    def splits(slots, cap=2048, hd=64, stat=True):
        return dl.default_splits(slots, 8, cap, 64, dev, stat=stat, head_dim=hd)
    assert [splits(s) for s in (5, 8, 10, 12, 16)] == [4, 4, 4, 2, 2]
    assert splits(8, cap=1536) == 4 and splits(8, hd=128) == 2
    others = [(4, 2048, 64, True), (8, 1024, 64, True), (8, 4096, 64, True), (8, 2048, 64, False), (12, 2048, 64, True)]
    picks = [splits(s, cap, hd, stat) for s, cap, hd, stat in others]  # the long tail's, 1 split, attention alone
    monkeypatch.setattr(dl, "FEW_ROWS_SPLITS", False)
    assert splits(8) == 2 and splits(5) == 2 and splits(8, cap=1536) == 2
    assert [splits(s, cap, hd, stat) for s, cap, hd, stat in others] == picks  # untouched by the rule


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 16, 8, 128, 1024), (48, 32, 8, 128, 2048), (64, 16, 8, 128, 1152),
                                   (64, 16, 8, 128, 2048)])
@pytest.mark.parametrize("stat", ["contrib", "mass"])
def test_stat_two_stages_on_gpu_matches_the_reference(monkeypatch, shape, stat):
    """The rule's calls on an H100 / H200 (bf16, the engine's LongFlow and Hard-KV shapes; 64 slots x 2,048 tokens
    runs 2 splits, finished by the last arrival): the launcher takes 2 stages and the register store (spied), the
    output is within bf16's rounding of the fp32 reference, the argmin a reference minimum, the cache's write index
    set from it; and the outputs, statistic and argmin equal the old configuration's (the switch off) bit for bit,
    as do the layer-shared argmin (contrib) and the votes added into a running sum (mass)."""
    slots, num_q_heads, kv_heads, head_dim, capacity = shape
    group = num_q_heads // kv_heads
    if not dl.stat_two_stages(slots * kv_heads, head_dim, capacity, group, torch.device("cuda")):
        pytest.skip("stat_two_stages is for H100 / H200-class GPUs (compute capability 9.x, 132 SMs)")
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed=23, holes=0.0,
                                              device="cuda", dtype=torch.bfloat16)
    vnorm = v.float().abs().sum(-1) if stat == "contrib" else None
    args = dict(stat=stat, argmin=True, sinks=4, window=8, length=length, dense=True, vnorm=vnorm)
    scale = head_dim ** -0.5
    seen = []
    logit_defaults, default_splits = dl.logit_defaults, dl.default_splits
    monkeypatch.setattr(dl, "logit_defaults", lambda *a, **kw: seen.append(a[3]) or logit_defaults(*a, **kw))
    monkeypatch.setattr(dl, "default_splits", lambda *a, **kw: seen.append(kw["num_stages"])
                        or default_splits(*a, **kw))

    def calls():
        out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, scale, **args)
        write_idx = torch.full((slots, kv_heads), -7, dtype=torch.int64, device="cuda")
        da.decode_attention(q, k, v, pos, cur_pos, scale, return_stat=False, write_idx=write_idx, **args)
        _, shared, layer = da.decode_attention(q, k, v, pos, cur_pos, scale, layer_shared=True, **args)
        votes = torch.rand(slots, kv_heads, capacity, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
        da.decode_attention(q, k, v, pos, cur_pos, scale, stat_into=votes, **{**args, "argmin": False})
        return out, st, evict, write_idx, shared, layer, votes
    new = calls()
    assert seen[:2] == ["asm", 2], seen
    out, st, evict, write_idx = new[:4]
    ref_out, ref_stat, _ = da.decode_attention_ref(q.float(), k.float(), v.float(), pos, cur_pos, scale,
                                                   stat=stat, argmin=True, sinks=4, window=8, length=length)
    assert (out.float() - ref_out).norm() / ref_out.norm() < 1e-2
    assert (st - ref_stat).norm() / ref_stat.norm() < 1e-2
    assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, 4, 8, False, rel=1e-2)
    full = length >= capacity
    assert torch.equal(write_idx[~full], length[~full]) and torch.equal(write_idx[full], evict[full])
    monkeypatch.setattr(dl, "STAT_LAUNCH_RULE", False)
    seen.clear()
    old = calls()
    assert seen[:2] == [None, 3], seen  # the old configuration: the default (late) store, 3 stages
    for a, b in zip(new, old):
        assert torch.equal(a, b)


@needs_interpreter
@pytest.mark.parametrize("slots,head_dim,group,stat", [(2, 128, 2, None), (3, 64, 4, None), (2, 128, 1, None),
                                                       (2, 128, 2, "contrib"), (2, 128, 1, "mass")])
def test_the_launch_rules_configurations_match_the_reference(slots, head_dim, group, stat):
    """fp16 calls (the rule's 2-byte elements) on the interpreter's 4 SMs: attention alone at 16 rows (2 waves of 2
    at head_dim 128) and 24 rows (1.5 waves of 4 at head_dim 64) takes 2 stages by default, and its split count
    from 3 programs per SM; with the statistic 4 warps and 3 stages, and the sweep's 8 warps and 2 stages given
    explicitly. Each equals the fp32 reference on the fp16 inputs within fp16's rounding."""
    kv_heads, capacity = 8, 96
    rows = slots * kv_heads
    warps, stages = dl.launch_config(rows, head_dim, stat is not None, torch.device("cpu"), 2)
    assert (warps, stages) == ((4, 3) if stat else (4, 2))
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed=11,
                                              dtype=torch.float16)
    scale = head_dim ** -0.5
    args = dict(stat=stat, argmin=stat is not None, sinks=2, window=3, length=length)
    ref_out, ref_stat, _ = da.decode_attention_ref(q.float(), k.float(), v.float(), pos, cur_pos, scale, **args)
    for cfg in ({}, {} if stat is None else dict(num_warps=8, num_stages=2)):
        out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, scale, **args, **cfg)
        assert out.dtype == torch.float16
        assert (out.float() - ref_out).norm() / ref_out.norm() < 2e-3
        if stat is not None:
            assert (st - ref_stat).norm() / ref_stat.norm() < 2e-3
            assert_argmin_ok(evict, ref_stat, pos, cur_pos, length, 2, 3, False, rel=1e-2)


def test_logit_store_defaults():
    """The logits are stored from the dot's registers and not discarded only for few rows with a query group on
    an NVIDIA GPU (session 18's H100 check); elsewhere, and for a store given explicitly, the late store and the
    discard as before."""
    assert dl.logit_defaults(True, 2, True) == ("asm", False)
    assert dl.logit_defaults(True, 8, True) == ("asm", False)
    assert dl.logit_defaults(True, 1, True) == ("late", True)  # one query head per KV head: up to 1.21x slower
    assert dl.logit_defaults(False, 2, True) == ("late", True)  # rows >= SMs: the big grids' defaults
    assert dl.logit_defaults(True, 2, False) == ("late", True)  # the interpreter, ROCm
    assert dl.logit_defaults(True, 2, True, "late") == ("late", True)  # explicit store: discard stays on
    assert dl.logit_defaults(True, 2, True, "early", False) == ("early", False)
    assert dl.logit_defaults(True, 2, True, None, True) == ("asm", True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, stat", [((1, 32, 8, 128, 8192), "contrib"), ((4, 16, 8, 64, 2048), None),
                                         ((2, 8, 2, 128, 3000), "contrib"), ((64, 16, 8, 128, 1152), "contrib")])
def test_programmatic_dependent_launch_changes_nothing(shape, stat):
    """The merge kernel launched early (``pdl=True``, waiting in the kernel for the split kernel's end) gives the
    bits of the ordinary launch, eagerly and replayed in a CUDA graph, per head and layer-shared."""
    if not dl.pdl_ok(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9+ and Triton 3.4+")
    slots, num_q_heads, kv_heads, head_dim, capacity = shape
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, num_q_heads // kv_heads, head_dim, capacity,
                                              seed=9, device="cuda", dtype=torch.bfloat16)
    for layer_shared in (False, True):
        args = dict(stat=stat, argmin=stat is not None, sinks=2, window=4, length=length, layer_shared=layer_shared,
                    finish="merge", finish_chunk=1024)
        results = {}
        for pdl in (False, True):
            eager = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, pdl=pdl, **args)
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, pdl=pdl, **args)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                replayed = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, pdl=pdl, **args)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(eager, replayed):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
            results[pdl] = eager
        for a, b in zip(results[False], results[True]):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 16, 8, 128, 1152), (1, 16, 8, 128, 8192), (4, 14, 2, 64, 1000)])
def test_stat_into_on_gpu_is_the_statistic_added(shape):
    """Hard-KV's in-kernel votes at the engine's shapes (bf16, launcher defaults: the merge kernel, the last
    arrival, the long tail): the running sum equals the returned statistic added by torch, bit for bit."""
    slots, num_q_heads, kv_heads, head_dim, capacity = shape
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, num_q_heads // kv_heads, head_dim, capacity,
                                              seed=12, device="cuda", dtype=torch.bfloat16)
    args = dict(stat="mass", length=length, dense=False)
    out, stat, _ = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
    running = torch.rand(slots, kv_heads, capacity, device="cuda")
    want = running + stat
    out2, none, _ = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, stat_into=running, **args)
    assert none is None and torch.equal(out2, out) and torch.equal(running, want)


@needs_interpreter
@pytest.mark.parametrize("finish", ["merge", "last"])
@pytest.mark.parametrize("apart, one_pass", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("slots,kv_heads,group,head_dim,capacity,splits,chunk,stat,layer_shared", [
    (1, 2, 2, 32, 96, 3, 32, "contrib", False),  # few rows (< 4 "SMs" on CPU): merge slices; 3 statistic chunks
    (1, 3, 8, 16, 64, 4, None, "contrib", False),  # one statistic chunk (the row): its program stores the argmin
    (2, 2, 1, 32, 80, 5, 16, "mass", True),  # 3 chunks, the layer's argmin; 4 rows: two passes (not few rows)
    (1, 1, 4, 64, 150, 16, 64, "contrib", False),  # 10 splits in a 16-wide load, a capacity not a tile multiple
    (1, 2, 3, 32, 96, 4, 32, "contrib", True),  # a group not a power of two (masked lanes), the layer's argmin
    (1, 3, 2, 32, 64, 3, 32, None, False),  # attention alone: the merge kernel's (or the finish's) one pass
])
def test_merge_apart_and_one_pass_equal_the_joint_merge(monkeypatch, slots, kv_heads, group, head_dim, capacity,
                                                       splits, chunk, stat, layer_shared, apart, one_pass, finish):
    """The merge kernel's programs that only merge (``MERGE_APART``) and the one-load merge (``MERGE_ONE_PASS``,
    in the merge kernel or in the last program to arrive) give the joint, two-pass merge's output, statistic,
    argmin and write index bit for bit; votes added into a running sum (``stat_into``) too; and all agree with the
    fp32 reference."""
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed=capacity + splits)
    args = dict(stat=stat, argmin=True, sinks=1, window=3, layer_shared=layer_shared, length=length,
                num_splits=splits, block_n=16, block_stat=32, finish=finish,
                finish_chunk=chunk if finish == "merge" else None)
    vn = v.double().abs().sum(-1).float() if stat == "contrib" else None
    if stat is None:  # attention alone: the merge (or the finish) and nothing else
        args = {key: val for key, val in args.items() if key not in ("stat", "argmin", "layer_shared")}
        monkeypatch.setattr(dl, "MERGE_ONE_PASS", False)
        joint = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)[0]
        monkeypatch.setattr(dl, "MERGE_ONE_PASS", one_pass)
        out = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)[0]
        assert torch.equal(out, joint)
        ref_out = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, length=length)[0]
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
        return

    def run():
        out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, vnorm=vn, **args)
        votes = torch.full((slots, kv_heads, capacity), 0.25)
        da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, vnorm=vn, stat_into=votes, **args)
        write_idx = torch.full((slots, kv_heads), -7, dtype=torch.int64)
        da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, vnorm=vn, return_stat=False,
                            write_idx=write_idx, **args)
        return out, st, evict, votes, write_idx

    monkeypatch.setattr(dl, "MERGE_APART", False)
    monkeypatch.setattr(dl, "MERGE_ONE_PASS", False)
    joint = run()
    monkeypatch.setattr(dl, "MERGE_APART", apart)
    monkeypatch.setattr(dl, "MERGE_ONE_PASS", one_pass)
    new = run()
    for a, b in zip(new, joint):
        assert torch.equal(a, b)
    assert not da._ARRIVALS["cpu"].any()  # every arrival counter is back at zero for the next launch
    ref_out, ref_stat, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, stat=stat, argmin=True,
                                                   sinks=1, window=3, layer_shared=layer_shared, length=length)
    torch.testing.assert_close(new[0], ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(new[1], ref_stat, atol=1e-6 * float(ref_stat.abs().max()), rtol=1e-4)
    torch.testing.assert_close(new[3], ref_stat + 0.25, atol=1e-6 * float(ref_stat.abs().max()), rtol=1e-4)
    assert_argmin_ok(new[2], ref_stat, pos, cur_pos, length, 1, 3, layer_shared)


@needs_interpreter
@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("slots,kv_heads,group,head_dim,capacity,splits,finish,stat,vn,with_length,block_stat", [
    (2, 2, 2, 32, 64, 1, "epilogue", "contrib", "cache", True, 64),  # the engine's call: one split, the row whole
    (2, 2, 3, 32, 96, 1, "epilogue", "contrib", "cache", True, 32),  # 3 chunks of the finish; a group of 3
    (1, 3, 8, 16, 48, 1, "epilogue", "mass", None, True, 16),  # the mass, 8 query heads, 3 chunks
    (2, 1, 1, 32, 40, 1, "epilogue", "contrib", "dot", False, 64),  # norms folded in the logits; no length
    (1, 2, 4, 32, 80, 3, "last", "contrib", "cache", True, 32),  # the last arrival: the merge's loads first
    (2, 2, 8, 16, 64, 4, "last", "contrib", "sum", True, 64),
    (1, 2, 2, 32, 96, 5, "last", "mass", None, False, 32),
])
def test_finish_early_equals_the_finish_in_turn(monkeypatch, slots, kv_heads, group, head_dim, capacity, splits,
                                                finish, stat, vn, with_length, block_stat, one_pass):
    """The finish with every load issued at once (``FINISH_EARLY``: the length and ``cur`` from the program's
    start, the normalisers of a one-split row from the registers, the one-pass merge's loads before the
    statistic's) gives the finish in turn's output, statistic, argmin, write index and votes bit for bit, a head
    with no live slot included; and both agree with the fp32 reference."""
    q, k, v, pos, cur_pos, length = make_case(slots, kv_heads, group, head_dim, capacity, seed=capacity + splits,
                                              with_length=with_length)
    if with_length:  # a head with nothing live: its maxima are -inf, its sums 0
        length[0, 0] = 0
        pos[0, 0] = -1
    monkeypatch.setattr(dl, "MERGE_ONE_PASS", one_pass)
    args = dict(stat=stat, argmin=True, sinks=1, window=3, length=length, num_splits=splits, block_n=16,
                block_stat=block_stat, **kernel_variant(v, vn=vn or "dot", finish=finish, hints=True,
                                                        early=vn == "cache" or stat == "mass"))
    args.pop("finish_chunk")

    def run():
        out, st, evict = da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, **args)
        votes = torch.full((slots, kv_heads, capacity), 0.25)
        da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, stat_into=votes, **args)
        runs = [out, st, evict, votes]
        if with_length:
            write_idx = torch.full((slots, kv_heads), -7, dtype=torch.int64)
            da.decode_attention(q, k, v, pos, cur_pos, head_dim ** -0.5, return_stat=False, write_idx=write_idx,
                                **args)
            runs.append(write_idx)
        return runs

    monkeypatch.setattr(dl, "FINISH_EARLY", False)
    old = run()
    monkeypatch.setattr(dl, "FINISH_EARLY", True)
    new = run()
    for a, b in zip(new, old):
        assert torch.equal(a, b)
    if finish == "last":
        assert not da._ARRIVALS["cpu"].any()  # every arrival counter is back at zero for the next launch
    ref_out, ref_stat, _ = da.decode_attention_ref(q, k, v, pos, cur_pos, head_dim ** -0.5, stat=stat, argmin=True,
                                                   sinks=1, window=3, length=length)
    heads = torch.ones(slots, kv_heads, dtype=torch.bool)
    heads[0, 0] = not with_length  # the empty head: 0 here, NaN in the reference's softmax of nothing
    rows = heads.repeat_interleave(group, 1)
    torch.testing.assert_close(new[0][rows], ref_out[rows], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(new[1][heads], ref_stat[heads], atol=1e-6 * float(ref_stat[heads].abs().max()),
                               rtol=1e-4)
    assert_argmin_ok(new[2], ref_stat, pos, cur_pos, length, 1, 3, False)
    if with_length:
        assert new[4][0, 0] == 0  # nothing live: the next token is written at slot 0


def _boundary_case(target_pos, sinks, window, seed=21):
    """1 slot, 1 KV head, GQA 2, 40 tokens at positions 0..39 (shuffled), cur_pos 45: the token at ``target_pos``
    gets a key anti-aligned with both queries (by far the least attention); returns its slot too."""
    g = torch.Generator().manual_seed(seed)
    cap, d = 40, 64
    q = torch.randn(1, 2, d, generator=g)
    k = torch.randn(1, 1, cap, d, generator=g) * 0.1
    v = torch.randn(1, 1, cap, d, generator=g)
    pos = torch.randperm(cap, generator=g).to(torch.int32).view(1, 1, cap)
    cur_pos = torch.tensor([45])
    slot = int((pos[0, 0] == target_pos).nonzero())
    k[0, 0, slot] = -3.0 * (q[0, 0] + q[0, 1])
    return q, k, v, pos, cur_pos, slot


def _fp64_masked_argmin(q, k, v, pos, cur_pos, sinks, window, stat, vnorm=None):
    """Independent fp64 oracle: GQA mass (or mass x ||v||_1) per slot, argmin over sinks <= pos <= cur - window."""
    qd, kd = q.double()[0], k.double()[0, 0]
    alpha = torch.softmax(qd @ kd.T / q.shape[-1] ** 0.5, dim=-1).sum(0)
    score = alpha * (vnorm.double()[0, 0] if vnorm is not None else v.double()[0, 0].abs().sum(-1)) \
        if stat == "contrib" else alpha
    p = pos[0, 0].long()
    evictable = (p >= 0) & (p >= sinks) & (p <= int(cur_pos[0]) - window)
    return int(score.masked_fill(~evictable, float("inf")).argmin())


@needs_interpreter
@pytest.mark.parametrize("edge", ["sink", "window"])
@pytest.mark.parametrize("finish, chunk", [("merge", None), ("merge", 16), ("last", None), ("epilogue", None)])
def test_argmin_bounds_are_inclusive_at_the_sinks_and_the_window_edge(edge, finish, chunk):
    """The first token past the sinks (pos == sinks) and the newest outside the window (pos == cur - window) are
    evictable: with the least attention of the row, each must be the argmin (fp64 oracle)."""
    sinks, window = 3, 10
    target = sinks if edge == "sink" else 45 - window
    q, k, v, pos, cur_pos, slot = _boundary_case(target, sinks, window)
    want = _fp64_masked_argmin(q, k, v, pos, cur_pos, sinks, window, "mass")
    assert want == slot
    for stat in ("mass", "contrib"):
        _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, 64 ** -0.5, stat=stat, argmin=True, sinks=sinks,
                                          window=window, finish=finish, finish_chunk=chunk, num_splits=2,
                                          block_n=16, block_stat=16)
        assert evict.tolist() == [[_fp64_masked_argmin(q, k, v, pos, cur_pos, sinks, window, stat)]], (stat, evict)


@needs_interpreter
@pytest.mark.parametrize("finish, chunk", [("merge", None), ("merge", 32), ("last", None), ("epilogue", None)])
def test_argmin_ties_go_to_the_first_slot_across_blocks_and_none_evictable_is_zero(finish, chunk):
    """Exact ties (cached norms 0: statistic 0) in the same lane of different ``block_stat`` blocks: the first
    slot wins, as torch.argmin; and no evictable slot over several blocks gives 0."""
    q, k, v, pos, cur_pos, _ = make_case(1, 2, 2, 64, 70, seed=5, holes=0.0, with_length=False)
    vnorm = v.double().abs().sum(-1).float()
    tied = [3, 19, 35, 51]  # lane 3 of blocks 0..3 (block_stat 16)
    vnorm[..., tied] = 0.0
    pos[..., tied] = (cur_pos[0] - 40).int()  # evictable (outside the window of 4, past no sinks)
    args = dict(stat="contrib", argmin=True, window=4, vnorm=vnorm, finish=finish, finish_chunk=chunk,
                num_splits=1 if finish == "epilogue" else 2, block_n=16, block_stat=16)
    _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, **args)
    assert evict.tolist() == [[3, 3]]
    _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, layer_shared=True, **args)
    assert evict.tolist() == [[3]]
    args["window"] = 10 ** 6  # nothing evictable, 70 tokens over 5 blocks
    _, _, evict = da.decode_attention(q, k, v, pos, cur_pos, 0.125, **args)
    assert evict.tolist() == [[0, 0]]
