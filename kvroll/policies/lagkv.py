"""LagKV (papers/lagkv.txt): query- and attention-free compression scored against the next ("lag") chunk.

Layout of each (row, KV head), oldest first: S = 16 sink tokens, the compressed region, then the raw tail. The
raw part is cut into chunks of L tokens; chunk i is scored against chunk i + 1 (Eqs. 7-11): per channel,
min-max normalise chunk i's K (and V) with the min/max of chunk i + 1, take the std over channels per token,
softmax over the chunk; score = s_K + s_V; keep the top max(1, floor(r * L)) tokens of the chunk per head (tied
scores: whichever ``torch.topk`` returns; the kept ones stay in time order). The newest full
chunk plus the remainder always stays raw as the next reference. A channel that is constant in the reference
(max = min) is normalised to 0 instead of dividing by zero.

**Static-budget rule** (as published, the compressed part grows by r * L every L tokens). The cache holds
``budget`` slots and compresses when full, so every chunk is scored against its raw successor exactly as the
paper's eager schedule would. The compressed region may hold at most ``budget - S - 2L`` tokens, which leaves the
raw tail room to reach 2L again before the next compression. When it would overflow, its oldest chunk (up to L
tokens) is compressed again with the same lag-relative score against the next L tokens in time order (the
following compressed tokens, then the raw tail), keeping r of it, until it fits: old context thins out
geometrically while recent context keeps the paper's ratio. ``budget >= S + 3L`` is required.

    CompressionConfig(policy="lagkv", budget=1024, lag=128, ratio=0.5)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvroll.policies.base import check_budget, check_float, check_int, layer_slice

_EPS = 1e-6


@dataclass(frozen=True)
class LagKVParams:
    """LagKV hyperparameters: sink S = 16, lag L = 128, retention ratio r = 0.5 (paper: L in {128, 512, 1024},
    r in {1/2, 1/4, 1/6, 1/8})."""

    sink_tokens: int = 16
    lag: int = 128
    ratio: float = 0.5

    def __post_init__(self):
        check_int("LagKVParams", "sink_tokens", self.sink_tokens, 0)
        check_int("LagKVParams", "lag", self.lag, 1)
        check_float("LagKVParams", "ratio", self.ratio, 0.0, 1.0, low_open=True)


def lag_relative_score(z: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Eqs. 7-10: softmax over tokens of the channel std of z min-max normalised by ref's per-channel range.

    z: [..., n, D] a chunk; ref: [..., m, D] its reference (the next chunk). Returns [..., n] fp32.
    """
    low = ref.amin(dim=-2, keepdim=True).float()
    span = ref.amax(dim=-2, keepdim=True).float() - low
    inv = torch.where(span <= _EPS, 0.0, 1.0 / span)  # a constant reference channel normalises to 0
    normed = torch.sub(z, low).mul_(inv)  # fp32, two passes over the chunk (z stays in its dtype until here)
    return normed.std(dim=-1).softmax(dim=-1)


