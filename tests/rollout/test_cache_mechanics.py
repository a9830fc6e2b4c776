"""The static cache's mechanics against a naive reference (CPU path): a dict per (layer, slot, head) of
position -> (key, value) that places prompts, appends, evicts by the policy's rule, compresses and moves slots.

After every operation the cache's live (position, K, V) sets equal the reference's, positions never repeat,
the slots below ``count`` are the live ones (the kernel's ``dense`` promise), sinks and the protected window
are never evicted, and ``kv_bytes`` is the buffers' real size. Plus the helpers' exact contracts on small cases.
"""
import random

import pytest
import torch

from kvroll import CompressionConfig
from kvroll.policies.base import ascending_slots, evictable_mask, hole_fill_slots, layer_slot_index
from kvroll.policies.window import candidate_mask, keep_top_and_recent, ring_read
from kvroll.rollout.cache import CompressedKVCache
from kvroll.rollout.graphs import DecodeRunner, batch_sizes

D = 4


def live_entries(cache, layer, slot, head):
    """{pos: (k, v)} of one row, asserting no duplicate positions and live exactly below count."""
    out, count = {}, int(cache.count[layer, slot, head])
    for c in range(cache.capacity):
        p = int(cache.pos[layer, slot, head, c])
        assert (p >= 0) == (c < count), (layer, slot, head, c, p, count)
        if p >= 0:
            assert p not in out, ("duplicate position", layer, slot, head, p)
            out[p] = (cache.k[layer, slot, head, c], cache.v[layer, slot, head, c])
    return out


def assert_matches(cache, ref):
    for (layer, slot, head), want in ref.items():
        got = live_entries(cache, layer, slot, head)
        assert sorted(got) == sorted(want), (layer, slot, head, sorted(got), sorted(want))
        for p, (k, v) in want.items():
            assert torch.equal(got[p][0], k) and torch.equal(got[p][1], v), (layer, slot, head, p)
    if cache.vnorm is not None:
        live = cache.pos >= 0
        torch.testing.assert_close(cache.vnorm[live], cache.v.abs().sum(-1)[live])
    real = sum(t.numel() * t.element_size() for t in (cache.k, cache.v))
    assert cache.kv_bytes() == real


def prefilled(cache, length, gen):
    """A prompt of ``length`` tokens through the prefill path (store_prompt, take_prompt)."""
    q = torch.randn(1, 2 * cache.num_kv_heads, length, D, generator=gen)
    k = torch.randn(cache.num_layers, 1, cache.num_kv_heads, length, D, generator=gen)
    v = torch.randn(cache.num_layers, 1, cache.num_kv_heads, length, D, generator=gen)
    cache.mode, cache.prompt_lengths = "prefill", None
    for layer in range(cache.num_layers):
        cache.store_prompt(layer, q, k[layer], v[layer])
    cache.mode = "decode"
    return cache.take_prompt(length)


