"""Hard-KV (papers/hard-kv.txt): head-adaptive top-p compression on calibrated scores in a static layout.

Cascade cache per (row, KV head), every head with the same capacity (budget + interval) and its own live count:

* tier 1, dense: the ``sink_tokens`` first and the ``window`` newest tokens, always kept;
* tier 2, sparse: every ``interval`` (128) decode steps the other live tokens are scored and each head keeps the
  fewest whose *calibrated* probability mass reaches ``p`` (top-p), clamped to [``min_keep``, ``max_keep``]
  (``max_keep=None``: budget - sinks - window, the tier's room);
* tier 3, condensed: the kept tokens are rewritten to the front of the head's slots, so attention (masked by
  position >= 0) and the GPU kernel (per-head live length) read only the live ones.

Votes and cautious update: between two compressions every query adds its attention (summed over the group's
query heads) to each token's votes; a token is scored only once it has left the dense window, and one dropped
from the sparse tier is gone for good (it never returns).

Base scores s (``base``): ``attention`` = log of the votes; ``snapkv`` = log of the votes ``max_pool1d(5)``-ed along
tokens (the paper's SnapKV adaptation, section 4: max-pooling, which commutes with the log, so pooling the scores or
the logits selects the same tokens; both bases order-preserving, the paper's solution 1 and its appendix D.2, which
excludes arithmetic means: SnapKV's own average pooling is not used here); ``rkv`` = lambda * maxpool7(votes
distribution) - (1 - lambda) * R-KV redundancy (solution 2). Calibration: softmax(s / T) with a per-(row, layer,
head) temperature T such that the mass of its top-n tokens equals p, where n is the count top-p selects on the raw
attention (the votes normalised over the candidates), *top-n by score* (the authors' code used the first n in time
order: not copied). T is solved by bisection on log T at a sequence's first compression and reused.

    CompressionConfig(policy="hardkv", budget=1024, p=0.9, base="snapkv")
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvroll.policies.base import (ascending_slots, check_budget, check_float, check_int, check_range,
                                  hole_fill_slots, layer_major, layer_slice, layer_slot_index, slot_rows)
from kvroll.policies.rkv import RKVParams, rkv_redundancy_fast
from kvroll.policies.snapkv import snapkv_prompt_keep
from kvroll.policies.window import layer_rows, repeat_layers

BASES = ("attention", "snapkv", "rkv")


@dataclass(frozen=True)
class HardKVParams:
    """Hard-KV hyperparameters (p = 0.9, compression every 128 steps)."""

    p: float = 0.9
    base: str = "attention"
    interval: int = 128
    window: int = 32
    sink_tokens: int = 4
    min_keep: int = 8
    max_keep: int | None = None
    pool_kernel: int = 5
    calibration_iters: int = 60

    def __post_init__(self):
        name = "HardKVParams"
        check_float(name, "p", self.p, 0.0, 1.0, low_open=True)
        check_range(name, "base", self.base, self.base in BASES, f"one of {list(BASES)}")
        check_int(name, "interval", self.interval, 1)
        check_int(name, "window", self.window, 1)
        check_int(name, "sink_tokens", self.sink_tokens, 0)
        check_int(name, "min_keep", self.min_keep, 0)
        if self.max_keep is not None:
            check_int(name, "max_keep", self.max_keep, max(1, self.min_keep))
        check_int(name, "pool_kernel", self.pool_kernel, 1)
        check_range(name, "pool_kernel", self.pool_kernel, self.pool_kernel % 2 == 1, "odd")
        check_int(name, "calibration_iters", self.calibration_iters, 1)


def descending_order(scores: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """Slot indices [..., C] by descending score, candidates first (ties: lower index first).

    softmax(scores / T) is monotone in the scores for every T > 0, so this one sort also orders the calibrated
    probabilities: the calibration's 60 iterations and the keep step reuse it instead of sorting again.
    """
    masked = scores.masked_fill(~cand, float("-inf"))
    return masked.sort(dim=-1, descending=True, stable=True).indices


def top_p_count(probs: torch.Tensor, p: float, order: torch.Tensor | None = None) -> torch.Tensor:
    """Fewest entries whose mass reaches p, per row of probs [..., N] (sums to 1 over the support).

    ``order`` [..., N] (optional) lists the entries by descending probability (``descending_order``), which
    replaces the sort.
    """
    ranked = probs.sort(dim=-1, descending=True).values if order is None else probs.gather(-1, order)
    mass = ranked.cumsum(dim=-1)
    return ((mass < p - 1e-6).sum(dim=-1) + 1).clamp(max=probs.shape[-1])


def top_n_mass(scores: torch.Tensor, cand: torch.Tensor, temp: torch.Tensor, n: torch.Tensor,
               order: torch.Tensor | None = None) -> torch.Tensor:
    """Mass of the n highest-score candidates under softmax(scores / temp). [..., C] -> [...].

    ``order``: ``descending_order(scores, cand)``, computed here when not given.
    """
    if order is None:
        order = descending_order(scores, cand)
    probs = (scores / temp[..., None]).masked_fill(~cand, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    ranked = probs.gather(-1, order)  # non-increasing: the sorted probabilities
    first = torch.arange(scores.shape[-1], device=scores.device) < n[..., None]
    return (ranked * first).sum(dim=-1)


def calibrate_temperature(scores, attention, cand, p: float, iters: int = 60,
                          order: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head T with top-n mass of softmax(scores / T) = p, n = top-p count of ``attention`` (raw).

    scores, attention [..., C] (attention sums to 1 over ``cand``); returns T [...] fp32. The mass falls as T
    grows (from 1 toward n / N), so bisection on log T over [1e-4, 1e4] x the score spread converges; a head whose
    target is unreachable (n = N) gets the nearest end. ``order``: ``descending_order(scores, cand)`` (sorted
    once here when not given, then reused by every iteration).
    """
    if order is None:
        order = descending_order(scores, cand)
    n = top_p_count(attention.masked_fill(~cand, 0.0), p)
    spread = (scores.masked_fill(~cand, float("-inf")).amax(-1) - scores.masked_fill(~cand, float("inf")).amin(-1))
    spread = spread.nan_to_num(1.0, posinf=1.0, neginf=1.0).clamp_min(1e-6)
    low, high = (spread * 1e-4).log(), (spread * 1e4).log()
    for _ in range(iters):
        mid = (low + high) / 2
        above = top_n_mass(scores, cand, mid.exp(), n, order) > p  # too peaked: raise T
        low, high = torch.where(above, mid, low), torch.where(above, high, mid)
    return ((low + high) / 2).exp()