def lagkv_scores(k, v, k_ref, v_ref) -> torch.Tensor:
    """Eq. 11: score = s_K + s_V. k, v: [..., n, D]; k_ref, v_ref: [..., m, D]. Returns [..., n]."""
    return lag_relative_score(k, k_ref) + lag_relative_score(v, v_ref)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [H, n, D] gathered at idx [H, j] -> [H, j, D]."""
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))


def _keep_in_chunk(k, v, chunk, ref, keep):
    """Indices (time order) of the ``keep`` best tokens of ``chunk`` [H, c] against ``ref`` [H, m]."""
    scores = lagkv_scores(_take(k, chunk), _take(v, chunk), _take(k, ref), _take(v, ref))
    return chunk.gather(1, scores.topk(keep, dim=-1).indices.sort(dim=-1).values)


def lagkv_select(k, v, num_compressed: int, limit: int, reserve: int, p: LagKVParams) -> tuple[torch.Tensor, int]:
    """One row's keep set: (indices [H, K] in time order, tokens now in the compressed region).

    k, v: [H, n, D] the row's live tokens in time order; the first ``sink_tokens`` are sinks and the next
    ``num_compressed`` were compressed before. The compressed region is capped at
    ``limit - sinks - max(tail, reserve)`` (decode: limit = budget, reserve = 2L; prompt: limit = kept, reserve 0).
    """
    heads, n, _ = k.shape
    sinks, lag = min(p.sink_tokens, n), p.lag
    per_chunk = max(1, int(p.ratio * lag))
    idx = torch.arange(n, device=k.device).expand(heads, -1)
    raw_start = sinks + num_compressed
    chunks = (n - raw_start) // lag
    if chunks < 2:
        return idx, num_compressed
    tail_start = raw_start + (chunks - 1) * lag
    body = idx[:, raw_start:tail_start].reshape(heads, chunks - 1, lag)
    shape = (heads, chunks - 1, lag, k.shape[-1])
    body_kv = [x[:, raw_start:tail_start].reshape(shape) for x in (k, v)]  # contiguous ranges: views, no gather
    ref_kv = [x[:, raw_start + lag:tail_start + lag].reshape(shape) for x in (k, v)]
    scores = lagkv_scores(body_kv[0], body_kv[1], ref_kv[0], ref_kv[1])  # [H, m, L]
    kept = body.gather(2, scores.topk(per_chunk, dim=-1).indices.sort(dim=-1).values).flatten(1)
    region = torch.cat([idx[:, sinks:raw_start], kept], dim=1)
    tail = idx[:, tail_start:]
    room = limit - sinks - max(tail.shape[1], reserve)
    while region.shape[1] > max(room, 0):
        size = min(lag, region.shape[1])
        keep = min(int(p.ratio * size), size - 1)
        ref = torch.cat([region[:, size:], tail], dim=1)[:, :lag]
        oldest = _keep_in_chunk(k, v, region[:, :size], ref, keep) if keep > 0 else region[:, :0]
        region = torch.cat([oldest, region[:, size:]], dim=1)
    return torch.cat([idx[:, :sinks], region, tail], dim=1), region.shape[1]


def lagkv_sizes(n: int, num_compressed: int, limit: int, reserve: int, p: LagKVParams) -> tuple[int, int]:
    """What ``lagkv_select`` returns the sizes of, from the sizes alone: (tokens kept, tokens now in the
    compressed region). Its shapes depend on the counts only, never on K or V, so the host can follow every
    slot's fill (``kvroll/rollout/schedule.py``) without reading the device."""
    sinks, lag = min(p.sink_tokens, n), p.lag
    per_chunk = max(1, int(p.ratio * lag))
    raw_start = sinks + num_compressed
    chunks = (n - raw_start) // lag
    if chunks < 2:
        return n, num_compressed
    tail_start = raw_start + (chunks - 1) * lag
    region, tail = num_compressed + (chunks - 1) * per_chunk, n - tail_start
    room = limit - sinks - max(tail, reserve)
    while region > max(room, 0):
        size = min(lag, region)
        region -= size - max(0, min(int(p.ratio * size), size - 1))
    return sinks + region + tail, region


