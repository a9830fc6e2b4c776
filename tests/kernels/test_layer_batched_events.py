"""Layer-batched compression events (``CompressedKVCache.layer_batch_rows``): R-KV, SnapKV, LagKV and Hard-KV score and
compact several layers per call when an event holds few slots. The cache after a batched event must equal, bit for bit,
the cache after the same event run layer by layer (``layer_batch_rows = 0``): on the torch path and on the Triton
compaction kernel (interpreted on CPU), over a contiguous span (views) and scattered slots (gathers), in a slot
view, and with a last call of fewer layers than the others."""
import os

import pytest
import torch

from kvroll import CompressionConfig
from kvroll.rollout.cache import CompressedKVCache

try:
    import triton
except ImportError:  # pragma: no cover
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and triton is not None

LAYERS, SLOTS, KV_HEADS, Q_HEADS, DIM, BUDGET = 5, 6, 2, 4, 8, 12
PARAMS = {"rkv": dict(window=4, buffer=6), "snapkv": dict(window=4, buffer=6), "lagkv": dict(sink_tokens=2, lag=2),
          "hardkv": dict(interval=6, window=4, sink_tokens=2, min_keep=2, p=0.7)}
LAG_COMPRESSED = [0, 2, 1, 0, 2, 3]  # LagKV: each slot's compressed region (the same in every layer)


def filled_cache(name: str, batch_rows: int, kernel: bool, seed: int = 3) -> CompressedKVCache:
    """A cache full of random K/V, scrambled positions (a compacted cache's slots are not in time order across
    heads) and random ring queries, due for compression in every slot."""
    policy = CompressionConfig(name, budget=BUDGET, **PARAMS[name]).build()
    policy.num_q_heads = Q_HEADS
    cap = policy.capacity(BUDGET, 0)
    cache = CompressedKVCache(LAYERS, SLOTS, KV_HEADS, cap, DIM, torch.float32, "cpu", policy, BUDGET, DIM ** -0.5)
    cache.kernel_on_cpu = kernel
    cache.layer_batch_rows = batch_rows
    gen = torch.Generator().manual_seed(seed)
    cache.k.normal_(generator=gen), cache.v.normal_(generator=gen)
    cur = 40 + torch.randint(0, 9, (SLOTS,), generator=gen)
    # each (layer, slot, head) holds cap distinct positions below cur_pos, in increasing slot order, the newest
    # window among them (what a cache that appended since its last compaction holds)
    for layer in range(LAYERS):
        for slot in range(SLOTS):
            for head in range(KV_HEADS):
                old = torch.randperm(int(cur[slot]) - 4, generator=gen)[:cap - 4].sort().values
                cache.pos[layer, slot, head] = torch.cat([old, torch.arange(int(cur[slot]) - 4, int(cur[slot]))])
    if cache.vnorm is not None:
        cache.vnorm.copy_(cache.v.float().norm(dim=-1))
    cache.count.fill_(cap)
    cache.write_idx.fill_(cap - 1)
    cache.cur_pos.copy_(cur)
    for state in cache.state.values():
        if state.is_floating_point():
            state.normal_(generator=gen)
    if name == "lagkv":
        cache.state["compressed"].copy_(torch.tensor(LAG_COMPRESSED).expand(LAYERS, -1))
    return cache


def fields(cache):
    out = {"k": cache.k, "v": cache.v, "pos": cache.pos, "count": cache.count, "write_idx": cache.write_idx}
    return out | ({"vnorm": cache.vnorm} if cache.vnorm is not None else {})


