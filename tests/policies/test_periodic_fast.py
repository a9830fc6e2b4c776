"""The batched / sort-once periodic work against the per-row and sort-every-iteration versions it replaced.

LagKV: ``compress`` folds the rows that share a compressed count into the head dim; it must equal a loop of
``lagkv_select`` per row (indices, counts and the state). Hard-KV: one sort of the scores serves the
calibration's iterations, the top-p count and the keep rank; temperatures must be bitwise equal and keep sets
equal to the old argsort().argsort() implementation, copied here as the reference.
"""
from types import SimpleNamespace

import pytest
import torch

from kvroll.policies.base import ascending_slots
from kvroll.policies.hardkv import HardKVParams, HardKVPolicy
from kvroll.policies.lagkv import LagKVParams, LagKVPolicy, lagkv_select, lagkv_sizes
from kvroll.policies.window import keep_top_and_recent, keep_top_and_window_ordered

DIM = 8


def _lag_cache(compressed, capacity=40, heads=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = len(compressed)
    shape = (1, slots, heads, capacity, DIM)
    cache = SimpleNamespace(k=torch.randn(shape, generator=gen), v=torch.randn(shape, generator=gen),
                            capacity=capacity, num_kv_heads=heads)
    cache.state = {"compressed": torch.tensor([compressed])}
    return cache


@pytest.mark.parametrize("compressed", [[0, 0, 0], [0, 6, 0, 12, 6], [14]])
def test_lagkv_batched_equals_per_row(compressed):
    params = LagKVParams(sink_tokens=2, lag=4, ratio=0.5)  # budget 40 >= 2 + 3 * 4; tail reserve 8
    cache = _lag_cache(compressed)
    slots = torch.arange(len(compressed)).flip(0)  # rows asked out of order
    keep_idx, counts = LagKVPolicy(params).compress(cache, 0, slots)
    for i, slot in enumerate(slots.tolist()):
        want, new = lagkv_select(cache.k[0, slot], cache.v[0, slot], compressed[slot], 40, 8, params)
        width = want.shape[1]
        assert counts[i].tolist() == [width] * 3
        assert torch.equal(keep_idx[i, :, :width], want)
        assert torch.equal(keep_idx[i, :, width:], want[:, -1:].expand(-1, keep_idx.shape[-1] - width))
        assert int(cache.state["compressed"][0, slot]) == new
    assert len(set(counts[:, 0].tolist())) == len(set(compressed))  # the groups really differ


@pytest.mark.parametrize("compressed", [[0, 6, 0, 12, 6], [14, 14]])
def test_lagkv_with_the_hosts_counts_equals_the_device_read(compressed):
    """The host schedule's event (``cache.event_counts``, slots ordered by count so each count's rows are one
    range) keeps and records exactly what the device-read event does."""
    params = LagKVParams(sink_tokens=2, lag=4, ratio=0.5)
    order = sorted(range(len(compressed)), key=lambda s: (compressed[s], s))
    results = []
    for host in (False, True):
        cache = _lag_cache(compressed)
        cache.event_counts = [compressed[s] for s in order] if host else None
        results.append((*LagKVPolicy(params).compress(cache, 0, torch.tensor(order)), cache.state["compressed"]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sinks, lag, ratio, budget", [(2, 4, 0.5, 20), (4, 4, 0.5, 28), (3, 8, 0.25, 41),
                                                       (1, 5, 0.6, 17)])
def test_lagkv_compressed_prompt_leaves_room_to_compress_again(sinks, lag, ratio, budget):
    """After a long prompt is compressed (every length up to 6x the budget), each decode compression frees room:
    the prompt's region is capped at budget - S - 2L, so the raw tail reaches 2L before the cache is full. (With
    no reserve at the prompt, a region that filled the budget left the first decode compression fewer than 2L raw
    tokens: it compressed nothing and the slot stayed full.)"""
    params = LagKVParams(sink_tokens=sinks, lag=lag, ratio=ratio)
    policy = LagKVPolicy(params)
    gen = torch.Generator().manual_seed(budget)
    for length in range(budget, 6 * budget):
        k, v = torch.randn(2, length, DIM, generator=gen), torch.randn(2, length, DIM, generator=gen)
        kept = policy.prompt_keep_idx(None, k, budget - 1, 1.0, v=v).shape[1]
        room, size = policy.host_place(kept, length, budget)
        assert 0 < room and kept <= budget - 1
        for _ in range(12):
            room, size = policy.host_next(size, budget)
            assert room > 0


def test_lagkv_long_prompt_keeps_its_newest_tokens(tiny_llama):
    """Through the engine: after a prompt longer than the budget, the cache keeps the newest generated tokens (the
    raw tail) and compresses now and then, not at every step (the stalled slot kept overwriting its newest one)."""
    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    engine = RolloutEngine(tiny_llama, CompressionConfig("lagkv", budget=28, lag=4, sink_tokens=4), max_batch=1)
    engine.generate([list(range(1, 45))], SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    pos = engine.cache.pos[:, 0]  # [L, Hkv, C]: positions 44 .. 54 were written (the 12th token never is)
    for newest in range(50, 55):
        assert ((pos == newest).sum(-1) == 1).all(), newest
    assert len(engine.stats["policy_events"]) <= 4  # 11 decode steps, a compression every 4+ of them


def test_lagkv_sizes_are_lagkv_selects():
    """``lagkv_sizes`` (the host's arithmetic) gives the kept count and the region size ``lagkv_select``
    returns, over live lengths, region sizes, limits, reserves and ratios (the trimming loop included)."""
    gen = torch.Generator().manual_seed(3)
    checked = trimmed = 0
    for ratio in (0.5, 0.25, 1 / 6, 1.0):
        params = LagKVParams(sink_tokens=3, lag=5, ratio=ratio)
        for n in (3, 14, 20, 33, 47, 64):
            k, v = torch.randn(2, n, DIM, generator=gen), torch.randn(2, n, DIM, generator=gen)
            for limit, reserve in ((n, 10), (n, 0), (max(1, n // 2), 0), (64, 10)):
                for compressed in range(0, max(1, n - 3), 4):
                    idx, region = lagkv_select(k, v, compressed, limit, reserve, params)
                    assert lagkv_sizes(n, compressed, limit, reserve, params) == (idx.shape[1], region)
                    checked += 1
                    trimmed += region < compressed + ((n - 3 - compressed) // 5 - 1) * max(1, int(ratio * 5))
    assert checked > 200 and trimmed > 20  # the trimming loop ran


def _old_top_p_count(probs, p):
    mass = probs.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    return ((mass < p - 1e-6).sum(dim=-1) + 1).clamp(max=probs.shape[-1])


def _old_top_n_mass(scores, cand, temp, n):
    probs = (scores / temp[..., None]).masked_fill(~cand, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    ranked = probs.sort(dim=-1, descending=True).values
    first = torch.arange(scores.shape[-1]) < n[..., None]
    return (ranked * first).sum(dim=-1)


def _old_calibrate(scores, attention, cand, p, iters):
    n = _old_top_p_count(attention.masked_fill(~cand, 0.0), p)
    spread = (scores.masked_fill(~cand, float("-inf")).amax(-1) - scores.masked_fill(~cand, float("inf")).amin(-1))
    spread = spread.nan_to_num(1.0, posinf=1.0, neginf=1.0).clamp_min(1e-6)
    low, high = (spread * 1e-4).log(), (spread * 1e4).log()
    for _ in range(iters):
        mid = (low + high) / 2
        above = _old_top_n_mass(scores, cand, mid.exp(), n) > p
        low, high = torch.where(above, mid, low), torch.where(above, high, mid)
    return ((low + high) / 2).exp()


def _old_keep_sets(policy, cache, slots):
    """The pre-sort-once ``compress``: (temperatures, keep sets per (row, head))."""
    p = policy.params
    pos, cur = cache.pos[0, slots], cache.cur_pos[slots]
    live = pos >= 0
    dense = live & ((pos < p.sink_tokens) | (pos >= (cur - p.window)[:, None, None]))
    cand = live & ~dense
    votes = cache.state["votes"][0, slots]
    scores = policy.base_scores(votes, cand, cache.k[0, slots], pos)
    attention = votes * cand / (votes * cand).sum(-1, keepdim=True).clamp_min(1e-30)
    preset = cache.state["temp"][0, slots]
    temp = torch.where(preset <= 0, _old_calibrate(scores, attention, cand, p.p, p.calibration_iters), preset)
    probs = (scores / temp[..., None]).masked_fill(~cand, float("-inf")).softmax(-1).nan_to_num(0.0)
    num_cand = cand.sum(-1)
    keep_n = torch.minimum(_old_top_p_count(probs, p.p).clamp(min=p.min_keep, max=policy.sparse_room(32)),
                           num_cand)
    rank = scores.masked_fill(~cand, float("-inf")).argsort(-1, descending=True).argsort(-1)
    keep = dense | (cand & (rank < keep_n[..., None]))
    sets = [[set(keep[r, h].nonzero()[:, 0].tolist()) for h in range(keep.shape[1])] for r in range(keep.shape[0])]
    return temp, sets, scores.masked_fill(~cand, float("inf"))  # dense tokens: +inf, kept by both


@pytest.mark.parametrize("base", ["attention", "snapkv", "rkv"])
@pytest.mark.parametrize("p", [0.6, 0.95])
@pytest.mark.parametrize("calibrated", [False, True])
def test_hardkv_sort_once_equals_old(base, p, calibrated):
    params = HardKVParams(p=p, base=base, interval=8, window=4, sink_tokens=2, min_keep=3)
    policy = HardKVPolicy(params)
    gen = torch.Generator().manual_seed(int(p * 100) + len(base))
    rows, heads, cap = 3, 4, 40  # budget 32 + interval 8
    pos = torch.stack([torch.randperm(cap, generator=gen) for _ in range(rows * heads)]).view(rows, heads, cap)
    pos = pos.to(torch.int32).masked_fill(torch.rand(rows, heads, cap, generator=gen) < 0.2, -1)
    cache = SimpleNamespace(num_layers=1, slots=rows, num_kv_heads=heads, capacity=cap, budget=32,
                            k=torch.randn(1, rows, heads, cap, DIM, generator=gen), pos=pos[None],
                            cur_pos=torch.tensor([cap, cap + 3, cap + 9]))
    cache.state = policy.init_state(cache)
    cache.state["votes"][0] = torch.rand(rows, heads, cap, generator=gen) ** 3 * (pos >= 0)
    if calibrated:  # row 0 and one head of row 2 keep their temperatures; only the rest is calibrated
        cache.state["temp"][0, 0] = torch.tensor([0.5, 2.0, 1.0, 3.0])
        cache.state["temp"][0, 2, 1] = 0.7
    slots = torch.arange(rows)
    want_temp, want_sets, scores = _old_keep_sets(policy, cache, slots)
    order, counts = policy.compress(cache, 0, slots)
    assert torch.equal(cache.state["temp"][0], want_temp)
    for r in range(rows):
        for h in range(heads):
            got = set(order[r, h, : int(counts[r, h])].tolist())
            want = want_sets[r][h]
            # equal sets up to ties: the kept scores are the same multiset
            assert sorted(scores[r, h, list(got)].tolist()) == sorted(scores[r, h, list(want)].tolist())
    assert len(set(counts.flatten().tolist())) > 1  # head-adaptive: the sets are not trivially equal


@pytest.mark.parametrize("base", ["attention", "rkv"])
def test_hardkv_with_the_hosts_sizes_equals_the_device_read(base):
    """The host schedule's Hard-KV event (``cache.event_counts``: 0 = not calibrated yet, those slots first; keep
    sets cut to the static width ``budget``) calibrates the same rows and keeps the same tokens as the event that
    reads the device (which rows are new: one host sync), in a cache of two new and two calibrated slots; both cut
    the keep sets to the budget (since session 29; the device's path had cut them to the largest count)."""
    params = HardKVParams(p=0.8, base=base, interval=8, window=4, sink_tokens=2, min_keep=3)
    rows, heads, cap = 4, 3, 40  # budget 32 + interval 8
    gen = torch.Generator().manual_seed(5)
    # time-ordered slots (the engine's layout), some dead at the end
    live = torch.randint(30, cap + 1, (rows, heads), generator=gen)
    pos = torch.arange(cap, dtype=torch.int32).expand(rows, heads, cap).clone()
    pos = pos.masked_fill(torch.arange(cap) >= live[..., None], -1)
    votes = torch.rand(rows, heads, cap, generator=gen) ** 3 * (pos >= 0)
    k = torch.randn(1, rows, heads, cap, DIM, generator=gen)
    order = [1, 3, 0, 2]  # the host's order: slots 1 and 3 are new
    results = []
    for host in (False, True):
        policy = HardKVPolicy(params)
        cache = SimpleNamespace(num_layers=1, slots=rows, num_kv_heads=heads, capacity=cap, budget=32, k=k,
                                pos=pos[None].clone(), cur_pos=torch.tensor([cap + 2, cap, cap + 5, cap + 1]),
                                time_ordered=True)
        cache.state = policy.init_state(cache)
        cache.state["votes"][0] = votes
        cache.state["temp"][0, 0], cache.state["temp"][0, 2] = torch.tensor([0.5, 2.0, 1.0]), 0.7
        cache.event_counts = [0, 0, 1, 1] if host else None
        keep_idx, counts = policy.compress(cache, 0, torch.tensor(order))
        results.append((keep_idx, counts, cache.state["temp"].clone()))
    (want_idx, want_counts, want_temp), (got_idx, got_counts, got_temp) = results
    assert torch.equal(got_temp, want_temp) and (got_temp[0, [1, 3]] > 0).all()
    assert torch.equal(got_counts, want_counts) and got_idx.shape[-1] == want_idx.shape[-1] == 32
    for r in range(rows):
        for h in range(heads):
            n = int(got_counts[r, h])
            assert torch.equal(got_idx[r, h, :n], want_idx[r, h, :n])
    assert len(set(got_counts.flatten().tolist())) > 1


@pytest.mark.parametrize("width", [1, 7, 40])
def test_ascending_slots_is_the_sorted_true_slots(width):
    """The cumsum partition against a loop: each row's True slots in ascending order, then C - 1 (a valid slot);
    rows with no True slot and rows exactly ``width`` long included."""
    gen = torch.Generator().manual_seed(width)
    cap = 40
    keep = torch.rand(6, 5, cap, generator=gen) < torch.rand(6, 5, 1, generator=gen)
    for row in keep.view(-1, cap):  # cut every row to at most width True slots
        row[row.nonzero()[width:, 0]] = False
    keep[0, 0] = False
    keep[0, 1] = torch.arange(cap) >= cap - width
    idx, count = ascending_slots(keep, width)
    assert idx.shape == (6, 5, width) and idx.dtype == torch.int64
    for r in range(6):
        for h in range(5):
            want = keep[r, h].nonzero()[:, 0].tolist()
            assert int(count[r, h]) == len(want)
            assert idx[r, h].tolist() == want + [cap - 1] * (width - len(want))


@pytest.mark.parametrize("window", [1, 4, 9])
def test_keep_top_and_window_ordered_equals_the_sort(window):
    """On time-ordered rows (the engine's caches: live slots first, positions ascending; a prompt), the
    partition path keeps the same slots in the same order as the argsort by position."""
    gen = torch.Generator().manual_seed(window)
    rows, heads, cap, budget = 4, 3, 48, 32
    live = torch.randint(budget + 1, cap + 1, (rows, heads), generator=gen)
    start = torch.randint(0, 500, (rows, 1, 1), generator=gen)
    pos = (start + torch.arange(cap)).to(torch.int32).masked_fill(torch.arange(cap) >= live[..., None], -1)
    cur = (pos.amax(-1).amax(-1) + 1).long()  # live heads of a row end at different slots, not positions
    for h in range(heads):  # so every head holds its row's newest ``window`` positions
        pos[:, h] = torch.where(pos[:, h] >= 0, pos[:, h] + (cur[:, None] - 1 - pos[:, h].amax(-1, keepdim=True)), -1)
    scores = torch.randn(rows, heads, cap, generator=gen)
    want = keep_top_and_recent(scores, pos, cur, budget, window)
    got, count = keep_top_and_window_ordered(scores, pos, cur, budget, window)
    assert torch.equal(got, want) and (count == budget).all()


def test_keep_top_and_window_ordered_counts_a_short_row():
    """A row whose newest ``window`` positions are not all live (never an engine event: they compress full rows)
    keeps fewer than ``budget`` slots; its count says so, so the compaction keeps no slot twice."""
    pos = torch.arange(12, dtype=torch.int32).view(1, 1, 12).clone()
    pos[0, 0, 10] = -1  # a dead slot in the window [9, 12)
    scores = torch.arange(12.0).flip(0).view(1, 1, 12)  # the oldest score highest
    idx, count = keep_top_and_window_ordered(scores, pos, torch.tensor([12]), 8, 3)
    assert int(count) == 7 and idx[0, 0, :7].tolist() == [0, 1, 2, 3, 4, 9, 11]


@pytest.mark.gpu
def test_window_logits_bf16_on_gpu_match_fp32_einsum():
    from kvroll.policies.window import window_logits

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 16, 8, 128, generator=gen).bfloat16().cuda()
    k = torch.randn(3, 8, 300, 128, generator=gen).bfloat16().cuda()
    want = torch.einsum("nhgwd,nhcd->nhgwc", q.float().view(3, 8, 2, 8, 128), k.float())
    torch.testing.assert_close(window_logits(q, k), want, rtol=1e-5, atol=1e-4)


def test_lagkv_compressed_prompt_region_fills_the_decode_cap():
    """A long prompt's compressed region is capped exactly as a decode compression caps it, budget - S - 2L (here
    20 - 2 - 8 = 10; r = 0.75 trims one token per pass, so the cap is reached exactly), not one token lower."""
    params = LagKVParams(sink_tokens=2, lag=4, ratio=0.75)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 60, DIM, generator=gen), torch.randn(2, 60, DIM, generator=gen)
    kept = LagKVPolicy(params).prompt_keep_idx(None, k, 19, 1.0, v=v)
    tail = 4 + (60 - 2) % 4
    assert kept.shape[1] == 2 + 10 + tail
    assert kept[:, -tail:].tolist() == [list(range(60 - tail, 60))] * 2