CASES = [  # (policy, kwargs, budget): budgets at their minimum (sinks + window + 1) and a little above
    ("streaming", dict(sink_tokens=2), 4),
    ("streaming", dict(sink_tokens=0), 5),
    ("random", {}, 3),
    ("longflow", dict(granularity="layer", sink_tokens=2, window=2), 5),
    ("longflow", dict(sink_tokens=1, window=3), 7),
    ("h2o", dict(sink_tokens=1, window=2), 4),
    ("rkv", dict(buffer=3, window=2), 3),
    ("snapkv", dict(buffer=2, window=2), 5),
    ("lagkv", dict(sink_tokens=2, lag=2), 9),
    ("hardkv", dict(interval=4, window=2, sink_tokens=2, min_keep=1), 7),
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name,kwargs,budget", CASES)
def test_random_operations_match_a_naive_reference(name, kwargs, budget, seed):
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    layers, slots, heads = 2, rng.randint(1, 4), rng.choice([1, 2, 3, 4])
    policy = CompressionConfig(name, budget=budget, **kwargs).build()
    policy.num_q_heads = 2 * heads
    capacity = policy.capacity(budget, 0)
    cache = CompressedKVCache(layers, slots, heads, capacity, D, torch.float32, "cpu", policy, budget, D ** -0.5)
    sinks, window = policy.protected()
    rows = [(layer, s, h) for layer in range(layers) for s in range(slots) for h in range(heads)]
    ref = {row: {} for row in rows}
    ops = ["place"] * slots + ["step"] * 25 + ["move"] * 3  # every slot starts from a prompt, some past the budget
    for op in [f"place{s}" for s in range(slots)] + [rng.choice(ops) for _ in range(30)]:
        if op.startswith("place"):
            slot = int(op[5:]) if op != "place" else rng.randrange(slots)
            length = rng.randint(1, 2 * budget + 3)
            prompt = prefilled(cache, length, gen)
            cache.place(slot, prompt)
            for layer in range(layers):
                for h in range(heads):
                    ref[layer, slot, h] = {int(p): (k, v) for p, k, v in
                                           zip(prompt.pos[layer, h], prompt.k[layer, h], prompt.v[layer, h])}
                    assert length - 1 in ref[layer, slot, h]  # the prompt's last token is always kept
                    assert len(ref[layer, slot, h]) <= min(length, cache.prefill_limit())
        elif op == "move" and slots > 1:
            src, dst = rng.sample(range(slots), 2)
            cache.move_slot(src, dst)
            for layer in range(layers):
                for h in range(heads):
                    ref[layer, dst, h] = dict(ref[layer, src, h])
        elif op == "step":
            if policy.periodic:  # the engine compresses every due slot before a step
                due = [s for s in range(slots) if bool(cache.due_for_compression()[s])]
                if due:
                    cache.compress_slots(due)
                    for (layer, s, h) in rows:
                        if s in due:
                            got = live_entries(cache, layer, s, h)
                            newest = sorted(ref[layer, s, h])[-window:]
                            assert set(newest) <= set(got) <= set(ref[layer, s, h]), (newest, sorted(got))
                            ref[layer, s, h] = {p: ref[layer, s, h][p] for p in got}
                            order = cache.pos[layer, s, h, :len(got)].tolist()
                            assert not cache.time_ordered or order == sorted(order), order
            cur = cache.cur_pos.clone()
            for layer in range(layers):
                key, value = torch.randn(slots, heads, 1, D, generator=gen), torch.randn(slots, heads, 1, D, generator=gen)
                old_pos, write_idx = cache.pos[layer].clone(), cache.write_idx[layer].clone()
                cache.update(key, value, layer)
                for s in range(slots):
                    for h in range(heads):
                        row = ref[layer, s, h]
                        if len(row) >= capacity:  # a step policy overwrites the victim it chose last step
                            victim = int(old_pos[s, h, write_idx[s, h]])
                            assert victim in row and victim >= sinks and victim <= int(cur[s]) - 1 - window, victim
                            if name == "streaming":
                                assert victim == min(p for p in row if p >= sinks)  # the oldest non-sink
                            del row[victim]
                        assert int(cur[s]) not in row
                        row[int(cur[s])] = (key[s, h, 0], value[s, h, 0])
                cache.attend(layer, torch.randn(slots, 2 * heads, D, generator=gen))
            cache.cur_pos += 1
        assert_matches(cache, ref)


def test_a_compaction_keeping_every_slot_leaves_a_writable_index():
    """keep_count == capacity: count is capacity and the next append writes the last slot, not one past it."""
    policy = CompressionConfig("rkv", budget=4, buffer=2, window=2).build()
    policy.num_q_heads = 2
    cache = CompressedKVCache(1, 2, 1, 6, D, torch.float32, "cpu", policy, 4, 0.5)
    cache.pos[:] = torch.arange(6, dtype=torch.int32)
    cache.count.fill_(6)
    cache.compact(0, torch.tensor([1]), torch.arange(6).view(1, 1, 6))
    assert cache.count[0, 1].tolist() == [6] and cache.write_idx[0, 1].tolist() == [5]


def test_kv_and_metadata_bytes_are_the_buffers_sizes():
    policy = CompressionConfig("h2o", budget=8).build()
    cache = CompressedKVCache(3, 5, 2, 7, D, torch.bfloat16, "cpu", policy, 8, 0.5)
    assert cache.kv_bytes() == 2 * 3 * 5 * 2 * 7 * D * 2
    meta = 3 * 5 * 2 * 7 * 4 + 2 * (3 * 5 * 2 * 8) + 5 * 8 + 3 * 5 * 2 * 7 * 4  # pos, count/write_idx, cur_pos, acc
    assert cache.metadata_bytes() == meta


def test_steps_until_due_is_the_fullest_row():
    policy = CompressionConfig("rkv", budget=4, buffer=2, window=2).build()
    policy.num_q_heads = 2
    cache = CompressedKVCache(2, 2, 2, 6, D, torch.float32, "cpu", policy, 4, 0.5)
    cache.count[0, 0, 0], cache.count[1, 0, 1], cache.count[0, 1, 1] = 5, 2, 4
    assert cache.steps_until_due().tolist() == [1, 2]


def test_a_list_of_slots_is_a_span_only_when_contiguous():
    policy = CompressionConfig("rkv", budget=4, buffer=2, window=2).build()
    policy.num_q_heads = 2
    cache = CompressedKVCache(1, 4, 1, 6, D, torch.float32, "cpu", policy, 4, 0.5)
    assert cache._slot_index([1, 2, 3])[0] == slice(1, 4)
    span, index = cache._slot_index([0, 2])
    assert span is None and index.tolist() == [0, 2]


def test_evictable_mask_bounds():
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5, 6, -1]]], dtype=torch.int32)
    mask = evictable_mask(pos, torch.tensor([6]), sinks=2, window=2)  # protects 0, 1 and 5, 6 (the current)
    assert mask.int().tolist() == [[[0, 0, 1, 1, 1, 0, 0, 0]]]


