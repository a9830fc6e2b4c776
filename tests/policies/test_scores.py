"""Each policy's scores against a naive, loop-based implementation of its paper's formula.

Small random tensors, GQA groups 1, 3 and 4, batch rows that differ (live counts, holes, positions).
"""
import math
from types import SimpleNamespace

import pytest
import torch

from kvroll.policies.h2o import H2OParams, H2OPolicy
from kvroll.policies.hardkv import calibrate_temperature, top_n_mass, top_p_count
from kvroll.policies.lagkv import LagKVParams, lag_relative_score, lagkv_scores, lagkv_select
from kvroll.policies.rkv import RKVParams, rkv_scores
from kvroll.policies.snapkv import snapkv_window_scores

GROUPS = [(2, 2), (6, 2), (8, 2)]  # (Hq, Hkv): GQA groups 1, 3, 4
CAP, DIM, SCALE = 20, 8, 8 ** -0.5


def _rows(num_kv_heads, gen):
    """Two rows that differ: row 0 full (positions 0..19), row 1 with 4 empty slots and gapped positions."""
    k = torch.randn(2, num_kv_heads, CAP, DIM, generator=gen)
    k[:, :, 7] = k[:, :, 3] * 1.5 + 0.01 * torch.randn(2, num_kv_heads, DIM, generator=gen)  # similar keys
    k[:, :, 12] = k[:, :, 3] + 0.01 * torch.randn(2, num_kv_heads, DIM, generator=gen)
    pos = torch.arange(CAP).repeat(2, num_kv_heads, 1).to(torch.int32)
    pos[1] = torch.tensor([0, 1, 2, 5, 6, 9, 10, 11, 14, 15, 16, 17, 18, 19, 20, 21, -1, -1, -1, -1])
    cur_pos = torch.tensor([CAP, 22])
    return k, pos, cur_pos


def _naive_rkv(q_obs, k, pos, cur_pos, p: RKVParams):
    n, num_q_heads, window, _ = q_obs.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.full((n, num_kv_heads, CAP), float("nan"))
    for r in range(n):
        for h in range(num_kv_heads):
            live = [c for c in range(CAP) if pos[r, h, c] >= 0]
            cands = [c for c in live if pos[r, h, c] < cur_pos[r] - window]
            imp = [0.0] * CAP
            for w in range(window):
                logit = {c: max(float(q_obs[r, h * group + g, w] @ k[r, h, c]) * SCALE for g in range(group))
                         for c in cands}
                top = max(logit.values())
                z = sum(math.exp(v - top) for v in logit.values())
                for c in cands:
                    imp[c] += math.exp(logit[c] - top) / z / window
            half = p.pool_kernel // 2
            pooled = [max(imp[max(0, c - half): c + half + 1]) for c in range(CAP)]
            red = _naive_redundancy(k[r, h], pos[r, h], p)
            for c in cands:
                out[r, h, c] = p.mix_lambda * pooled[c] - (1 - p.mix_lambda) * red[c]
    return out


def _naive_redundancy(k, pos, p: RKVParams) -> dict:
    """R-KV's redundancy (Eqs. 5-6) of one (row, head): k [C, D], pos [C]; {live slot: softmaxed column mean}."""
    live = [c for c in range(k.shape[0]) if pos[c] >= 0]
    unit = {c: k[c] / (k[c].norm() + 1e-8) for c in live}
    sim = {(u, v): 0.0 if u == v else float(unit[u] @ unit[v]) for u in live for v in live}
    for u in live:
        similar = sorted((v for v in live if v != u and sim[u, v] > p.threshold), key=lambda v: int(pos[v]),
                         reverse=True)
        for v in similar[: p.beta]:
            sim[u, v] = 0.0
    col = {v: sum(sim[u, v] for u in live) / len(live) for v in live}
    top = max(col.values())
    z = sum(math.exp(x - top) for x in col.values())
    return {c: math.exp(col[c] - top) / z for c in live}


@pytest.mark.parametrize("heads", GROUPS)
@pytest.mark.parametrize("beta", [1, 2])
def test_rkv_scores_match_naive(heads, beta):
    gen = torch.Generator().manual_seed(sum(heads) + beta)
    num_q_heads, num_kv_heads = heads
    k, pos, cur_pos = _rows(num_kv_heads, gen)
    params = RKVParams(window=3, beta=beta)
    q_obs = torch.randn(2, num_q_heads, 3, DIM, generator=gen)
    got = rkv_scores(q_obs, k, pos, cur_pos, SCALE, params)
    want = _naive_rkv(q_obs, k, pos, cur_pos, params)
    cand = ~want.isnan()
    assert cand.sum() > 30
    torch.testing.assert_close(got[cand], want[cand].float(), atol=1e-6, rtol=1e-5)