KERNELS = [False] + ([True] if INTERPRET else [])


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: "kernel" if k else "torch")
@pytest.mark.parametrize("name", ["rkv", "snapkv", "lagkv", "hardkv"])
@pytest.mark.parametrize("slots,batch_rows,view", [
    ([1, 2], 64, None),      # a contiguous span: every layer in one call (views of the span's rows)
    ([4, 0, 2], 6, None),    # scattered slots, 2 layers per call: calls of 2, 2 and 1 layers
    ([3], 2, None),          # one slot, 2 layers per call
    ([0, 1, 2], 9, 4),       # a slot view of 4 slots: its rows keep the full cache's layer stride
    ([5, 1], None, None),    # the default: rows from layer_batch_elems (every layer at this tiny shape)
])
def test_layer_batched_event_equals_layer_by_layer(kernel, name, slots, batch_rows, view):
    ref, got = filled_cache(name, 0, kernel), filled_cache(name, batch_rows, kernel)
    calls = []
    compress = got.policy.compress
    got.policy.compress = lambda c, layer, s: (calls.append(layer), compress(c, layer, s))[1]
    for cache in (ref, got):
        target = cache.slot_view(view) if view else cache
        target.compress_slots(torch.tensor(slots))
    rows = batch_rows if batch_rows is not None else CompressedKVCache.layer_batch_elems // got.policy.row_elems(got)
    per_call = max(1, rows // len(slots))
    assert len(calls) == -(-LAYERS // per_call) and any(isinstance(c, slice) for c in calls), calls
    for field, want in fields(ref).items():
        assert torch.equal(fields(got)[field], want), field
    untouched = [s for s in range(SLOTS) if s not in slots]
    fresh = filled_cache(name, 0, kernel)
    for field, want in fields(fresh).items():
        assert torch.equal(fields(got)[field][:, untouched], want[:, untouched]), field  # other slots untouched
        assert not torch.equal(fields(got)[field][:, slots], want[:, slots]) or field == "write_idx", field
    if name == "lagkv":  # LagKV keeps sinks + its region + the raw tail, fewer than the budget; the regions moved on
        assert (got.count[:, slots] < BUDGET).all()
        assert not torch.equal(got.state["compressed"][:, slots], fresh.state["compressed"][:, slots])
    elif name == "hardkv":  # top-p per head: counts differ across heads and layers, at most the budget; every
        # uncalibrated head (a temperature <= 0) calibrated, the votes reset, the next compression an interval away
        assert (got.count[:, slots] <= BUDGET).all() and len(set(got.count[:, slots].flatten().tolist())) > 2
        assert (got.state["temp"][:, slots] > 0).all() and (fresh.state["temp"][:, slots] <= 0).any()
        assert (got.state["votes"][:, slots] == 0).all()
        assert torch.equal(got.state["last"][:, slots], got.cur_pos[slots].expand(LAYERS, -1))
    else:
        assert (got.count[:, slots] == BUDGET).all()
    for state, want in got.state.items():
        assert torch.equal(ref.state[state], want), state


def test_default_rows_follow_the_largest_per_row_tensor():
    """The default rows per call: ``layer_batch_elems`` over the larger of a row's keys and its fp32 window logits
    — 256 rows at Qwen3-1.7B's budget-1024 cache (the measured best), fewer when a wide GQA group's logits are
    the larger tensor, and never 0."""
    def rows(name, kv_heads, q_heads, dim, budget, **kw):
        policy = CompressionConfig(name, budget=budget, **kw).build()
        policy.num_q_heads = q_heads
        cache = CompressedKVCache(1, 1, kv_heads, policy.capacity(budget, 0), dim, torch.float32, "meta",
                                  policy, budget, dim ** -0.5)
        return CompressedKVCache.layer_batch_elems // policy.row_elems(cache)

    assert rows("rkv", 8, 16, 128, 1024) == rows("snapkv", 8, 16, 128, 1024) == 256  # keys: 8 x 128 >= 16 x 32
    assert rows("snapkv", 4, 28, 128, 1024) == 256 * 8 * 128 // (28 * 32)  # logits: 28 x 32 > 4 x 128
    assert rows("rkv", 4, 28, 128, 1024) == 512  # R-KV's 8-query window: the keys bind
    assert rows("lagkv", 8, 16, 128, 1024) == 256 * 1152 // 2048  # LagKV: its keys and values, capacity = budget
    assert rows("hardkv", 8, 16, 128, 1024) == 256  # Hard-KV: budget + interval 128, counted as its keys
    assert rows("rkv", 8, 64, 256, 10 ** 6) == 0  # a huge cache: no row fits; compress_index takes 1 layer a call


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: "kernel" if k else "torch")
@pytest.mark.parametrize("base", ["attention", "snapkv", "rkv"])
@pytest.mark.parametrize("time_ordered", [True, False], ids=["ordered", "argsort"])
@pytest.mark.parametrize("host", [True, False], ids=["host_sizes", "device_read"])
@pytest.mark.parametrize("batch_rows", [64, 6])
def test_hardkv_batched_equals_layer_by_layer(kernel, base, time_ordered, host, batch_rows):
    """Hard-KV's every path batched against layer by layer: each base; the host schedule's sizes
    (``cache.event_counts``: 0 = not calibrated yet, those slots first; the rows to calibrate are then the first
    ones of each layer's rows in a batched call, a device index) or the device's read; a time-ordered cache (the
    kept slots by a partition) or not (an argsort); a slot with a dead tail (3 positions -1, its count 3 short).
    Two new slots and a calibrated one, every layer in one call (64 rows) or 2 layers a call (6): the cache and the
    policy state equal the layer-by-layer event's, bit for bit."""
    slots, sizes = [4, 0, 2], [0, 0, 1]  # slots 4 and 0 are new
    caches = []
    for rows in (0, batch_rows):
        cache = filled_cache("hardkv", rows, kernel)
        cache.policy = CompressionConfig("hardkv", budget=BUDGET, **PARAMS["hardkv"] | {"base": base}).build()
        cache.time_ordered = time_ordered
        cache.pos[:, 2, :, -3:] = -1  # slot 2's newest slots dead: a shorter row
        cache.count[:, 2] -= 3
        temp = cache.state["temp"]
        temp.abs_().add_(0.1)
        temp[:, [4, 0]] = 0.0
        cache.event_counts = sizes if host else None
        calls = []
        compress = cache.policy.compress
        cache.policy.compress = lambda c, layer, s: (calls.append(layer), compress(c, layer, s))[1]
        cache.compress_slots(slots)
        caches.append((cache, calls))
    (ref, ref_calls), (got, got_calls) = caches
    assert ref_calls == list(range(LAYERS)) and all(isinstance(c, slice) for c in got_calls[:-1])
    assert len(got_calls) == (1 if batch_rows == 64 else 3)
    for field, want in fields(ref).items():
        assert torch.equal(fields(got)[field], want), field
    for state, want in got.state.items():
        assert torch.equal(ref.state[state], want), state
    assert (got.state["temp"][:, [4, 0]] > 0).all() and len(set(got.count[:, slots].flatten().tolist())) > 2
