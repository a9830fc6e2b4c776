"""The cache's invariants that the fused decode kernel relies on (checked on CPU, where the kernel is not used).

``vnorm`` (the cached ||v||_1 the kernel reads for LongFlow's statistic) must equal the norm of the values the
cache holds after every write path: decode updates, prompt placement, slot moves, compaction; and slots below
``count`` must be live (the kernel's ``dense`` promise).
"""
import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.cache import CompressedKVCache
from tests.rollout.test_engine import random_prompts


def assert_vnorm_matches_values(cache):
    expected = cache.v.double().abs().sum(-1).float()  # [L, S, Hkv, C], computed independently
    torch.testing.assert_close(cache.vnorm, expected, rtol=1e-6, atol=0.0)


def test_engine_keeps_vnorm_and_dense_live_slots(tiny_llama):
    # prompts longer than the budget (compressed placement), more prompts than slots (refills, slot moves)
    prompts = random_prompts(5, 256, 10, 60, seed=7)
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("longflow", budget=24), max_batch=3)
    engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0.0), n=2)
    cache = engine.cache
    assert cache.vnorm is not None and cache.vnorm.shape == cache.pos.shape
    assert_vnorm_matches_values(cache)
    below_count = torch.arange(cache.capacity) < cache.count[..., None]
    assert torch.equal(cache.pos >= 0, below_count)
    view = cache.slot_view(2)
    assert view.vnorm.shape[1] == 2 and view.vnorm.data_ptr() == cache.vnorm.data_ptr()


def test_compact_and_move_slot_carry_vnorm():
    policy = CompressionConfig("longflow", budget=16).build()
    cache = CompressedKVCache(2, 3, 2, 16, 8, torch.float32, "cpu", policy, 16, 8 ** -0.5)
    assert CompressedKVCache(1, 1, 1, 4, 8, torch.float32, "cpu", CompressionConfig("full").build(), None,
                             1.0).vnorm is None  # only the "contrib" statistic uses it
    cache.v.normal_(generator=torch.Generator().manual_seed(0))
    cache.vnorm.copy_(cache.v.abs().sum(-1))
    cache.pos.copy_(torch.arange(16, dtype=torch.int32))
    cache.count.fill_(16)
    keep_idx = torch.stack([torch.randperm(16)[:10] for _ in range(2 * 2)]).view(2, 2, 10)
    cache.compact(1, torch.tensor([0, 2]), keep_idx, torch.tensor([[10, 7], [9, 10]]))
    assert_vnorm_matches_values(cache)
    cache.move_slot(2, 1)
    assert_vnorm_matches_values(cache)
    assert torch.equal(cache.vnorm[:, 1], cache.vnorm[:, 2])



def test_compact_moves_exactly_the_kept_tokens_of_the_named_slots():
    """compact against a naive per-(slot, head) loop, on a subset of slots, with per-head live counts."""
    torch.manual_seed(0)
    policy = CompressionConfig("longflow", budget=16).build()  # "contrib": the cache keeps vnorm too
    cache = CompressedKVCache(2, 4, 3, 11, 8, torch.float32, "cpu", policy, 16, 0.35)
    cache.k.normal_(), cache.v.normal_()
    cache.pos.copy_(torch.randperm(2 * 4 * 3 * 11).view(2, 4, 3, 11).int())
    cache.vnorm.copy_(cache.v.abs().sum(-1))
    before = {name: getattr(cache, name).clone() for name in ("k", "v", "pos", "vnorm")}
    slots = torch.tensor([3, 1])
    keep_idx = torch.stack([torch.randperm(11)[:6].sort().values for _ in range(2 * 3)]).view(2, 3, 6)
    keep_count = torch.tensor([[6, 4, 5], [2, 6, 6]])
    cache.compact(1, slots, keep_idx, keep_count)
    for name in ("k", "v", "pos", "vnorm"):
        want = before[name].clone()
        for i, slot in enumerate(slots.tolist()):
            for h in range(3):
                want[1, slot, h, :6] = before[name][1, slot, h, keep_idx[i, h]]
                if name == "pos":
                    want[1, slot, h, int(keep_count[i, h]):] = -1
        assert torch.equal(getattr(cache, name), want), name  # other slots and layer 0 untouched
    assert cache.count[1, slots].tolist() == keep_count.tolist()