def _naive_snapkv(q_obs, k, pos, cur_pos, pool):
    n, num_q_heads, window, _ = q_obs.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(n, num_kv_heads, CAP)
    for r in range(n):
        for h in range(num_kv_heads):
            raw = [0.0] * CAP
            for g in range(group):
                for w in range(window):
                    q_pos = int(cur_pos[r]) - window + w
                    seen = [c for c in range(CAP) if 0 <= pos[r, h, c] <= q_pos]
                    logit = {c: float(q_obs[r, h * group + g, w] @ k[r, h, c]) * SCALE for c in seen}
                    top = max(logit.values())
                    z = sum(math.exp(v - top) for v in logit.values())
                    for c in seen:
                        if pos[r, h, c] < cur_pos[r] - window:
                            raw[c] += math.exp(logit[c] - top) / z
            half = pool // 2
            for c in range(CAP):
                out[r, h, c] = sum(raw[j] for j in range(c - half, c + half + 1) if 0 <= j < CAP) / pool
    return out


@pytest.mark.parametrize("heads", GROUPS)
def test_snapkv_window_scores_match_naive(heads):
    gen = torch.Generator().manual_seed(7 + sum(heads))
    num_q_heads, num_kv_heads = heads
    k, pos, cur_pos = _rows(num_kv_heads, gen)
    q_obs = torch.randn(2, num_q_heads, 4, DIM, generator=gen)
    got = snapkv_window_scores(q_obs, k, pos, cur_pos, SCALE, 5)
    torch.testing.assert_close(got, _naive_snapkv(q_obs, k, pos, cur_pos, 5), atol=1e-6, rtol=1e-5)


def _naive_lag_score(z, ref):
    n, dim = z.shape
    normed = torch.zeros(n, dim, dtype=torch.float64)
    for d in range(dim):
        low, high = float(ref[:, d].min()), float(ref[:, d].max())
        for i in range(n):
            normed[i, d] = 0.0 if high - low <= 1e-6 else (float(z[i, d]) - low) / (high - low)
    std = torch.tensor([float(torch.std(normed[i])) for i in range(n)])
    return torch.exp(std - std.max()) / torch.exp(std - std.max()).sum()


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3])
def test_lagkv_scores_match_naive(num_kv_heads):
    gen = torch.Generator().manual_seed(num_kv_heads)
    k, v, k_ref, v_ref = (torch.randn(num_kv_heads, 6, DIM, generator=gen) * (1 + h) for h in range(4))
    got = lagkv_scores(k, v, k_ref, v_ref)
    for h in range(num_kv_heads):
        want = _naive_lag_score(k[h], k_ref[h]) + _naive_lag_score(v[h], v_ref[h])
        torch.testing.assert_close(got[h], want.float(), atol=1e-6, rtol=1e-5)


def test_lagkv_constant_channel_is_finite():
    gen = torch.Generator().manual_seed(0)
    k, ref = torch.randn(2, 8, DIM, generator=gen), torch.randn(2, 8, DIM, generator=gen)
    k[..., 3] = 2.0
    ref[..., 3] = 2.0  # max == min in the reference
    ref[1] = 0.5  # every channel constant in head 1's reference
    score = lag_relative_score(k, ref)
    assert torch.isfinite(score).all()
    torch.testing.assert_close(score.sum(-1), torch.ones(2))
    torch.testing.assert_close(score[0], _naive_lag_score(k[0], ref[0]).float(), atol=1e-6, rtol=1e-5)


