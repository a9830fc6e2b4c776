"""Hard-KV's keep kernel (``kvroll/kernels/hardkv_keep.py``) against the torch path of ``HardKVPolicy.compress`` and
the fp64 reference of the policy tests (``_naive_hardkv_keep``).

CPU (CI): the kernel under ``TRITON_INTERPRET=1``, called through ``compress`` as the engine calls it (the host's
sizes, a time-ordered cache) with ``kernel_on_cpu``, against the same call with ``keep_kernel = False``: both bases
it serves, p below and at 1, one layer or a slice of them, new rows calibrated first, rows with no candidates or no
live token, the min_keep and max_keep clamps, exact ties, and an engine-sized row (capacity 1,152 = budget 1,024 +
interval 128, Hard-KV's defaults). On these inputs the kept sets are the torch path's exactly. GPU (``gpu``): bf16
-era fp32 state at the engine's shape; there the sums add in another order than torch's, so a count may move by one
token where a row's mass passes p within a rounding (the kernel's docstring): each such row is checked to be one.
"""
import os
from types import SimpleNamespace

import pytest
import torch

from kvroll.kernels import hardkv_keep as hk
from kvroll.policies.hardkv import HardKVParams, HardKVPolicy, descending_order
from tests.policies.test_scores import _naive_hardkv_keep, hole_fill_order

interpret = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(hk.triton is None or not interpret, reason="needs TRITON_INTERPRET=1")
DIM = 4