def test_compress_slots_on_a_contiguous_range_reads_views_and_equals_gathers():
    """compress_slots sets ``event_span`` for contiguous ascending slots (the policies then read views of their
    rows, not gathered copies); rkv and hardkv keep exactly what the gathering path keeps."""
    from kvroll.rollout.cache import contiguous_span

    assert contiguous_span(torch.tensor([2, 3, 4])) == slice(2, 5)
    assert contiguous_span(torch.tensor([4])) == slice(4, 5)
    assert contiguous_span(torch.tensor([1, 3])) is None and contiguous_span(torch.tensor([3, 2])) is None
    for name, kwargs in [("rkv", dict(buffer=8, window=4)), ("hardkv", dict(interval=8, window=4, sink_tokens=2))]:
        caches, spans = [], []
        for _ in range(2):
            policy = CompressionConfig(name, budget=16, **kwargs).build()
            policy.num_q_heads = 4
            cap = policy.capacity(16, 0)
            cache = CompressedKVCache(2, 4, 2, cap, 8, torch.float32, "cpu", policy, 16, 8 ** -0.5)
            gen = torch.Generator().manual_seed(1)
            cache.k.normal_(generator=gen), cache.v.normal_(generator=gen)
            cache.pos.copy_(torch.arange(cap, dtype=torch.int32))
            cache.count.fill_(cap)
            cache.cur_pos.fill_(cap)
            for state in cache.state.values():
                if state.is_floating_point():
                    state.copy_(torch.rand(state.shape, generator=gen))
            caches.append(cache)
        slots = torch.tensor([1, 2, 3])
        compress = caches[0].policy.compress
        caches[0].policy.compress = lambda c, layer, s: (spans.append((c.event_span, layer)),
                                                         compress(c, layer, s))[1]
        caches[0].layer_batch_rows = 0  # layer by layer: a call of one layer reads the span's rows as views
        caches[0].compress_slots(slots)  # views
        for layer in range(2):  # the gathering path: no event_span
            keep_idx, keep_count = caches[1].policy.compress(caches[1], layer, slots)
            caches[1].compact(layer, slots, keep_idx, keep_count)
        # (layer-batched calls of several layers gather their rows: tests/kernels/test_layer_batched_events.py)
        assert spans == [(slice(1, 4), 0), (slice(1, 4), 1)] and caches[0].event_span is None
        for field in ("k", "v", "pos", "count"):
            assert torch.equal(getattr(caches[0], field), getattr(caches[1], field)), (name, field)
        assert not torch.equal(caches[0].pos[:, 0], caches[0].pos[:, 1])  # slot 0 untouched, the others compacted


def test_compress_slots_of_no_slots_changes_nothing():
    """An empty slot list (host list or device tensor) is a no-op: no policy call, the cache unchanged."""
    policy = CompressionConfig("rkv", budget=16, buffer=8, window=4).build()
    policy.num_q_heads = 4
    cap = policy.capacity(16, 0)
    cache = CompressedKVCache(2, 4, 2, cap, 8, torch.float32, "cpu", policy, 16, 8 ** -0.5)
    cache.k.normal_(generator=torch.Generator().manual_seed(0))
    cache.pos.copy_(torch.arange(cap, dtype=torch.int32))
    cache.count.fill_(cap)
    before = {field: getattr(cache, field).clone() for field in ("k", "v", "pos", "count", "write_idx")}
    calls = []
    cache.policy.compress = lambda *args: calls.append(args)
    for empty in ([], (), torch.empty(0, dtype=torch.int64)):
        cache.compress_slots(empty)
    assert calls == [] and cache.event_span is None
    for field, want in before.items():
        assert torch.equal(getattr(cache, field), want), field


@pytest.mark.skipif(__import__("kvroll.rollout.cache").rollout.cache.triton is None, reason="the chain needs Triton")
def test_the_chain_signal_rules_see_the_caches_shape(monkeypatch):
    """A chained decode step asks ``pdl_gemm.rotary_signal_late`` (``rotary_write``) and ``attention_pdl``
    (``attend``) about the same rows: the cache's (or its slot view's) slots, its KV heads and query heads per KV
    head (here 4, not the usual 2), and hands the rotary the late signal only with its PDL launch. The rules
    themselves: tests/kernels/test_pdl_gemm.py."""
    import kvroll.rollout.cache as cache_module
    from kvroll.kernels import rotary as rot

    class Stop(Exception):
        pass

    asked, launched = [], []

    def rule(name, answer):
        def ask(slots, kv_heads, group):
            asked.append((name, slots, kv_heads, group))
            if name == "attention":
                raise Stop  # the decode kernel is not run here
            return answer
        return ask

    monkeypatch.setattr(cache_module, "rotary_signal_late", rule("rotary", True))
    monkeypatch.setattr(cache_module, "attention_pdl", rule("attention", True))
    monkeypatch.setattr(rot, "rotary", lambda q, k, cos, sin, write=None, pdl=False, late_signal=False, **norms:
                        launched.append((pdl, late_signal)) or (q, None))
    monkeypatch.setattr(CompressedKVCache, "kernel_on_cpu", True)
    policy = CompressionConfig("longflow", budget=16).build()
    cache = CompressedKVCache(2, 6, 2, 16, 16, torch.float32, "cpu", policy, 16, 16 ** -0.5)  # head dim 16: tiled
    for view, slots in ((cache, 6), (cache.slot_view(4), 4)):
        asked.clear()
        launched.clear()
        q, k, v = torch.zeros(slots, 1, 8, 16), torch.zeros(slots, 1, 2, 16), torch.zeros(slots, 1, 2, 16)
        cos = sin = torch.ones(slots, 1, 16)
        view.rotary_write(1, q, k, v, cos, sin)  # a plain launch: no rule asked, no late signal
        view.rotary_write(1, q, k, v, cos, sin, pdl=True)
        assert launched == [(False, False), (True, True)]
        with pytest.raises(Stop):
            view.attend(1, q[:, 0])
        assert asked == [("rotary", slots, 2, 4), ("attention", slots, 2, 4)]