def test_lagkv_select_matches_chunk_loop():
    p = LagKVParams(sink_tokens=2, lag=4, ratio=0.5)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(3, 21, DIM, generator=gen), torch.randn(3, 21, DIM, generator=gen)
    keep, compressed = lagkv_select(k, v, 0, 21, 0, p)
    assert compressed == 6  # chunks [2,6) [6,10) [10,14) scored against their successors, 2 kept each
    for h in range(3):
        want = [0, 1]
        for start in (2, 6, 10):
            s = _naive_lag_score(k[h, start:start + 4], k[h, start + 4:start + 8]) + \
                _naive_lag_score(v[h, start:start + 4], v[h, start + 4:start + 8])
            want += sorted(start + i for i in s.topk(2).indices.tolist())
        want += list(range(14, 21))  # newest full chunk + remainder stay raw
        assert keep[h].tolist() == want
    # static budget: a limit that cannot hold every compressed chunk recompresses the oldest ones
    small, compressed = lagkv_select(k, v, 0, 14, 0, p)
    assert small.shape[1] <= 14 and compressed == small.shape[1] - 2 - 7
    assert small[:, :2].tolist() == [[0, 1]] * 3 and small[:, -7:].tolist() == [list(range(14, 21))] * 3


def test_hardkv_calibrated_top_n_mass_is_p():
    gen = torch.Generator().manual_seed(5)
    cand = torch.rand(3, 4, 64, generator=gen) > 0.2
    attention = (torch.randn(3, 4, 64, generator=gen) * 2).softmax(-1) * cand
    attention = attention / attention.sum(-1, keepdim=True)
    scores = torch.randn(3, 4, 64, generator=gen)  # an arbitrary base score (R-KV-like: solution 2)
    for p in (0.5, 0.9):
        temp = calibrate_temperature(scores, attention, cand, p)
        n = top_p_count(attention.masked_fill(~cand, 0), p)
        for r in range(3):
            for h in range(4):
                idx = cand[r, h].nonzero()[:, 0]
                probs = (scores[r, h, idx] / temp[r, h]).softmax(-1)
                top = probs.sort(descending=True).values[: int(n[r, h])].sum()
                assert abs(float(top) - p) < 0.01, (p, r, h, float(top))
                raw = attention[r, h, idx].sort(descending=True).values.cumsum(0)
                assert int(n[r, h]) == int((raw < p - 1e-6).sum()) + 1
        torch.testing.assert_close(top_n_mass(scores, cand, temp, n), torch.full((3, 4), p), atol=0.01, rtol=0)


def test_h2o_accumulates_and_evicts_smallest_outside_window():
    policy = H2OPolicy(H2OParams(window=2))
    cache = SimpleNamespace(num_layers=1, slots=2, num_kv_heads=2, capacity=5, budget=5, k=torch.zeros(1))
    cache.state = policy.init_state(cache)
    gen = torch.Generator().manual_seed(1)
    naive = torch.zeros(2, 2, 5)
    writes = [torch.tensor([[0, 1], [2, 2]]), torch.tensor([[3, 1], [0, 4]]), torch.tensor([[3, 0], [1, 4]])]
    for write in writes:
        stat = torch.rand(2, 2, 5, generator=gen)
        cache.write_idx = write[None]
        policy.observe(cache, 0, None, stat)
        for r in range(2):
            for h in range(2):
                naive[r, h, write[r, h]] = 0.0
        naive += stat
    torch.testing.assert_close(policy.step_scores(cache, 0, None), naive)
    assert policy.protected() == (0, 2)


def _naive_hardkv_keep(votes, pos, cur_pos, temp, p, base, k=None, pool=5):
    """Per (row, head): dense tier + the top-p (calibrated, clamped) candidates by base score, as slot sets."""
    rows, heads, cap = votes.shape
    keep = {}
    for r in range(rows):
        for h in range(heads):
            live = [c for c in range(cap) if pos[r, h, c] >= 0]
            dense = {c for c in live if pos[r, h, c] < p.sink_tokens or pos[r, h, c] >= cur_pos[r] - p.window}
            cand = [c for c in live if c not in dense]
            masked = [float(votes[r, h, c]) if c in cand else 0.0 for c in range(cap)]
            if base == "snapkv":
                half = pool // 2
                masked = [max(masked[j] for j in range(c - half, c + half + 1) if 0 <= j < cap)
                          for c in range(cap)]  # max-pooling (the Hard-KV paper's SnapKV adaptation)
            if base == "rkv":  # lambda * maxpool7(votes over candidates, normalised) - (1 - lambda) * redundancy
                rkv, total = RKVParams(), sum(masked)
                dist = [x / max(total, 1e-30) for x in masked]
                half = rkv.pool_kernel // 2
                pooled = [max(dist[max(0, c - half): c + half + 1]) for c in range(cap)]
                red = _naive_redundancy(k[r, h], pos[r, h], rkv)
                score = {c: rkv.mix_lambda * pooled[c] - (1 - rkv.mix_lambda) * red[c] for c in cand}
            else:
                score = {c: math.log(max(masked[c], 1e-30)) for c in cand}
            top = max(score.values())
            z = sum(math.exp((s - top) / float(temp[r, h])) for s in score.values())
            ranked = sorted(cand, key=lambda c: -score[c])
            mass, count = 0.0, 0
            for c in ranked:
                count += 1
                mass += math.exp((score[c] - top) / float(temp[r, h])) / z
                if mass >= p.p - 1e-6:
                    break
            count = min(max(count, p.min_keep), cap - p.interval - p.sink_tokens - p.window, len(cand))
            keep[r, h] = dense | set(ranked[:count])
    return keep