class LagKVPolicy:
    """Periodic LagKV under a static budget (see the module docstring for the rule)."""

    name, periodic, stat, granularity = "lagkv", True, None, "head"
    keeps_in_time_order = True  # ``compress`` lists the kept tokens in time order (``CompressedKVCache.compact``)
    prompt_uses_values = True  # the cache passes the prompt's V to prompt_keep_idx

    def __init__(self, params: LagKVParams):
        self.params = params

    def validate_budget(self, budget):
        p = self.params
        check_budget(self.name, budget, p.sink_tokens + 3 * p.lag,
                     f"sink_tokens={p.sink_tokens} + 3 x lag={p.lag}: sinks, a compressed region of at least one "
                     "lag and a raw tail of up to 2 lags; lower lag for small budgets")

    def protected(self):
        return self.params.sink_tokens, self.params.lag

    def capacity(self, budget, max_len):
        return budget

    def prompt_keep(self, budget):
        return budget - 1

    def init_state(self, cache):
        shape = (cache.num_layers, cache.slots)
        return {"compressed": torch.zeros(shape, dtype=torch.int64, device=cache.k.device)}  # [L, S]

    def reset_slot(self, cache, slot, prompt):
        cache.state["compressed"][:, slot] = self.host_reset(prompt.k.shape[2], prompt.length)

    # the host schedule (kvroll/rollout/schedule.py): a slot's compressed count follows from the sizes alone
    def host_reset(self, kept: int, length: int) -> int:
        """The compressed count of a slot holding a placed prompt of ``length`` tokens, ``kept`` of them."""
        p = self.params
        return kept - p.sink_tokens - (p.lag + (length - p.sink_tokens) % p.lag) if kept < length else 0

    def host_place(self, kept: int, length: int, capacity: int) -> tuple[int, int]:
        """(steps until the slot is full, its compressed count) for a placed prompt of ``length``, ``kept``."""
        return capacity - kept, self.host_reset(kept, length)

    def host_next(self, size: int, capacity: int) -> tuple[int, int]:
        """(steps until the slot is full again, its compressed count) after compressing it: a full slot
        (``capacity`` live tokens) keeps what ``lagkv_select`` keeps, from the sizes alone."""
        kept, after = lagkv_sizes(capacity, size, capacity, 2 * self.params.lag, self.params)
        if kept >= capacity:  # an invariant of the static-budget rule, not an input error
            raise RuntimeError(f"lagkv: a compression of a full slot (compressed region {size} of {capacity}) "
                               f"would free no room; the decode could not go on. This is a kvroll bug.")
        return capacity - kept, after

    batches_layers = True  # ``compress`` takes a slice of layers too (``CompressedKVCache.compress_index``)

    def row_elems(self, cache) -> int:
        """Elements an event holds per (layer, slot) row: its keys and values [Hkv, C, D] each, copied when a call
        takes several layers of a slot range (no view spans them), and their fp32 normalised chunks, that many
        elements again (one of K / V at a time). So a layer-batched call's transient memory stays near what a
        256-slot event takes layer by layer (views, and the fp32 chunks)."""
        return 2 * cache.capacity * cache.num_kv_heads * cache.head_dim

    def compress(self, cache, layer, slots):
        """Every row's keep set, rows batched: [n, Hkv, K] (time order, padded by repeating the last index)
        and the live counts [n, Hkv]; ``layer`` a slice: [layers x n, Hkv, K] and [layers x n, Hkv], layer-major.

        ``lagkv_select`` treats dim 0 generically and its shapes depend only on the compressed count, so the
        rows that share one (in every layer of the call: the count is the same in every layer, each event
        compresses them all) are folded into the head dim and selected together. The counts come from the host
        schedule when it runs the event (``cache.event_counts``, one per slot, equal counts adjacent: each group
        is a range of ``slots``, no host tensor, so the event can be captured in a CUDA graph), else from the
        device (one host sync per call).
        """
        p = self.params
        layers = layer_slice(layer)
        compressed = cache.state["compressed"][layers]  # [l, S]
        counts = getattr(cache, "event_counts", None)
        groups: dict[int, list[int]] = {}
        for row, count in enumerate(counts if counts is not None else compressed[0, slots].tolist()):
            groups.setdefault(count, []).append(row)
        n, heads = slots.shape[0], cache.k.shape[2]
        k_all, v_all = cache.k[layers], cache.v[layers]  # [l, S, Hkv, C, D] views
        span = getattr(cache, "event_span", None)
        parts = []
        for count, rows in groups.items():
            if len(groups) == 1:
                idx = None
            elif rows == list(range(rows[0], rows[-1] + 1)):
                idx = slice(rows[0], rows[-1] + 1)
            else:
                idx = torch.tensor(rows, device=slots.device)
            sel = slots if idx is None else slots[idx]
            # [l * m * Hkv, C, D]: full, every slot live and in time order; views when every row is taken and the
            # slots are one contiguous range (``cache.event_span``)
            if idx is None and span is not None:
                k, v = k_all[:, span], v_all[:, span]
            else:
                k, v = k_all[:, sel], v_all[:, sel]
            k, v = k.flatten(0, 2), v.flatten(0, 2)
            keep, new_count = lagkv_select(k, v, count, cache.capacity, 2 * p.lag, p)
            compressed.index_fill_(1, sel, new_count)  # a scalar fill: no host tensor (graph capture)
            parts.append((idx, keep.view(k_all.shape[0], len(rows), heads, -1)))
        if len(parts) == 1:
            keep = parts[0][1].flatten(0, 1)
            return keep, torch.full(keep.shape[:2], keep.shape[-1], dtype=torch.int64, device=keep.device)
        width = max(keep.shape[-1] for _, keep in parts)
        keep_idx = torch.empty(k_all.shape[0], n, heads, width, dtype=torch.int64, device=slots.device)
        counts = torch.empty(k_all.shape[0], n, heads, dtype=torch.int64, device=slots.device)
        for idx, keep in parts:
            keep_idx[:, idx] = torch.cat([keep, keep[..., -1:].expand(-1, -1, -1, width - keep.shape[-1])], dim=-1)
            if isinstance(idx, slice):
                counts[:, idx] = keep.shape[-1]
            else:
                counts.index_fill_(1, idx, keep.shape[-1])
        return keep_idx.flatten(0, 1), counts.flatten(0, 1)

    def prompt_keep_idx(self, q, k, keep, scale, generator=None, v=None):
        """A long prompt's keep set: at most ``keep`` (= budget - 1) tokens, its compressed region capped as a
        decode compression caps it (budget - S - 2L: reserve 2L - 1 under a limit of budget - 1), so the raw tail
        can reach 2L before the cache is full and the first decode compression has a chunk to compress. (Before
        session 16 the reserve was 0: the region could fill the budget, the first decode compression found fewer
        than 2L raw tokens and compressed nothing, and the full slot then overwrote its newest token every step.)"""
        if v is None:
            raise ValueError("lagkv scores prompts with their values: the cache must pass v=")
        idx, _ = lagkv_select(k, v, 0, keep, 2 * self.params.lag - 1, self.params)
        return idx
