"""The in-place compaction kernel against the torch reference, and the cache's kernel path against its torch path.

CPU (CI): the Triton kernel runs under ``TRITON_INTERPRET=1`` on fp32, fp16 and bf16 (pure data movement:
bitwise equality) over odd capacities, slot subsets and per-head live counts. GPU (``gpu``): bf16 at the engine's
shape, where the block-internal overlaps need the kernel's barrier. The engine checks (every periodic policy) run
the kernel only for compaction, so they compare generations bitwise and also check that each policy lists its
kept tokens in ascending slot order (the order the kernel lays them out in).
"""
import os

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import compact as ck
from kvroll.rollout.cache import CompressedKVCache
from tests.conftest import needs_interpreter
from tests.rollout.test_engine import random_prompts

interpret = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(ck.triton is None or not (torch.cuda.is_available() or interpret),
                                  reason="needs Triton on a GPU or TRITON_INTERPRET=1")


def make_buffers(num_slots, heads, capacity, head_dim, dtype, vnorm, seed, device="cpu"):
    """Random k, v [S, Hkv, C, D], unique positions [S, Hkv, C] int32 and vnorm [S, Hkv, C] fp32 (or None)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, heads, capacity, head_dim, generator=g).to(dtype)
    v = torch.randn(num_slots, heads, capacity, head_dim, generator=g).to(dtype)
    pos = torch.randperm(num_slots * heads * capacity, generator=g).view(num_slots, heads, capacity).int()
    norms = v.float().abs().sum(-1) if vnorm else None
    return [t.to(device) if t is not None else None for t in (k, v, pos, norms)]


def make_keep(n, heads, capacity, kept, seed, ragged=True, device="cpu"):
    """A policy-like keep list [n, Hkv, K] of distinct slots: the live part (the first keep_count) ascending, the
    tail past it unsorted (as Hard-KV's kept-first order leaves it); keep_count [n, Hkv], some heads keeping
    fewer (one of them none) when ``ragged``."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.stack([torch.randperm(capacity, generator=g)[:kept] for _ in range(n * heads)]).view(n, heads, kept)
    count = torch.full((n, heads), kept)
    if ragged:
        count = torch.randint(0, kept + 1, (n, heads), generator=g)
        count.view(-1)[:2] = torch.tensor([kept, 0])[: count.numel()]
    live = torch.arange(kept) < count[..., None]
    keep = torch.where(live, torch.where(live, keep, capacity).sort(-1).values, keep)
    return keep.to(device), count.to(device)


def check_against_reference(before, after, slots, keep, count):
    """Kernel results ``after`` vs the reference on ``before`` (bitwise): equal on the live rows of the compacted
    slots and on pos everywhere; every other K/V/vnorm row untouched (dead rows included)."""
    ref = [t.clone() if t is not None else None for t in before]
    ck.gather_to_front_torch(*ref, slots, keep, count)
    capacity = before[2].shape[-1]
    moved = torch.zeros(before[2].shape, dtype=torch.bool, device=before[2].device)
    moved[slots] = torch.arange(capacity, device=moved.device) < count[..., None]
    assert torch.equal(after[2], ref[2]), "pos"
    for name, got, want, orig in zip(("k", "v", "vnorm"), after[:2] + after[3:], ref[:2] + ref[3:],
                                     before[:2] + before[3:]):
        if got is not None:
            assert torch.equal(got[moved], want[moved]), name
            assert torch.equal(got[~moved], orig[~moved]), name


CASES = [  # num_slots, heads, capacity, head_dim, slots, kept, dtype, vnorm, block_j
    (5, 3, 37, 64, [4, 1, 2], 30, torch.float32, True, None),
    (4, 2, 75, 128, [3, 0], 75, torch.float32, False, 16),  # K = capacity
    (3, 1, 50, 64, [1], 17, torch.float16, True, 4),
    (6, 2, 33, 128, [5, 2, 0, 3], 33, torch.float16, False, None),
    (3, 2, 21, 64, [2, 0], 19, torch.bfloat16, True, 8),
]


@needs_triton
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("ragged", [False, True])
def test_kernel_equals_reference(case, ragged):
    num_slots, heads, capacity, head_dim, slots, kept, dtype, vnorm, block_j = case
    device = "cuda" if not interpret else "cpu"
    before = make_buffers(num_slots, heads, capacity, head_dim, dtype, vnorm, seed=capacity, device=device)
    slots = torch.tensor(slots, device=device)
    keep, count = make_keep(len(slots), heads, capacity, kept, seed=kept, ragged=ragged, device=device)
    after = [t.clone() if t is not None else None for t in before]
    ck.gather_to_front(*after, slots, ck.ascending_keep(keep, count, capacity), count, block_j=block_j)
    check_against_reference(before, after, slots, keep, count)


@needs_triton
@pytest.mark.parametrize("case", CASES)
def test_hole_fill_order_in_place_equals_reference(case):
    """Hard-KV's hole-filling order (``hole_fill_slots``: slot j below the count stays if kept, else takes the next
    kept slot past the count), passed to the kernel unsorted as ``compact(ascending=True)`` passes it: the same
    cache as the reference's gather through a temporary."""
    from kvroll.policies.base import hole_fill_slots

    num_slots, heads, capacity, head_dim, slots, kept, dtype, vnorm, block_j = case
    device = "cuda" if not interpret else "cpu"
    before = make_buffers(num_slots, heads, capacity, head_dim, dtype, vnorm, seed=capacity + 1, device=device)
    slots = torch.tensor(slots, device=device)
    keep_list, count = make_keep(len(slots), heads, capacity, kept, seed=kept + 1, device=device)
    live = torch.arange(kept, device=device) < count[..., None]
    mask = torch.zeros(len(slots), heads, capacity + 1, dtype=torch.bool, device=device)
    mask.scatter_(-1, torch.where(live, keep_list, capacity).long(), True)
    keep, n = hole_fill_slots(mask[..., :capacity], kept)
    assert torch.equal(n, count) and (keep[..., : 1] >= 0).all()
    assert bool(((keep != torch.arange(kept, device=device)) & live).any())  # some tokens move
    after = [t.clone() if t is not None else None for t in before]
    ck.gather_to_front(*after, slots, keep.to(torch.int32).contiguous(), count, block_j=block_j)
    check_against_reference(before, after, slots, keep, count)


@needs_triton
@pytest.mark.parametrize("block_j", [1, 4, 64])
def test_sources_inside_their_own_block(block_j):
    """keep_idx[j] = j + 1 and j + 2: every source is a destination of the same block (or the next)."""
    device = "cuda" if not interpret else "cpu"
    before = make_buffers(2, 2, 41, 64, torch.float32, True, seed=5, device=device)
    slots = torch.tensor([1, 0], device=device)
    keep = torch.stack([torch.arange(1, 40), torch.arange(2, 41)])[None].expand(2, -1, -1).contiguous()
    count = torch.tensor([[39, 30], [12, 0]])
    keep, count = keep.to(device), count.to(device)
    after = [t.clone() for t in before]
    ck.gather_to_front(*after, slots, ck.ascending_keep(keep, count, 41), count, block_j=block_j)
    check_against_reference(before, after, slots, keep, count)


def test_ascending_keep_keeps_the_sets():
    keep, count = make_keep(3, 4, 29, 20, seed=1)
    shuffled = keep.clone()
    for i in range(3):
        for h in range(4):
            c = int(count[i, h])
            shuffled[i, h, :c] = keep[i, h, torch.randperm(c)]
    out = ck.ascending_keep(shuffled, count, 29)
    assert out.dtype == torch.int32
    assert torch.equal(out, torch.where(torch.arange(20) < count[..., None], keep, 29).int())


@needs_interpreter
@pytest.mark.parametrize("shuffle", [False, True])
def test_cache_compact_kernel_path_equals_torch_path(shuffle):
    """``compact`` on CPU with ``kernel_on_cpu``: same positions, counts, write slots and live rows as the torch
    path given the ascending keep list, also when the kernel path gets the live part shuffled (it sorts)."""
    policy = CompressionConfig("longflow", budget=16).build()  # "contrib": vnorm moves too
    keep, count = make_keep(2, 3, 19, 14, seed=3)
    shuffled = keep.clone()
    for i, h in [(0, 0), (0, 2), (1, 1)]:
        c = int(count[i, h])
        shuffled[i, h, :c] = keep[i, h, torch.randperm(c, generator=torch.Generator().manual_seed(c))]
    assert shuffle is False or not torch.equal(shuffled, keep)
    caches = []
    for kernel in (False, True):
        cache = CompressedKVCache(2, 4, 3, 19, 16, torch.float32, "cpu", policy, 16, 0.25)
        cache.kernel_on_cpu = kernel
        k, v, pos, vnorm = make_buffers(2 * 4, 3, 19, 16, torch.float32, True, seed=2)
        for name, t in (("k", k), ("v", v), ("pos", pos), ("vnorm", vnorm)):
            getattr(cache, name).copy_(t.view(getattr(cache, name).shape))
        cache.compact(1, torch.tensor([3, 1]), shuffled if kernel and shuffle else keep, count)
        caches.append(cache)
    torch_path, kernel_path = caches
    for name in ("pos", "count", "write_idx"):
        assert torch.equal(getattr(kernel_path, name), getattr(torch_path, name)), name
    live = kernel_path.pos >= 0
    for name in ("k", "v", "vnorm"):
        assert torch.equal(getattr(kernel_path, name)[live], getattr(torch_path, name)[live]), name


PERIODIC = [  # policy, budget, hyperparameters: small enough for several compressions in 60 tokens
    ("rkv", 24, dict(buffer=8, window=4)),
    ("snapkv", 24, dict(buffer=8, window=4)),
    ("lagkv", 28, dict(sink_tokens=4, lag=6)),
    ("hardkv", 24, dict(interval=8, window=4, sink_tokens=2)),
]


@needs_interpreter
@pytest.mark.parametrize("policy,budget,kwargs", PERIODIC)
def test_periodic_policy_generates_the_same_with_the_compaction_kernel(tiny_llama, monkeypatch, policy, budget,
                                                                       kwargs):
    """Only compaction runs the kernel (decode stays on torch), so generations must agree bitwise; and every
    keep list the policy hands ``compact`` is strictly ascending below its count, so the kernel's sorted layout
    is the policy's own (Hard-KV's attention base: in ``hole_fill_slots``'s order, each entry below the count the
    slot itself or one at or past the count, which the kernel takes unsorted)."""
    compact, calls = CompressedKVCache.compact, {False: [], True: []}

    def compact_recording(self, layer, slots, keep_idx, keep_count=None, ascending=False):
        count = keep_count if keep_count is not None else torch.full(keep_idx.shape[:2], keep_idx.shape[-1])
        if getattr(self.policy, "fills_holes", False):
            j = torch.arange(keep_idx.shape[-1])
            live = j < count[..., None]
            assert torch.all((keep_idx == j) | (keep_idx >= count[..., None]) | ~live), "not a hole-filling order"
            assert ascending
        else:
            live = torch.arange(keep_idx.shape[-1] - 1) < count[..., None] - 1  # pairs (j, j + 1) below count
            assert torch.all((keep_idx.diff(dim=-1) > 0) | ~live), "the live keep list is not ascending"
        calls[kernel].append((slots.tolist(), ascending))
        self.kernel_on_cpu = kernel
        try:
            compact(self, layer, slots, keep_idx, keep_count, ascending)
        finally:
            del self.kernel_on_cpu  # back to the class default: decode stays on torch

    monkeypatch.setattr(CompressedKVCache, "compact", compact_recording)
    prompts = random_prompts(5, 256, 10, 40, seed=11)
    params = SamplingParams(max_new_tokens=60, temperature=0.8, seed=5)
    runs = []
    for kernel in (False, True):
        engine = RolloutEngine(tiny_llama, compression=CompressionConfig(policy, budget, **kwargs), max_batch=3)
        runs.append((engine.generate(prompts, params, n=2), engine.cache))
    assert len(calls[True]) >= 8 and calls[True] == calls[False]
    assert all(ascending for _, ascending in calls[True]), "every built-in policy keeps in time order: no sort"
    (torch_out, torch_cache), (kernel_out, kernel_cache) = runs
    assert [r.token_ids for r in kernel_out] == [r.token_ids for r in torch_out]
    assert [r.logprobs for r in kernel_out] == [r.logprobs for r in torch_out]
    assert torch.equal(kernel_cache.pos, torch_cache.pos) and torch.equal(kernel_cache.count, torch_cache.count)
    live = torch_cache.pos >= 0
    assert torch.equal(kernel_cache.k[live], torch_cache.k[live])
    assert torch.equal(kernel_cache.v[live], torch_cache.v[live])


@pytest.mark.gpu
@pytest.mark.parametrize("ragged", [False, True])
def test_bf16_engine_shape_on_gpu(ragged):
    """bf16 at an engine-like shape (D = 128, capacity 1152, keep 1024) with the default blocks, plus the case
    where every source is in its own block (only the barrier orders those loads before the stores)."""
    before = make_buffers(12, 8, 1152, 128, torch.bfloat16, True, seed=7, device="cuda")
    slots = torch.tensor([11, 3, 4, 0, 7, 8, 9, 1, 2], device="cuda")
    keep, count = make_keep(len(slots), 8, 1152, 1024, seed=8, ragged=ragged, device="cuda")
    keep[0, 0] = torch.arange(1, 1025, device="cuda")  # a shift by one: sources = the next destination
    count[0, 0] = 1024
    after = [t.clone() for t in before]
    ck.gather_to_front(*after, slots, ck.ascending_keep(keep, count, 1152), count)
    torch.cuda.synchronize()
    check_against_reference(before, after, slots, keep, count)