@pytest.mark.parametrize("base", ["attention", "snapkv", "rkv"])
def test_hardkv_keep_set_matches_naive(base):
    from kvroll.policies.hardkv import HardKVParams, HardKVPolicy

    params = HardKVParams(p=0.8, base=base, interval=8, window=4, sink_tokens=2, min_keep=3)
    policy = HardKVPolicy(params)
    gen = torch.Generator().manual_seed(11)
    heads, cap = 3, 40  # budget 32 + interval 8
    pos = torch.arange(cap).repeat(2, heads, 1).to(torch.int32)
    pos[1, :, 30:] = -1  # row 1: fewer live tokens
    pos[1, 1, 25:] = -1  # and head 1 fewer still
    cur_pos = torch.tensor([cap, 30])
    cache = SimpleNamespace(num_layers=1, slots=2, num_kv_heads=heads, capacity=cap, budget=32,
                            k=torch.randn(1, 2, heads, cap, DIM, generator=gen), pos=pos[None], cur_pos=cur_pos)
    cache.state = policy.init_state(cache)
    cache.state["votes"][0] = torch.rand(2, heads, cap, generator=gen) ** 4 * (pos >= 0)
    order, counts = policy.compress(cache, 0, torch.tensor([0, 1]))
    temp = cache.state["temp"][0]
    assert bool((temp > 0).all())
    want = _naive_hardkv_keep(cache.state["votes"][0], pos, cur_pos, temp, params, base, k=cache.k[0])
    for r in range(2):
        for h in range(heads):
            got = order[r, h, : int(counts[r, h])].tolist()
            assert set(got) == want[r, h]
            if policy.fills_holes:  # the attention base: the holes below the count take the kept slots past it
                assert got == hole_fill_order(want[r, h])
            else:
                assert got == sorted(got, key=lambda c: int(pos[r, h, c]))
    assert len({int(c) for c in counts.flatten()}) > 1  # head-adaptive


@pytest.mark.parametrize("base", ["attention", "snapkv"])
def test_hardkv_ranks_log_ties_by_value(base):
    """Two candidates whose base values differ by a few ulps but share one fp32 log (a score tie): the keep step
    ranks them by value, as the fp64 reference (and the keep kernel) do, not by the lower slot. One sparse token
    kept (p ~ 0): the larger value's (slot 4; for snapkv the first of its pooled neighbours 3-5, tied with it)."""
    from kvroll.policies.hardkv import HardKVParams, HardKVPolicy

    params = HardKVParams(p=1e-6, base=base, interval=4, window=1, sink_tokens=0, min_keep=1, pool_kernel=3)
    policy = HardKVPolicy(params)
    cap = 12  # budget 8 + interval 4
    pos = torch.where(torch.arange(cap) < 8, torch.arange(cap), -1).to(torch.int32).expand(1, 1, cap).clone()
    cand = (pos >= 0) & (pos < 7)  # cur 8: position 7 is the window
    a = torch.tensor(1e-3)
    for _ in range(40):  # b: a few ulps above a, the same fp32 log after the base's transform
        b = torch.nextafter(a, torch.tensor(1.0))
        for _ in range(16):
            votes = torch.zeros(1, 1, cap)
            votes[0, 0, 1], votes[0, 0, 4] = a, b
            scores = policy.base_scores(votes, cand, None, pos)
            values = torch.nn.functional.max_pool1d(votes * cand, 3, 1, 1) if base == "snapkv" else votes * cand
            if scores[0, 0, 1] == scores[0, 0, 4] and values[0, 0, 1] < values[0, 0, 4]:
                break
            b = torch.nextafter(b, torch.tensor(1.0))
        else:
            a = torch.nextafter(a, torch.tensor(1.0))
            continue
        break
    assert scores[0, 0, 1] == scores[0, 0, 4] and values[0, 0, 1] < values[0, 0, 4]
    cache = SimpleNamespace(num_layers=1, slots=1, num_kv_heads=1, capacity=cap, budget=8,
                            k=torch.zeros(1, 1, 1, cap, DIM), pos=pos[None], cur_pos=torch.tensor([8]))
    cache.state = policy.init_state(cache)
    cache.state["votes"][0] = votes
    order, counts = policy.compress(cache, 0, torch.tensor([0]))
    want = _naive_hardkv_keep(votes, pos, cache.cur_pos, cache.state["temp"][0], params, base, pool=3)
    assert set(order[0, 0, : int(counts[0, 0])].tolist()) == want[0, 0] == {7, 4 if base == "attention" else 3}