def make_cache(params, rows, heads, cap, budget, seed, layers=1, device="cpu", live_min=None, votes=None):
    """A time-ordered cache state: each (layer, row, head) live on a prefix of its slots (positions ascending),
    heavy-tailed votes on the live slots, a run of zero votes (ties at the 1e-30 clamp), cur_pos past the end."""
    gen = torch.Generator().manual_seed(seed)
    live = torch.randint(live_min if live_min is not None else cap * 3 // 4, cap + 1, (layers, rows, heads),
                         generator=gen)
    pos = torch.arange(cap, dtype=torch.int32).expand(layers, rows, heads, cap).clone()
    pos = pos.masked_fill(torch.arange(cap) >= live[..., None], -1)
    if votes is None:
        votes = (torch.randn(layers, rows, heads, cap, generator=gen) * 2).exp()
        votes[..., cap // 8: cap // 8 + 4] = 0.0
    votes = votes * (pos >= 0)
    cur = cap + torch.randint(0, 6, (rows,), generator=gen)
    cache = SimpleNamespace(num_layers=layers, slots=rows, num_kv_heads=heads, capacity=cap, budget=budget,
                            k=torch.zeros(layers, rows, heads, cap, DIM), pos=pos, cur_pos=cur, time_ordered=True,
                            kernel_on_cpu=True)
    cache.state = HardKVPolicy(params).init_state(cache)
    cache.state["votes"].copy_(votes)
    cache.state["temp"].copy_(0.3 + 2 * torch.rand(layers, rows, heads, generator=gen))
    return {key: (value.to(device) if isinstance(value, torch.Tensor) else value) for key, value in
            vars(cache).items() if key != "state"}, {key: value.to(device) for key, value in cache.state.items()}


def compress(params, fields, state, sizes, slots, layer, kernel):
    """``compress`` on a fresh copy of the cache: (keep_idx int64, counts, the temperatures after it)."""
    policy = HardKVPolicy(params)
    policy.keep_kernel = kernel
    cache = SimpleNamespace(**{key: (value.clone() if isinstance(value, torch.Tensor) else value)
                               for key, value in fields.items()})
    cache.state = {key: value.clone() for key, value in state.items()}
    cache.event_counts = list(sizes)
    assert policy._uses_kernel(cache) == kernel
    idx, count = policy.compress(cache, layer, slots)
    return idx.long(), count, cache.state["temp"]


def kept_sets(idx, count):
    return [[idx[r, h, : int(count[r, h])].tolist() for h in range(idx.shape[1])] for r in range(idx.shape[0])]


def assert_same_event(params, fields, state, sizes, slots, layer):
    want_idx, want_count, want_temp = compress(params, fields, state, sizes, slots, layer, False)
    got_idx, got_count, got_temp = compress(params, fields, state, sizes, slots, layer, True)
    # new rows' temperatures: the same bisection, its masses summed in another order (``hardkv_calibrate``)
    fresh = state["temp"] <= 0
    assert torch.equal(got_temp[~fresh], want_temp[~fresh]) and bool((got_temp[fresh] > 0).all())
    if params.p < 1:  # (at p = 1 no T reaches mass > p but by rounding: T is noise, and unused: all are kept)
        torch.testing.assert_close(got_temp[fresh], want_temp[fresh], rtol=1e-4, atol=0)
    assert torch.equal(got_count, want_count)
    assert kept_sets(got_idx, got_count) == kept_sets(want_idx, want_count)
    # past each count: C - 1, as ``ascending_slots`` fills it
    past = torch.arange(got_idx.shape[-1]) >= got_count[..., None]
    assert (got_idx[past] == fields["capacity"] - 1).all()
    return got_idx, got_count


@needs_interpreter
@pytest.mark.parametrize("base", ["attention", "snapkv"])
@pytest.mark.parametrize("p", [0.6, 0.9, 1.0])
@pytest.mark.parametrize("layers,sizes", [(1, [0, 0, 1, 1]), (1, [1, 1, 1, 1]), (2, [0, 1, 1, 1])],
                         ids=["new_rows", "calibrated", "two_layers"])
def test_kernel_equals_torch_path(base, p, layers, sizes):
    params = HardKVParams(p=p, base=base, interval=8, window=4, sink_tokens=2, min_keep=3)
    fields, state = make_cache(params, rows=4, heads=3, cap=40, budget=32, seed=int(p * 10) + layers, layers=layers)
    new = sizes.count(0)
    order = torch.tensor([1, 3, 0, 2])
    state["temp"][:, order[:new]] = 0.0  # the host's new slots come first and are not calibrated yet
    layer = slice(0, layers) if layers > 1 else 0
    _, count = assert_same_event(params, fields, state, sizes, order, layer)
    if p < 1:
        assert len(set(count.flatten().tolist())) > 2  # head-adaptive: not a trivial agreement


@needs_interpreter
@pytest.mark.parametrize("base", ["attention", "snapkv"])
def test_engine_sized_rows_equal_torch_path_and_fp64_reference(base):
    """Capacity 1,152 (Hard-KV's default shape: budget 1,024 + interval 128, window 32, 4 sinks, min_keep 8)."""
    params = HardKVParams(p=0.9, base=base)
    fields, state = make_cache(params, rows=2, heads=2, cap=1152, budget=1024, seed=5, live_min=600)
    slots = torch.tensor([1, 0])
    idx, count = assert_same_event(params, fields, state, [1, 1], slots, 0)
    want = _naive_hardkv_keep(state["votes"][0, slots], fields["pos"][0, slots], fields["cur_pos"][slots],
                              state["temp"][0, slots], params, base)
    for r, kept in enumerate(kept_sets(idx, count)):
        for h, got in enumerate(kept):
            assert set(got) == want[r, h]
            assert got == (hole_fill_order(want[r, h]) if base == "attention" else sorted(got))


@needs_interpreter
def test_edge_rows_equal_torch_path():
    """Rows the selection must not trip on: no candidate (everything in the sinks or the window), no live token,
    exact ties (votes on a grid of 4 values: ties broken by the lower slot, as the torch path's stable sort),
    a peaked row whose top-p count is clamped up to min_keep, and max_keep clamping the rest down."""
    params = HardKVParams(p=0.95, base="attention", interval=8, window=4, sink_tokens=2, min_keep=5, max_keep=9)
    rows, heads, cap = 5, 3, 40
    gen = torch.Generator().manual_seed(9)
    votes = (torch.randint(1, 5, (1, rows, heads, cap), generator=gen) * 0.25).float()
    votes[0, 3, 0] = 1e-4
    votes[0, 3, 0, 20] = 100.0  # one token holds the mass: top-p says 1, min_keep says 5
    fields, state = make_cache(params, rows, heads, cap, budget=32, seed=9, votes=votes)
    fields["pos"][0, 0, :, 6:] = -1  # row 0: 6 live tokens, positions 0-5,
    fields["cur_pos"][0] = 8  # the sinks 0-1 and the window 4-7: 2-3 are its only candidates
    fields["pos"][0, 0, 0, 2:4] = -1  # and head 0 has none
    fields["pos"][0, 1, 1] = -1  # row 1, head 1: nothing live
    _, count = assert_same_event(params, fields, state, [1] * rows, torch.arange(rows), 0)
    assert int(count[1, 1]) == 0 and int(count[0, 0]) == 4
    pos = fields["pos"][0]
    dense = ((pos >= 0) & ((pos < 2) | (pos >= fields["cur_pos"][:, None, None] - 4))).sum(-1)
    assert int(count[3, 0]) == int(dense[3, 0]) + 5  # the dense tier + min_keep
    assert int((count - dense).max()) == 9  # max_keep binds somewhere


@needs_interpreter
@pytest.mark.parametrize("base", ["attention", "snapkv"])
def test_votes_a_few_ulps_apart_equal_torch_path(base):
    """Votes a few ulps apart, which fp32's log maps to one score in runs (a tie there, not in value): the kernel
    ranks by value, and so must the torch path (``scores_and_order``), or the clamped top n keeps another token."""
    params = HardKVParams(p=0.05, base=base, interval=8, window=4, sink_tokens=2, min_keep=2, max_keep=4)
    rows, heads, cap = 3, 2, 40
    gen = torch.Generator().manual_seed(3)
    votes = 1e-3 * (1 + 2.0 ** -23 * torch.randint(0, 24, (1, rows, heads, cap), generator=gen).float())
    fields, state = make_cache(params, rows, heads, cap, budget=32, seed=3, votes=votes)
    live = fields["pos"][0] >= 0
    scores = HardKVPolicy(params).base_scores(state["votes"][0], live, None, fields["pos"][0])
    assert scores.unique().numel() < (state["votes"][0] * live).unique().numel()  # the log ties values that differ
    assert_same_event(params, fields, state, [1] * rows, torch.arange(rows), 0)


@needs_interpreter
def test_threshold_is_the_torch_paths_fp32_bound():
    """``mass < p - 1e-6`` against an fp32 tensor compares with p - 1e-6 rounded to fp32."""
    for p in (0.9, 0.95, 0.6, 1 / 3):
        thr = hk.keep_threshold(p)
        assert thr == torch.tensor(p - 1e-6, dtype=torch.float32).item()
        mass = torch.tensor([thr], dtype=torch.float32)
        assert not bool(mass < p - 1e-6) and bool(torch.nextafter(mass, torch.zeros(1)) < p - 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("base", ["attention", "snapkv"])
def test_engine_shape_on_gpu(base):
    """64 rows x 8 heads at capacity 1,152 on the GPU, 16 of them new (calibrated first), against the torch path
    there. The sums add in another order than torch's: the new rows' temperatures agree within 1e-4, and every row
    with another count must be one whose top-p mass passes p within 1e-5 at that count (fp64), and differ from the
    torch path's by one token."""
    params = HardKVParams(p=0.9, base=base)
    fields, state = make_cache(params, rows=64, heads=8, cap=1152, budget=1024, seed=11, live_min=700,
                               device="cuda")
    slots = torch.arange(64, device="cuda").flip(0)
    state["temp"][0, slots[:16]] = 0.0
    sizes = [0] * 16 + [1] * 48
    want_idx, want_count, want_temp = compress(params, fields, state, sizes, slots, 0, False)
    got_idx, got_count, got_temp = compress(params, fields, state, sizes, slots, 0, True)
    torch.testing.assert_close(got_temp, want_temp, rtol=1e-4, atol=0)
    state["temp"] = want_temp  # the edge check below: each row's mass at the torch path's T
    want, got = kept_sets(want_idx.cpu(), want_count.cpu()), kept_sets(got_idx.cpu(), got_count.cpu())
    differ = [(r, h) for r in range(64) for h in range(8) if got[r][h] != want[r][h]]
    assert len(differ) <= 64 * 8 // 100, differ
    for r, h in differ:
        assert abs(len(got[r][h]) - len(want[r][h])) == 1 and len(set(got[r][h]) ^ set(want[r][h])) == 1
        # the fp64 mass of the torch path's top-(count - 1) candidates sits within 1e-5 of p
        votes = state["votes"][0, slots[r], h].double().cpu()
        pos = fields["pos"][0, slots[r], h].cpu()
        cur = int(fields["cur_pos"][slots[r]])
        cand = (pos >= params.sink_tokens) & (pos < cur - params.window)
        scores = HardKVPolicy(params).base_scores(votes[None, None].float(), cand[None, None], None, pos)[0, 0]
        probs = (scores.double() / float(state["temp"][0, slots[r], h])).masked_fill(~cand, float("-inf"))
        probs = probs.softmax(-1)
        ranked = probs[descending_order(scores[None], cand[None])[0]].cumsum(0)
        n = min(len(got[r][h]), len(want[r][h])) - int(((pos >= 0) & ~cand).sum())  # less the row's dense tier
        assert abs(float(ranked[n - 1]) - params.p) < 1e-5 or abs(float(ranked[n]) - params.p) < 1e-5


@needs_interpreter
def test_capacity_past_2048_equals_torch_path():
    """A budget of 3,000 (capacity 3,128: a 4,096-slot program, ``warps_for``'s 8 warps on a GPU)."""
    params = HardKVParams(p=0.9)
    fields, state = make_cache(params, rows=1, heads=2, cap=3128, budget=3000, seed=13, live_min=2000)
    assert hk.warps_for(4096) == 8 and hk.warps_for(2048) == hk.WARPS
    _, count = assert_same_event(params, fields, state, [1], torch.tensor([0]), 0)
    assert int(count.min()) > 8


@needs_interpreter
def test_long_rows_top_p_count_is_the_fp64_count():
    """At capacity 8,320 (budget 8,192) the fp32 sums of ~6,000 probabilities round by ~1e-6, p's bound's scale: each
    head's top-p count must be the fp64 count (the candidates by v, then slot; softmax and cumulative mass in fp64),
    or one off where the fp64 mass passes p within 1e-5 of that count."""
    params = HardKVParams(p=0.9, min_keep=1)
    fields, state = make_cache(params, rows=1, heads=4, cap=8320, budget=8192, seed=17, live_min=6000)
    idx, count = compress(params, fields, state, [1], torch.tensor([0]), 0, True)[:2]
    pos, cur = fields["pos"][0, 0], int(fields["cur_pos"][0])
    for h in range(4):
        cand = (pos[h] >= params.sink_tokens) & (pos[h] < cur - params.window)
        votes = state["votes"][0, 0, h].clamp_min(1e-30)
        slots = [c for c in sorted(cand.nonzero()[:, 0].tolist(), key=lambda c: (-float(votes[c]), c))]
        z = votes[slots].log().double() / float(state["temp"][0, 0, h])
        mass = (z - z.max()).exp().div((z - z.max()).exp().sum()).cumsum(0)
        exact = int((mass < hk.keep_threshold(params.p)).sum()) + 1
        got = int(count[0, h]) - int((pos[h] >= 0).sum() - cand.sum())
        assert abs(got - exact) <= 1, (h, got, exact)
        if got != exact:
            assert abs(float(mass[min(got, exact) - 1]) - params.p) < 1e-5, (h, got, exact)


@needs_interpreter
@pytest.mark.parametrize("base", ["attention", "snapkv"])
def test_engine_sized_new_rows_calibrate_to_p(base):
    """New rows at capacity 1,152 (the first event of a sequence): the kernel's temperature is the torch path's
    within 1e-4, and under it (fp64) the n highest-score candidates hold mass p within 1e-4, n the top-p count of
    the raw attention; the keep sets are the torch path's."""
    params = HardKVParams(p=0.9, base=base)
    fields, state = make_cache(params, rows=2, heads=2, cap=1152, budget=1024, seed=21, live_min=600)
    state["temp"].zero_()
    slots = torch.tensor([1, 0])
    assert_same_event(params, fields, state, [0, 0], slots, 0)
    temp = compress(params, fields, state, [0, 0], slots, 0, True)[2][0]
    policy = HardKVPolicy(params)
    for slot in (0, 1):
        pos, cur = fields["pos"][0, slot], int(fields["cur_pos"][slot])
        cand = (pos >= params.sink_tokens) & (pos < cur - params.window)  # [Hkv, C]
        votes = state["votes"][0, slot]
        scores = policy.base_scores(votes[None], cand[None], None, pos[None])[0]
        for h in range(2):
            c = cand[h]
            att = (votes[h] * c).double()
            n = int((att.sort(descending=True).values.cumsum(0) / att.sum() < hk.keep_threshold(params.p)).sum()) + 1
            order = descending_order(scores[h][None], c[None])[0]
            probs = (scores[h].double() / float(temp[slot, h])).masked_fill(~c, float("-inf")).softmax(-1)
            assert abs(float(probs[order[:n]].sum()) - params.p) < 1e-4, (slot, h)


@needs_interpreter
def test_strided_rows_or_cur_are_refused():
    """The kernels read entry i of ``rows`` / ``cur`` at ptr + i: a column of a wider tensor (stride 2) gave other
    counts than the same values contiguous; the launchers now refuse it."""
    pos = torch.arange(64, dtype=torch.int32).expand(4, 2, 64).contiguous()
    votes, temp = torch.rand(4, 2, 64, generator=torch.Generator().manual_seed(0)), torch.ones(4, 2)
    rows, cur = torch.arange(4), torch.tensor([[64, 0], [40, 0], [64, 0], [30, 0]])
    kw = dict(sinks=2, window=8, thr=0.9, min_keep=4, room=40, width=48)
    hk.hardkv_keep(pos, votes, temp, rows, cur[:, 0].contiguous(), **kw)
    with pytest.raises(AssertionError):
        hk.hardkv_keep(pos, votes, temp, rows, cur[:, 0], **kw)
    with pytest.raises(AssertionError):
        hk.hardkv_keep(pos, votes, temp, torch.stack([rows, rows], dim=1)[:, 0], cur[:, 0].contiguous(), **kw)