def test_compaction_orders_against_a_loop():
    gen = torch.Generator().manual_seed(0)
    for capacity in (1, 2, 5, 9):
        keep = torch.rand(64, capacity, generator=gen) < 0.5
        width = capacity
        holes, n = hole_fill_slots(keep, width)
        ordered, n2 = ascending_slots(keep, width)
        for r in range(64):
            kept = [j for j in range(capacity) if keep[r, j]]
            tails = iter(j for j in kept if j >= len(kept))
            want = [j if keep[r, j] else next(tails) for j in range(len(kept))] + [capacity - 1] * (width - len(kept))
            assert holes[r].tolist() == want and ordered[r].tolist() == kept + [capacity - 1] * (width - len(kept))
            assert int(n[r]) == int(n2[r]) == len(kept)


def test_layer_slot_index_of_a_slot_view_keeps_the_full_stride():
    t = torch.zeros(3, 5, 2)
    assert layer_slot_index(t[:, :2], slice(1, 3), torch.tensor([0, 1])).tolist() == [5, 6, 10, 11]


def test_window_helpers_bounds():
    pos = torch.tensor([[[0, 1, 2, 3, 4, 5]]], dtype=torch.int32)
    cur = torch.tensor([6])
    assert candidate_mask(pos, cur, 2).int().tolist() == [[[1, 1, 1, 1, 0, 0]]]
    scores = torch.tensor([[[0.0, 9.0, 1.0, 8.0, 0.0, 0.0]]])
    shuffled = torch.tensor([[[5, 3, 1, 4, 0, 2]]], dtype=torch.int32)  # a row not in time order
    keep = keep_top_and_recent(scores[..., [5, 3, 1, 4, 0, 2]], shuffled, cur, 4, 2)
    assert shuffled.gather(-1, keep).tolist() == [[[1, 3, 4, 5]]]  # top 2 candidates + 2 newest, ascending time

    class Cache:
        state = {"queries": torch.arange(4.0).view(1, 1, 4, 1, 1).expand(1, 1, 4, 1, 1).clone()}
        cur_pos = torch.tensor([6])
    assert ring_read(Cache, 0, torch.tensor([0]), 3).flatten().tolist() == [3.0, 0.0, 1.0]  # positions 3, 4, 5


def test_batch_sizes_and_buckets():
    assert batch_sizes(1) == [1] and batch_sizes(4) == [1, 2, 4] and batch_sizes(6) == [1, 2, 4, 6]
    runner = DecodeRunner.__new__(DecodeRunner)
    runner.sizes = batch_sizes(6)
    assert [runner.bucket(n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


@pytest.mark.parametrize("name,kwargs,budget", [("h2o", {}, 8), ("lagkv", dict(sink_tokens=2, lag=2), 9),
                                                ("hardkv", dict(interval=4, window=2, sink_tokens=2, min_keep=1), 7)])
def test_move_slot_carries_the_policy_state(name, kwargs, budget):
    policy = CompressionConfig(name, budget=budget, **kwargs).build()
    policy.num_q_heads = 2
    cache = CompressedKVCache(2, 3, 1, policy.capacity(budget, 0), D, torch.float32, "cpu", policy, budget, 0.5)
    assert cache.state
    for t in cache.state.values():
        t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype))
    before = {key: t.clone() for key, t in cache.state.items()}
    cache.move_slot(2, 0)
    for key, t in cache.state.items():
        dim = cache._slot_dim(t)
        assert torch.equal(t.select(dim, 0), before[key].select(dim, 2)), key
        assert torch.equal(t.select(dim, 1), before[key].select(dim, 1)), key


def test_a_prompt_keep_past_the_capacity_still_leaves_a_write_slot():
    """store_prompt keeps at most capacity - 1 tokens whatever the policy's prompt_keep, so the first decode
    write after ``place`` lands inside the buffer."""
    policy = CompressionConfig("streaming", budget=6, sink_tokens=1).build()
    policy.prompt_keep = lambda budget: 100  # a policy keeping more than its capacity at prefill
    cache = CompressedKVCache(1, 1, 1, 6, D, torch.float32, "cpu", policy, 6, 0.5)
    prompt = prefilled(cache, 9, torch.Generator().manual_seed(0))
    assert prompt.k.shape[2] == 5
    cache.place(0, prompt)
    assert int(cache.write_idx.max()) < cache.capacity