def hole_fill_order(kept: set[int]) -> list[int]:
    """``hole_fill_slots``'s order of a kept set, by a loop: slot j below n = len(kept) stays if kept, else takes
    the next kept slot at or past n."""
    n = len(kept)
    tails = iter(sorted(c for c in kept if c >= n))
    return [j if j in kept else next(tails) for j in range(n)]


@pytest.mark.parametrize("width", [5, 40])
def test_hole_fill_slots_is_the_loop(width):
    """``hole_fill_slots`` against the loop, on random keep masks with counts up to ``width`` (and an empty row, a
    full prefix, a kept set entirely past its count's prefix)."""
    from kvroll.policies.base import hole_fill_slots

    gen = torch.Generator().manual_seed(width)
    cap = 40
    keep = torch.zeros(7, cap, dtype=torch.bool)
    for r in range(4):
        n = int(torch.randint(1, width + 1, (1,), generator=gen))
        keep[r, torch.randperm(cap, generator=gen)[:n]] = True
    keep[5, :width] = True  # nothing moves
    keep[6, cap - min(width, 3):] = True  # everything moves
    out, n = hole_fill_slots(keep, width)
    assert out.shape == (7, width) and torch.equal(n, keep.sum(-1))
    for r in range(7):
        kept = set(keep[r].nonzero()[:, 0].tolist())
        assert out[r, : len(kept)].tolist() == hole_fill_order(kept)
        assert (out[r, len(kept):] == cap - 1).all()


def test_query_ring_returns_last_window_oldest_first():
    from kvroll.policies.window import query_ring_state, ring_read, ring_write

    cache = SimpleNamespace(num_layers=1, slots=2, head_dim=DIM, k=torch.zeros(1))
    cache.state = query_ring_state(cache, 3, 4)
    history = []
    cache.cur_pos = torch.tensor([5, 11])
    for _ in range(7):
        q = torch.randn(2, 4, DIM)
        history.append(q)
        ring_write(cache, 0, q)
        cache.cur_pos = cache.cur_pos + 1
    got = ring_read(cache, 0, torch.tensor([1, 0]), 3)  # [n, Hq, W, D], rows in the order asked
    for i, slot in enumerate([1, 0]):
        want = torch.stack([history[t][slot] for t in (4, 5, 6)], dim=1)  # [Hq, W, D]
        torch.testing.assert_close(got[i], want)


def test_rkv_compress_keeps_top_candidates_and_window():
    from kvroll.policies.rkv import RKVPolicy
    from kvroll.policies.window import query_ring_state

    gen = torch.Generator().manual_seed(9)
    k, pos, cur_pos = _rows(2, gen)
    params = RKVParams(window=3, buffer=8)
    policy = RKVPolicy(params)
    cache = SimpleNamespace(num_layers=1, slots=2, head_dim=DIM, scale=SCALE, budget=10,
                            k=k[None], pos=pos[None], cur_pos=cur_pos)
    cache.state = query_ring_state(cache, 3, 6)
    cache.state["queries"].normal_(generator=gen)
    keep, counts = policy.compress(cache, 0, torch.tensor([0, 1]))
    assert counts is None and keep.shape == (2, 2, 10)
    ring = cache.state["queries"][0]  # [S, W, Hq, D]; position t sits at t % 3
    for r in range(2):
        order = [(int(cur_pos[r]) - 3 + w) % 3 for w in range(3)]
        q_obs = ring[r, order].transpose(0, 1)[None]  # [1, Hq, W, D]
        want = _naive_rkv(q_obs, k[r:r + 1], pos[r:r + 1], cur_pos[r:r + 1], params)[0]
        for h in range(2):
            cands = [c for c in range(CAP) if not math.isnan(want[h, c])]
            top = sorted(cands, key=lambda c: -float(want[h, c]))[:7]
            newest = sorted(range(CAP), key=lambda c: -int(pos[r, h, c]))[:3]
            assert set(keep[r, h].tolist()) == set(top) | set(newest)
            assert pos[r, h, keep[r, h]].tolist() == sorted(pos[r, h, keep[r, h]].tolist())


