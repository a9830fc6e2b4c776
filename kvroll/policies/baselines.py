"""Baseline policies: ``full`` (no eviction), ``random`` (the control) and ``streaming`` (StreamingLLM).

    CompressionConfig(policy="streaming", budget=256, sink_tokens=4)
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from kvroll.policies.base import check_budget, check_int


def _keep_sinks_and_recent(length: int, keep: int, sinks: int, num_kv_heads: int, device) -> torch.Tensor:
    sinks = min(sinks, keep - 1)
    idx = torch.cat([torch.arange(sinks, device=device), torch.arange(length - (keep - sinks), length, device=device)])
    return idx.expand(num_kv_heads, -1)


@dataclass(frozen=True)
class FullParams:
    """No hyperparameters: every token is kept (capacity = longest prompt + max_new_tokens)."""


class FullPolicy:
    """No eviction. The reference every other policy is measured against.

    A budget given to ``full`` is ignored, with a ``UserWarning``: its cache holds the whole sequence (or, for a
    model with a sliding window W, the last W positions, as the model attends). It is accepted rather than refused
    so that one set of flags (``--budget``, ``kvroll_budget``) can switch between policies; a budget no policy
    takes (not an integer >= 1: ``"x"``, ``1.5``, ``True``, ``0``) is refused as every other policy refuses it.
    """

    name, periodic, stat, granularity = "full", False, None, "head"

    def __init__(self, params: FullParams):
        self.params = params

    def validate_budget(self, budget):
        if budget is not None:
            check_budget("full", budget, 1, "full ignores its budget but takes only one that a compressing policy "
                                            "could, so that one flag switches policies; or pass budget=None")
            warnings.warn(f"CompressionConfig.budget={budget!r} is ignored by policy 'full', whose cache holds "
                          "every token of prompt + max_new_tokens; pass budget=None (or choose a compressing "
                          "policy) to silence this.", UserWarning, stacklevel=3)

    def protected(self):
        return 0, 1

    def capacity(self, budget, max_len):
        return max_len

    def prompt_keep(self, budget):
        return 1 << 62

    def step_scores(self, cache, layer, stat):
        raise RuntimeError("policy 'full' never evicts: its capacity covers prompt + max_new_tokens")


def hash_uniform(x: torch.Tensor) -> torch.Tensor:
    """Counter-based pseudo-random numbers in [0, 1) from int64 counters (a murmur-style integer mix).

    Random eviction draws from these rather than from a torch.Generator: the draws then never shift the
    sampling stream (a budget that evicts nothing gives exactly the ``full`` tokens), they are reproducible, and
    a CUDA graph captures them without registering generator state.
    """
    x = x & 0x7FFFFFFF
    for mult in (0x5BD1E995, 0x27D4EB2D, 0x165667B1):
        x = ((x ^ (x >> 15)) * mult) & 0x7FFFFFFF
    return (x ^ (x >> 13)).double().div(2.0**31).float()


def sliding_window_ring() -> "StreamingPolicy":
    """``full`` for a model whose every layer attends only the last W positions, run in a cache of W slots.

    No sinks and a protected window of the current token: once W tokens are cached, each step overwrites the
    oldest, so the cache holds positions (p - W, p] at position p — transformers' sliding-window mask exactly.
    The prompt is cut to its last W - 1 tokens (the prefill itself attends with the window).
    """
    return StreamingPolicy(StreamingParams(sink_tokens=0))


@dataclass(frozen=True)
class RandomParams:
    """Uniform eviction among all but the current token; prompts are cut to a uniform random subset.

    ``seed`` varies the eviction stream (which is independent of the sampling seed). The decode-time draws also hash
    the cache slot a sequence occupies (so that two samples of one prompt evict differently): unlike every other
    policy, ``random``'s evictions, and so its tokens, depend on the batch layout (``max_batch``, refill order).
    """

    seed: int = 0

    def __post_init__(self):
        check_int("RandomParams", "seed", self.seed, 0)


class RandomPolicy:
    """Evicts a uniformly random token each step once full: the control an informed policy must beat."""

    name, periodic, stat, granularity = "random", False, None, "head"

    def __init__(self, params: RandomParams):
        self.params = params

    def validate_budget(self, budget):
        check_budget(self.name, budget, 2, "one slot for the current token and at least one evictable slot")

    def protected(self):
        return 0, 1

    def capacity(self, budget, max_len):
        return budget

    def prompt_keep(self, budget):
        return budget - 1

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        num_kv_heads, length, _ = k.shape
        heads = torch.arange(num_kv_heads, device=k.device)[:, None]
        counter = torch.arange(length - 1, device=k.device)[None] + 7919 * heads + 104729 * (length + self.params.seed)
        chosen = hash_uniform(counter).topk(keep - 1, dim=-1).indices
        last = torch.full((num_kv_heads, 1), length - 1, device=k.device, dtype=chosen.dtype)
        return torch.cat([chosen, last], dim=-1).sort(dim=-1).values

    def step_scores(self, cache, layer, stat):
        pos = cache.pos[layer].long()  # [S, Hkv, C]
        slots, heads, _ = pos.shape
        counter = (pos + 1_000_003 * cache.cur_pos[:, None, None] + 7919 * torch.arange(heads, device=pos.device)[:, None]
                   + 15_485_863 * torch.arange(slots, device=pos.device)[:, None, None] + 104_729 * layer
                   + 32_452_843 * self.params.seed)
        return hash_uniform(counter)


@dataclass(frozen=True)
class StreamingParams:
    """StreamingLLM (Xiao et al., 2023): ``sink_tokens`` attention sinks + the most recent tokens."""

    sink_tokens: int = 4

    def __post_init__(self):
        check_int("StreamingParams", "sink_tokens", self.sink_tokens, 0)


class StreamingPolicy:
    """Keeps the sinks and a sliding window of the most recent ``budget - sink_tokens`` tokens."""

    name, periodic, stat, granularity = "streaming", False, None, "head"

    def __init__(self, params: StreamingParams):
        self.params = params

    def validate_budget(self, budget):
        sinks = self.params.sink_tokens
        check_budget(self.name, budget, sinks + 2, f"sink_tokens={sinks} plus the current token plus one more")

    def protected(self):
        return self.params.sink_tokens, 1

    def capacity(self, budget, max_len):
        return budget

    def prompt_keep(self, budget):
        return budget - 1

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        return _keep_sinks_and_recent(k.shape[1], keep, self.params.sink_tokens, k.shape[0], k.device)

    def step_scores(self, cache, layer, stat):
        return cache.pos[layer].float()  # the oldest non-sink token goes first
