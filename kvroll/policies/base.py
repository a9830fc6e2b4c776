"""The eviction-policy protocol and the helpers every policy shares.

A policy is a frozen dataclass of its paper's hyperparameters plus a few methods; the cache
(``kvroll.rollout.cache``) owns budget accounting, sinks, the protected recent window and compaction.

Two kinds of policy exist:

* **step** policies (``periodic = False``: ``random``, ``streaming``, ``longflow``, ``h2o``) pick one slot to
  overwrite at every decode step once the cache is full: ``step_scores`` returns keep-scores (higher = keep)
  and the cache takes the argmin over evictable slots.
* **periodic** policies (``periodic = True``: ``rkv``, ``snapkv``, ``lagkv``, ``hardkv``) append new tokens
  until the cache is full and then ``compress`` selects what to keep; the cache compacts the kept tokens.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from kvroll.checks import as_int


@runtime_checkable
class Policy(Protocol):
    """What the cache and the engine ask of a policy (see the module docstring)."""

    name: str
    periodic: bool
    # What the decode attention must hand to ``step_scores``/``observe``: None, "contrib" (LongFlow
    # ||alpha_i v_i||_1 summed over the group's query heads) or "mass" (attention weight summed over the group).
    stat: str | None
    granularity: str  # "head": each KV head evicts its own token; "layer": one slot shared by all KV heads

    def protected(self) -> tuple[int, int]:
        """(sink tokens, recent window) that are never evicted; the window counts the current token."""

    def capacity(self, budget: int, max_len: int) -> int:
        """Cache slots per (sequence, KV head); ``max_len`` = longest prompt + max_new_tokens (for ``full``)."""

    def prompt_keep(self, budget: int) -> int:
        """How many prompt tokens survive prefill (a longer prompt is compressed to this many)."""

    def prompt_keep_idx(self, q, k, keep: int, scale: float, generator=None):
        """[Hkv, keep] indices of the prompt tokens kept when a prompt is longer than ``prompt_keep``."""

    def validate_budget(self, budget) -> None:
        """A ``ValueError`` naming the budget, the policy and the hyperparameters it must hold."""

    # A step policy (periodic False) has ``step_scores(cache, layer, stat) -> [S, Hkv, C]`` keep-scores; a periodic
    # one ``compress(cache, layer, slots) -> (keep [n, Hkv, K], counts [n, Hkv] or None)``. ``register_policy``
    # checks these and the methods above.
    #
    # Optional members, probed by the cache (``rollout/cache.py``), the host schedule (``rollout/schedule.py``) and
    # the bench; absent means the default in brackets:
    #   init_state(cache) -> dict             per-policy tensors in ``cache.state`` (H2O's sums, the query ring) [{}]
    #   observe(cache, layer, q, stat)        each decode step's statistic or queries, per layer [nothing]
    #   stat_sum(cache, layer) -> tensor      a running sum the decode kernel adds the statistic into [None]
    #   reset_slot(cache, slot, prompt)       a slot given a new prompt: its state cleared [nothing]
    #   after_compact(cache, layer, slots, keep_idx)  state kept in step with a compaction (Hard-KV) [nothing]
    #   steps_until_due(cache) -> [S]         compress every N steps, not when full (Hard-KV) [when full]
    #   kept_after_compress(budget) -> int    a constant size after each compression: the host plans them [None]
    #   host_place(kept, length, capacity) / host_next(size, capacity) -> (steps, size)
    #                                         per-slot sizes the host schedule follows (LagKV, Hard-KV) [None]
    #   keeps_in_time_order, fills_holes, batches_layers, prompt_uses_values, ring_in_rotary, argmin_on_stat
    #                                         flags the cache reads to pick its compaction, event batching, the
    #                                         prompt's V, the fused rotary's query ring and the fused argmin [False;
    #                                         argmin_on_stat: stat == "contrib"]


def check_range(cls_name: str, field: str, value: Any, ok: bool, allowed: str) -> None:
    """Raise the house-style ``ValueError`` naming the field, the value and what is allowed."""
    if not ok:
        raise ValueError(f"{cls_name}.{field}={value!r} is invalid: {field} must be {allowed}.")


def check_int(cls_name: str, field: str, value: Any, low: int) -> None:
    """A ``ValueError`` naming ``cls_name.field`` unless ``value`` is an integer (not a bool) >= ``low``."""
    is_int = as_int(value) is not None
    check_range(cls_name, field, value, is_int and value >= low, f"an integer >= {low}")


def check_float(cls_name: str, field: str, value: Any, low: float, high: float, low_open=False, high_open=False):
    """A ``ValueError`` naming ``cls_name.field`` unless ``value`` is a finite number in the (half-)open range."""
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = is_num and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    check_range(cls_name, field, value, ok, f"a number in {lo}{low}, {high}{hi}")


def make_params(params_cls: type, policy: str, kwargs: dict) -> Any:
    """Build a policy's frozen hyperparameter dataclass, rejecting unknown keywords by name."""
    names = {f.name for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise ValueError(
            f"CompressionConfig: unknown keyword(s) {unknown} for policy {policy!r}; "
            f"allowed keywords: {sorted(names) or 'none'}."
        )
    # numpy scalars are taken as Python numbers, as CompressionConfig takes a numpy budget (np.int64(7) was refused
    # as "not an integer"); a numpy bool stays refused where a number is wanted
    return params_cls(**{key: value.item() if isinstance(value, (np.integer, np.floating)) else value
                         for key, value in kwargs.items()})


def check_budget(policy: str, budget: Any, minimum: int, why: str) -> None:
    """A ``ValueError`` naming the budget and the policy unless it is an integer >= ``minimum`` (``why`` says why)."""
    is_int = as_int(budget) is not None
    if not is_int or budget < minimum:
        raise ValueError(
            f"CompressionConfig.budget={budget!r} is invalid for policy {policy!r}: budget must be an integer "
            f">= {minimum} ({why})."
        )


def slot_rows(cache, t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``t[slots]`` for a tensor indexed by slot on its first dim: a view instead of a gathered copy while the
    cache's ``compress_slots`` runs on one contiguous range of slots (``cache.event_span``)."""
    span = getattr(cache, "event_span", None)
    return t[span] if span is not None else t[slots]


def layer_major(t: torch.Tensor) -> torch.Tensor:
    """A per-(layer, slot) buffer [L, S, ...] (or a slot view of one: its first S of S' slots) as [L x S', ...]:
    row ``layer * S' + slot`` is (layer, slot). Needs the layer stride to be S' slot strides (the cache's buffers
    and policy state are allocated so)."""
    full = t.stride(0) // t.stride(1)
    assert t.stride(0) == full * t.stride(1) and full >= t.shape[1], (t.shape, t.stride())
    return t.as_strided((t.shape[0] * full, *t.shape[2:]), t.stride()[1:], t.storage_offset())


def layer_slice(layer: int | slice) -> slice:
    """A compression call's layers (``CompressedKVCache.compress_index``: one layer, or a slice of them) as a slice."""
    return layer if isinstance(layer, slice) else slice(layer, layer + 1)


def layer_slot_index(t: torch.Tensor, layer: int | slice, slots: torch.Tensor) -> torch.Tensor:
    """The rows of ``layer_major(t)`` holding ``slots`` in each layer of ``layer``, layer-major: [layers x n].
    Made on the device (no host tensor), so it may run inside a CUDA-graph capture."""
    span = layer_slice(layer)
    first, stop = span.start, span.stop
    full = t.stride(0) // t.stride(1)
    return (torch.arange(first * full, stop * full, full, device=slots.device)[:, None] + slots[None]).flatten()


def ascending_slots(keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The True slots of ``keep`` [..., C] in ascending slot order, [..., width] int64 (past each row's count:
    C - 1, a valid index that ``compact`` never keeps), and the counts [...]: a stable partition by one cumsum
    and one scatter, not a sort.

    On a time-ordered cache (``CompressedKVCache.time_ordered``: live positions ascend with the slot) this is
    the kept tokens in time order, already in the order ``CompressedKVCache.compact`` moves them. Every row's
    count must be <= width (unchecked: a check would synchronise)."""
    capacity = keep.shape[-1]
    dest = torch.where(keep, keep.cumsum(-1) - 1, width)  # a kept slot's place; the rest to a spare column
    out = torch.full((*keep.shape[:-1], width + 1), capacity - 1, dtype=torch.int64, device=keep.device)
    out.scatter_(-1, dest, torch.arange(capacity, device=keep.device).expand_as(dest))
    return out[..., :width], keep.sum(-1)


def hole_fill_slots(keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A compaction order that moves the fewest tokens: [..., width] int64 and the counts n [...]. Entry j < n is
    j where slot j is kept, else (a hole below n) the next kept slot at or past n, taken in ascending order; past n,
    C - 1 (as ``ascending_slots``). The kept set is the same; the slots below n keep their tokens, and only the
    kept tokens past n move (at most as many as were evicted below n), where a time-ordered compaction moves every
    kept token after the first eviction. Live positions then no longer ascend with the slot: a policy that
    compacts so (Hard-KV's ``fills_holes``) must not read its rows as time-ordered.

    In place (``CompressedKVCache.compact``'s kernel) the order is safe as it stands: every destination is below n
    and every source either the destination itself or a slot at or past n, which no entry writes."""
    capacity = keep.shape[-1]
    slots = torch.arange(capacity, device=keep.device)
    n = keep.sum(-1)
    below = slots < n[..., None]
    hole, tail = below & ~keep, keep & ~below
    tails = torch.full((*keep.shape[:-1], capacity + 1), capacity - 1, dtype=torch.int64, device=keep.device)
    tails.scatter_(-1, torch.where(tail, tail.cumsum(-1) - 1, capacity), slots.expand_as(keep))  # r-th tail slot
    fill = tails.gather(-1, (hole.cumsum(-1) - 1).clamp_min(0))  # the hole of rank r takes the r-th tail slot
    out = torch.where(keep & below, slots, torch.where(hole, fill, capacity - 1))
    return out[..., :width], n


def evictable_mask(pos: torch.Tensor, cur_pos: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Slots that may be overwritten: live, not a sink, older than the protected recent window.

    pos: [slots, kv_heads, capacity] true positions (-1 = empty); cur_pos: [slots] position being decoded.
    """
    limit = (cur_pos - window)[:, None, None]  # window >= 1 protects the current token itself
    return (pos >= sinks) & (pos <= limit)