def _naive_prompt_scores(q, k, scale, window, pool):
    """SnapKV's prompt scores by loops: the last ``window`` queries' causal softmax over every prompt token,
    summed over the queries and each KV group, of the tokens before the window, avg-pooled (zero padding)."""
    hq, length, _ = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    scores = torch.zeros(hkv, length - window, dtype=torch.float64)
    for h in range(hq):
        for w in range(length - window, length):
            logits = torch.tensor([float(q[h, w].double() @ k[h // group, j].double()) * scale for j in range(w + 1)])
            probs = logits.softmax(0)
            scores[h // group] += probs[: length - window]
    half = pool // 2
    padded = torch.nn.functional.pad(scores, (half, half))
    return torch.stack([padded[:, i:i + pool].sum(-1) / pool for i in range(length - window)], dim=-1)


@pytest.mark.parametrize("keep, window, sinks, recent", [(9, 4, 0, 0), (9, 4, 3, 0), (9, 4, 2, 7), (6, 4, 5, 0),
                                                         (5, 3, 0, 8), (12, 3, 2, 5), (8, 32, 4, 1)])
def test_snapkv_prompt_keep_keeps_sinks_and_recent_then_the_top_scores(keep, window, sinks, recent):
    """A long prompt's keep set: the newest ``recent`` and the first ``sinks`` tokens (what decode protects; one
    slot left for the observation window), then the observation window cut to what is left, then the best-scored
    tokens between them — against loop-computed scores."""
    from kvroll.policies.snapkv import snapkv_prompt_keep

    gen = torch.Generator().manual_seed(keep * 10 + sinks)
    q, k = torch.randn(4, 20, 8, generator=gen), torch.randn(2, 20, 8, generator=gen)
    got = snapkv_prompt_keep(q, k, keep, 0.35, window=window, pool_kernel=3, sinks=sinks, recent=recent)
    protect = min(recent, keep)
    first = min(sinks, keep - max(protect, 1))
    obs = min(window, keep - first, 19)
    newest = max(obs, protect)
    scores = _naive_prompt_scores(q, k, 0.35, obs, 3)
    for h in range(2):
        fixed = set(range(first)) | set(range(20 - newest, 20))
        middle = sorted(range(first, 20 - newest), key=lambda j: -float(scores[h, j]))[: keep - len(fixed)]
        assert got[h].tolist() == sorted(fixed | set(middle)), h
    if sinks == recent == 0:  # SnapKV's own rule: the top prefix tokens and the window
        old = torch.cat([scores.topk(keep - obs, dim=-1).indices, torch.arange(20 - obs, 20).expand(2, -1)], -1)
        assert torch.equal(got, old.sort(-1).values)


@pytest.mark.parametrize("policy, kwargs, window", [
    ("hardkv", dict(budget=44), 32), ("h2o", dict(budget=16, sink_tokens=4, window=4), 4),
    ("longflow", dict(budget=16, sink_tokens=4), 1), ("longflow", dict(budget=48, window=40), 40),
    ("streaming", dict(budget=16, sink_tokens=4), 1)])
def test_compressed_prompt_keeps_what_decode_protects(tiny_llama, policy, kwargs, window):
    """A prompt longer than the budget, compressed at prefill, keeps the sinks and the recent window its policy
    protects at decode time (SnapKV's prompt rule alone could drop the sinks, and LongFlow's window past its
    32-token observation window)."""
    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    config = CompressionConfig(policy, **kwargs)
    engine = RolloutEngine(tiny_llama, config, max_batch=1)
    engine.generate([[(7 * i) % 250 + 1 for i in range(200)]], SamplingParams(max_new_tokens=1, ignore_eos=True))
    pos = engine.cache.pos[:, 0]  # [L, Hkv, C] after the prompt (one token sampled, none written)
    sinks = config.params.sink_tokens
    for p in [*range(sinks), *range(200 - window, 200)]:
        assert ((pos == p).sum(-1) == 1).all(), p


def test_evictable_mask_is_the_documented_rule():
    """``evictable_mask`` against a loop over its rule: live, not a sink (pos >= sinks), and older than the protected
    recent window, which counts the current token (pos <= cur_pos - window): with window 1 the token just before
    the current one may go."""
    from kvroll.policies.base import evictable_mask

    gen = torch.Generator().manual_seed(5)
    pos = torch.stack([torch.randperm(24, generator=gen) for _ in range(6)]).view(3, 2, 24).to(torch.int32)
    pos = pos.masked_fill(torch.rand(pos.shape, generator=gen) < 0.2, -1)
    cur_pos = torch.tensor([23, 20, 17])
    for sinks, window in [(0, 1), (2, 1), (0, 3), (4, 2)]:
        got = evictable_mask(pos, cur_pos, sinks, window)
        for s in range(3):
            for h in range(2):
                for c in range(24):
                    p = int(pos[s, h, c])
                    assert bool(got[s, h, c]) == (p >= 0 and p >= sinks and p <= int(cur_pos[s]) - window), \
                        (sinks, window, s, h, c, p)


@pytest.mark.parametrize("window", [1, 2])
def test_step_eviction_takes_the_smallest_contribution_outside_the_window(window):
    """A full LongFlow cache on the torch path (``attend``): the token at cur_pos - 1 has a zero value, so the
    smallest ||alpha v||_1; window 1 protects only the current token, so it is the next write slot; window 2
    protects it, and the next smallest (a loop over the evictable slots) goes."""
    from kvroll import CompressionConfig
    from kvroll.rollout.cache import CompressedKVCache

    policy = CompressionConfig("longflow", budget=8, window=window).build()
    cache = CompressedKVCache(1, 1, 1, 8, 16, torch.float32, "cpu", policy, 8, 0.25)
    gen = torch.Generator().manual_seed(2)
    cur = 30
    cache.pos[0, 0, 0] = torch.tensor([27, 23, 29, 25, 30, 24, 28, 26], dtype=torch.int32)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.v[0, 0, 0, 2] = 0.0  # position 29 = cur_pos - 1
    cache.vnorm.copy_(cache.v.abs().sum(-1))
    cache.count.fill_(8)
    cache.cur_pos.fill_(cur)
    q = torch.randn(1, 2, 16, generator=gen)
    cache.attend(0, q)
    k, v = cache.k[0, 0, 0].double(), cache.v[0, 0, 0].double()
    alpha = (q[0].double() @ k.T * 0.25).softmax(-1)  # [Hq, C]
    contrib = (alpha[:, :, None] * v[None]).abs().sum(-1).sum(0)  # summed over the group's query heads
    pos = cache.pos[0, 0, 0].tolist()
    evictable = [c for c in range(8) if pos[c] <= cur - window]
    expected = min(evictable, key=lambda c: float(contrib[c]))
    assert (expected == 2) == (window == 1)
    assert int(cache.write_idx[0, 0, 0]) == expected


def _naive_lagkv_select(k, v, compressed, limit, reserve, p):
    """The module docstring's rule for one head, by lists: chunks of the raw part scored against their successor
    (top r * L kept), the newest full chunk + remainder raw; then, while the compressed region exceeds
    limit - sinks - max(tail, reserve), its oldest chunk (up to L) is scored against the next L tokens in time
    order (the following region tokens, then the tail) and keeps min(int(r * size), size - 1) of them."""
    n = k.shape[0]
    sinks, lag = min(p.sink_tokens, n), p.lag

    def best(chunk, ref, keep):
        s = _naive_lag_score(k[chunk], k[ref]) + _naive_lag_score(v[chunk], v[ref])
        return sorted(chunk[i] for i in s.topk(keep).indices.tolist())

    raw_start = sinks + compressed
    chunks = (n - raw_start) // lag
    if chunks < 2:
        return list(range(n)), compressed
    tail_start = raw_start + (chunks - 1) * lag
    region = list(range(sinks, raw_start))
    for start in range(raw_start, tail_start, lag):
        region += best(list(range(start, start + lag)), list(range(start + lag, start + 2 * lag)),
                       max(1, int(p.ratio * lag)))
    tail = list(range(tail_start, n))
    room = limit - sinks - max(len(tail), reserve)
    while len(region) > max(room, 0):
        size = min(lag, len(region))
        keep = min(int(p.ratio * size), size - 1)
        ref = (region[size:] + tail)[:lag]
        region = (best(region[:size], ref, keep) if keep > 0 else []) + region[size:]
    return list(range(sinks)) + region + tail, len(region)


@pytest.mark.parametrize("compressed, limit, reserve", [(0, 14, 0), (6, 20, 8), (9, 16, 4), (0, 9, 0)])
def test_lagkv_select_recompression_matches_the_rule(compressed, limit, reserve):
    """The static-budget trimming (oldest region chunk rescored against the next L tokens, r of it kept) against
    the list loop: which tokens survive, not only how many."""
    p = LagKVParams(sink_tokens=2, lag=4, ratio=0.5)
    gen = torch.Generator().manual_seed(7 + compressed + limit)
    k, v = torch.randn(3, 27, DIM, generator=gen), torch.randn(3, 27, DIM, generator=gen)
    keep, region = lagkv_select(k, v, compressed, limit, reserve, p)
    for h in range(3):
        want, want_region = _naive_lagkv_select(k[h], v[h], compressed, limit, reserve, p)
        assert keep[h].tolist() == want and region == want_region
    first_pass = compressed + ((27 - 2 - compressed) // 4 - 1) * 2
    assert region < first_pass  # the trimming ran


def test_lagkv_constant_reference_channel_normalises_to_zero_for_every_token():
    """A channel constant in the reference (max = min) scores 0 for the chunk's tokens whatever their own value (not
    z - min, which a chunk that varies on that channel would turn into a large, std-dominating term)."""
    gen = torch.Generator().manual_seed(4)
    k, ref = torch.randn(1, 8, DIM, generator=gen), torch.randn(1, 8, DIM, generator=gen)
    ref[..., 2] = -1.0  # constant in the reference
    k[..., 2] = torch.linspace(-50.0, 50.0, 8)  # but not in the chunk
    torch.testing.assert_close(lag_relative_score(k, ref)[0], _naive_lag_score(k[0], ref[0]).float(),
                               atol=1e-6, rtol=1e-5)


def test_hardkv_min_keep_floors_the_top_p_count():
    """p ~ 0 selects one token by mass; ``min_keep`` floors each head's sparse tier at 3 (Hard-KV's per-head floor)."""
    from kvroll.policies.hardkv import HardKVParams, HardKVPolicy

    params = HardKVParams(p=1e-6, interval=4, window=2, sink_tokens=1, min_keep=3)
    policy = HardKVPolicy(params)
    heads, cap = 2, 20  # budget 16 + interval 4
    pos = torch.arange(cap).repeat(1, heads, 1).to(torch.int32)
    gen = torch.Generator().manual_seed(2)
    cache = SimpleNamespace(num_layers=1, slots=1, num_kv_heads=heads, capacity=cap, budget=16,
                            k=torch.zeros(1, 1, heads, cap, DIM), pos=pos[None], cur_pos=torch.tensor([cap]))
    cache.state = policy.init_state(cache)
    cache.state["votes"][0] = torch.rand(1, heads, cap, generator=gen) ** 8
    _, counts = policy.compress(cache, 0, torch.tensor([0]))
    assert counts.tolist() == [[1 + 2 + 3] * heads]  # sink + window + the floor


def test_hardkv_compresses_interval_steps_after_the_prompt_and_resets_votes():
    """The first compression is ``interval`` decode steps after the prompt (not counted from position 0), each
    compaction restarts the votes, and the next one is ``interval`` steps later again."""
    from kvroll.policies.hardkv import HardKVParams, HardKVPolicy

    policy = HardKVPolicy(HardKVParams(interval=8, window=2, sink_tokens=1, min_keep=1))
    cache = SimpleNamespace(num_layers=2, slots=2, num_kv_heads=1, capacity=40, budget=32, k=torch.zeros(1))
    cache.state = policy.init_state(cache)
    cache.count = torch.full((2, 2, 1), 12)
    cache.cur_pos = torch.tensor([12, 5])
    policy.reset_slot(cache, 0, SimpleNamespace(length=12))
    policy.reset_slot(cache, 1, SimpleNamespace(length=5))
    assert policy.steps_until_due(cache).tolist() == [8, 8]
    cache.cur_pos += 8
    assert policy.steps_until_due(cache).tolist() == [0, 0]
    cache.state["votes"].fill_(1.0)
    policy.after_compact(cache, slice(0, 2), torch.tensor([0]), None)
    assert cache.state["votes"][:, 0].eq(0).all() and cache.state["votes"][:, 1].eq(1).all()
    assert policy.steps_until_due(cache).tolist() == [8, 0]