class HardKVPolicy:
    """Head-adaptive calibrated top-p compression every ``interval`` steps (see the module docstring)."""

    name, periodic, stat, granularity = "hardkv", True, "mass", "head"
    # The attention base reads no neighbour along the slots, so its compaction fills the holes below each head's
    # count with the kept tokens past it (``hole_fill_slots``) instead of moving every kept token after the first
    # eviction down in time order (session 35, H100, batch 256: the engine's event 15.6 -> 6.4 ms). Its rows are
    # then not in time order (``CompressedKVCache.time_ordered`` is False under it). The snapkv base pools
    # neighbouring slots and the rkv base's scan reads them in order: those keep the time-ordered compaction.
    # False: time order for every base (the A/B's "old").
    hole_fill = True

    @property
    def fills_holes(self) -> bool:
        return self.hole_fill and self.params.base == "attention"

    @property
    def keeps_in_time_order(self) -> bool:
        """``compress`` lists the kept tokens in time order (``CompressedKVCache.compact``), unless it fills holes."""
        return not self.fills_holes

    def __init__(self, params: HardKVParams):
        self.params = params

    def sparse_room(self, budget: int) -> int:
        """The per-head cap of the sparse tier: budget - sinks - window, or ``max_keep`` if smaller."""
        p = self.params
        room = budget - p.sink_tokens - p.window
        return room if p.max_keep is None else min(room, p.max_keep)

    def validate_budget(self, budget):
        p = self.params
        check_budget(self.name, budget, p.sink_tokens + p.window + max(1, p.min_keep),
                     f"sink_tokens={p.sink_tokens} + window={p.window} (the dense tier) + min_keep={p.min_keep} "
                     "(at least 1); raise the budget or lower window")
        if p.max_keep is not None:
            check_range("HardKVParams", "max_keep", p.max_keep, p.max_keep <= budget - p.sink_tokens - p.window,
                        f"<= budget - sink_tokens - window = {budget - p.sink_tokens - p.window}")

    def protected(self):
        return self.params.sink_tokens, self.params.window

    def capacity(self, budget, max_len):
        return budget + self.params.interval

    def prompt_keep(self, budget):
        return budget

    def init_state(self, cache):
        layers, slots, heads, dev = cache.num_layers, cache.slots, cache.num_kv_heads, cache.k.device
        return {
            "votes": torch.zeros(layers, slots, heads, cache.capacity, device=dev),  # [L, S, Hkv, C] attention
            "temp": torch.zeros(layers, slots, heads, device=dev),  # [L, S, Hkv]; 0 = not calibrated yet
            # [L, S] position of the last compression (same in every layer; [L, S] so slot moves carry it)
            "last": torch.zeros(layers, slots, dtype=torch.int64, device=dev),
        }

    def steps_until_due(self, cache) -> torch.Tensor:
        """[slots] decode steps left before the next compression (every ``interval`` steps)."""
        by_interval = self.params.interval - (cache.cur_pos - cache.state["last"][0])
        return torch.minimum(by_interval, cache.capacity - cache.count.amax(dim=0).amax(dim=-1))

    def observe(self, cache, layer, q, stat):
        cache.state["votes"][layer].add_(stat)

    def stat_sum(self, cache, layer):
        """The running sum ``observe`` adds the statistic into: the decode kernel adds it there itself."""
        return cache.state["votes"][layer]

    def reset_slot(self, cache, slot, prompt):
        cache.state["votes"][:, slot] = 0.0
        cache.state["temp"][:, slot] = 0.0
        cache.state["last"][:, slot] = prompt.length

    def tiers(self, pos, cur):
        """(dense, cand) [r, Hkv, C] for positions ``pos`` of rows decoding ``cur`` [r]: dense = the live sinks and
        window, cand = the other live tokens (the scored ones)."""
        p = self.params
        live = pos >= 0
        dense = live & ((pos < p.sink_tokens) | (pos >= (cur - p.window)[:, None, None]))
        return dense, live & ~dense

    def base_values(self, votes, cand) -> torch.Tensor:
        """The attention and snapkv bases' scores before their log, [n, Hkv, C] (> 0): the votes (max-pooled for
        snapkv) clamped to 1e-30. Their order is the scores' but strict where fp32's log maps two values a few
        ulps apart to one score: the keep step ranks by them (``scores_and_order``)."""
        p = self.params
        votes = votes * cand
        if p.base == "snapkv":
            n, heads, cap = votes.shape
            votes = F.max_pool1d(votes.view(n * heads, 1, cap), p.pool_kernel, 1, p.pool_kernel // 2).view(n, heads,
                                                                                                            cap)
        return votes.clamp_min(1e-30)

    def scores_and_order(self, votes, cand, k, pos, time_ordered: bool = False):
        """(``base_scores``, ``descending_order`` of the candidates): the log bases ranked by their values
        (``base_values``: the scores' order, but where fp32's log maps two values a few ulps apart to one score,
        the larger value first, as the keep kernel ranks them, not the lower slot). The calibrated probabilities
        are a function of the score, so they stay non-increasing along this order."""
        if self.params.base in ("attention", "snapkv"):
            values = self.base_values(votes, cand)
            return values.log(), descending_order(values, cand)
        scores = self.base_scores(votes, cand, k, pos, time_ordered)
        return scores, descending_order(scores, cand)

    def base_scores(self, votes, cand, k, pos, time_ordered: bool = False) -> torch.Tensor:
        """Base score s [n, Hkv, C] of the candidates (see the module docstring). ``k``: the keys [n, Hkv, C, D],
        or a callable returning them (read by the R-KV base only). ``time_ordered``: as
        ``rkv_redundancy_fast``'s (the engine's caches are; it spares the R-KV base a host sync)."""
        p = self.params
        if p.base in ("attention", "snapkv"):
            return self.base_values(votes, cand).log()
        votes = votes * cand
        rkv = RKVParams()
        dist = votes / votes.sum(-1, keepdim=True).clamp_min(1e-30)
        n, heads, cap = votes.shape
        importance = F.max_pool1d(dist.view(n * heads, 1, cap), rkv.pool_kernel, 1, rkv.pool_kernel // 2)
        k = k() if callable(k) else k
        redundancy = rkv_redundancy_fast(k, pos >= 0, pos, rkv.threshold, rkv.beta, time_ordered)
        return rkv.mix_lambda * importance.view(n, heads, cap) - (1 - rkv.mix_lambda) * redundancy

    # the host schedule (kvroll/rollout/schedule.py): the next compression is always ``interval`` steps away (a
    # placed prompt keeps <= budget tokens and a compression <= sinks + window + the sparse room <= budget, so the
    # capacity, budget + interval, never binds first), and a slot's size is whether it was calibrated (0: not yet)
    def host_place(self, kept: int, length: int, capacity: int) -> tuple[int, int]:
        """(steps until the slot's first compression, its size: 0, uncalibrated) for a placed prompt."""
        return self.params.interval, 0

    def host_next(self, size: int, capacity: int) -> tuple[int, int]:
        """(steps until the next compression, the size after this one: 1, calibrated)."""
        return self.params.interval, 1

    # ``compress`` takes a slice of layers too (``CompressedKVCache.compress_index``): an event on few slots scores
    # and compacts several layers per call, ~70 kernels a call instead of ~62 a layer. Session 29 (H100, 28 layers,
    # graph replay, benchmarks/event_profile.py): an event on 64 slots 7.44 -> 4.92 ms (1,736 -> 518 kernels), on 8
    # slots 4.60 -> 0.70 ms (1,849 -> 76); in the engine Hard-KV's steps, events included, 0.6% (batch 64) and 1.3%
    # (batch 16) shorter. On the CPU a batched call keeps what layer by layer keeps, bit for bit (the test). On a GPU
    # torch's sums over a row may round in another order when the call holds more rows (its reduction kernels are
    # configured by the row count, as between two batch sizes of the engine already), so a head's top-p count can
    # move by a token at the edge of p: at 64 slots the event kept 2 tokens more of 2,268,381 (c3's checksums).
    batches_layers = True  # False: one layer per call (before session 29; the engine A/B's "old")

    def row_elems(self, cache) -> int:
        """Elements per (layer, slot) row that size a layer-batched call (``CompressedKVCache.compress_index``): its
        keys [Hkv, C, D], as the windowed policies count them, whatever the base (the R-KV base gathers the keys;
        the others hold only [Hkv, C] tensors, ~13 of them fp32 or int64 at once). So a call holds as many rows
        as a 256-slot event layer by layer at Qwen3-1.7B's shapes (budget 1,024 + interval 128): 256 (4 layers
        of a 64-slot event), and its transient memory stays near that event's."""
        return cache.capacity * cache.num_kv_heads * cache.head_dim

    # A calibrated event on the host's schedule in a time-ordered cache scores and selects in one Triton kernel
    # (``kvroll/kernels/hardkv_keep.py``: no sort, no scans; the new rows' temperatures are still calibrated here
    # first). False: the torch path below for every event (the A/B's "old").
    keep_kernel = True
    # and the new rows' temperatures in one kernel too (``hardkv_calibrate``: T to the bisection's rounding, not bit
    # for bit); False: ``_calibrate``, the torch path's bisection on the new rows (the A/B's "old")
    calibrate_kernel = True

    def _uses_kernel(self, cache) -> bool:
        from kvroll.kernels.hardkv_keep import triton

        return (self.keep_kernel and triton is not None and self.params.base in ("attention", "snapkv")
                and (self.fills_holes or getattr(cache, "time_ordered", False))
                and getattr(cache, "event_counts", None) is not None
                and (cache.pos.is_cuda or getattr(cache, "kernel_on_cpu", False)))

    def _compress_kernel(self, cache, layer, slots):
        """``compress`` on the host's schedule through ``hardkv_keep``: the same keep sets (up to a rounding at
        the edge of p, see the kernel's docstring) in the same order (``hole_fill_slots``'s or ascending), int32."""
        from kvroll.kernels.hardkv_keep import hardkv_calibrate, hardkv_keep, keep_threshold

        p, state = self.params, cache.state
        full = {t.stride(0) // t.stride(1) for t in (cache.pos, state["votes"], state["temp"])}
        assert len(full) == 1, "the cache's buffers and Hard-KV's state share one slot stride"
        bufs = layer_major(cache.pos), layer_major(state["votes"]), layer_major(state["temp"])
        pool = p.pool_kernel if p.base == "snapkv" else 1
        new = cache.event_counts.count(0)
        if new and self.calibrate_kernel:  # the new rows' heads first (the bisection on T), as the torch path
            fresh = slots[:new]
            hardkv_calibrate(*bufs, layer_slot_index(cache.pos, layer, fresh),
                             repeat_layers(cache.cur_pos[fresh], layer), sinks=p.sink_tokens, window=p.window,
                             p=p.p, iters=p.calibration_iters, pool=pool)
        elif new:
            self._calibrate(cache, layer, slots[:new])
        rows = layer_slot_index(cache.pos, layer, slots)
        cur = repeat_layers(slot_rows(cache, cache.cur_pos, slots), layer).to(torch.int64)
        return hardkv_keep(*bufs, rows, cur, sinks=p.sink_tokens, window=p.window, thr=keep_threshold(p.p),
                           min_keep=p.min_keep, room=self.sparse_room(cache.budget),
                           width=min(cache.budget, cache.capacity),
                           pool=pool, top_p=p.p < 1, hole_fill=self.fills_holes)

    def _calibrate(self, cache, layer, slots):
        """Set the temperature of every uncalibrated head of ``slots`` (in each layer of ``layer``) as ``compress``
        calibrates them: the rows gathered, their base scores, the bisection on log T."""
        p, state = self.params, cache.state
        rows = layer_slot_index(cache.pos, layer, slots)
        pos = layer_major(cache.pos)[rows]
        cur = repeat_layers(cache.cur_pos[slots], layer)
        cand = self.tiers(pos, cur)[1]
        votes = layer_major(state["votes"])[rows]
        scores, order = self.scores_and_order(votes, cand, None, pos)
        part = votes * cand
        attention = part / part.sum(-1, keepdim=True).clamp_min(1e-30)
        temp = layer_major(state["temp"])[rows]
        calibrated = calibrate_temperature(scores, attention, cand, p.p, p.calibration_iters, order)
        layer_major(state["temp"])[rows] = torch.where(temp <= 0, calibrated, temp)

    def compress(self, cache, layer, slots):
        """Each row's kept slots, kept first in time order (the attention base: in ``hole_fill_slots``'s order),
        [n, Hkv, K], and the live counts [n, Hkv]; ``layer`` a slice: [layers x n, Hkv, K] and [layers x n, Hkv],
        layer-major (each row scored alone, as layer by layer).

        The rows whose heads are not calibrated yet (new sequences) are calibrated here. The host schedule names
        them (``cache.event_counts``: each slot's size, uncalibrated 0 first), and the keep sets are cut to the
        static bound ``budget``: no host read, so the event can be captured in a CUDA graph. Otherwise the device
        says which rows they are (one host sync per call). The width is ``budget`` either way (before session 29
        the device's largest count there, a second sync): the compaction moves only the first count entries of a
        row, and the torch path's dead slots then hold the same values whether the layers were batched or not."""
        if self._uses_kernel(cache):
            return self._compress_kernel(cache, layer, slots)
        p = self.params
        pos = layer_rows(cache, cache.pos, layer, slots)  # [r, Hkv, C], r = layers x n
        cur = repeat_layers(slot_rows(cache, cache.cur_pos, slots), layer)
        dense, cand = self.tiers(pos, cur)
        votes = layer_rows(cache, cache.state["votes"], layer, slots)
        keys = lambda: layer_rows(cache, cache.k, layer, slots)  # noqa: E731 (gathered only if read: R-KV base)
        # [r, Hkv, C] each, the order the only sort of the scores
        scores, order = self.scores_and_order(votes, cand, keys, pos, getattr(cache, "time_ordered", False))
        temp = layer_rows(cache, cache.state["temp"], layer, slots)
        fresh = temp <= 0
        sizes = getattr(cache, "event_counts", None)
        span = layer_slice(layer)
        layers = span.stop - span.start
        if sizes is not None:  # the host's: the uncalibrated slots come first (in each layer's n rows)
            new = sizes.count(0)
            rows = slice(0, new) if layers == 1 else (  # a device index: no host tensor (graph capture)
                torch.arange(layers, device=pos.device)[:, None] * slots.shape[0]
                + torch.arange(new, device=pos.device)).flatten()
            calibrate = new > 0
        else:
            rows = fresh.any(dim=-1).nonzero()[:, 0]  # rows with an uncalibrated head (new sequences): one sync
            calibrate = bool(rows.numel())
        if calibrate:
            part = (votes * cand)[rows]
            attention = part / part.sum(-1, keepdim=True).clamp_min(1e-30)
            calibrated = calibrate_temperature(scores[rows], attention, cand[rows], p.p, p.calibration_iters,
                                               order[rows])
            temp = temp.clone()
            temp[rows] = torch.where(fresh[rows], calibrated, temp[rows])
            cache.state["temp"][span].index_copy_(1, slots, temp.view(layers, slots.shape[0], -1))
        probs = (scores / temp[..., None]).masked_fill(~cand, float("-inf")).softmax(-1).nan_to_num(0.0)
        num_cand = cand.sum(-1)
        keep_n = num_cand if p.p >= 1 else top_p_count(probs, p.p, order)  # p = 1 keeps every candidate
        keep_n = keep_n.clamp(min=p.min_keep, max=self.sparse_room(cache.budget))
        keep_n = torch.minimum(keep_n, num_cand)
        ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, ranks)  # rank[c] = place of slot c in the order
        keep = dense | (cand & (rank < keep_n[..., None]))
        # at most sinks + window + the sparse room <= budget are kept
        if self.fills_holes:
            return hole_fill_slots(keep, min(cache.budget, keep.shape[-1]))
        if sizes is not None and getattr(cache, "time_ordered", False):  # slot order is time order: no sort
            return ascending_slots(keep, min(cache.budget, keep.shape[-1]))
        # kept first in time order, then the rest (stable: their order, the dead slots' values past the count,
        # does not depend on the rows in the call)
        kept_first = torch.where(keep, pos.long(), pos.long() + (1 << 40)).argsort(dim=-1, stable=True)
        keep_count = keep.sum(-1)
        width = min(cache.budget, kept_first.shape[-1])
        return kept_first[..., :width], keep_count

    def after_compact(self, cache, layer, slots, keep_idx):
        """The compacted rows' votes start again from 0 and their next compression is ``interval`` steps away
        (``layer`` an int or a slice of layers)."""
        span = layer_slice(layer)
        cache.state["votes"][span].index_fill_(1, slots, 0.0)  # a scalar fill: no host tensor (graph capture)
        cache.state["last"][span].index_copy_(1, slots, cache.cur_pos[slots].expand(span.stop - span.start, -1))

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        return snapkv_prompt_keep(q, k, keep, scale, min(self.params.window, keep - 1), self.params.pool_kernel,
                                  sinks=self.params.sink_tokens)
