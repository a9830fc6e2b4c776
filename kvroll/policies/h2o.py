"""H2O (Zhang et al., 2023): heavy hitters by accumulated attention, plus a recent window.

Every decode step adds the attention each cached token receives (summed over the KV group's query heads) to its
running total; once the cache is full, the token with the smallest total outside the protected recent window is
overwritten, per KV head. The paper splits the budget half heavy hitters, half recent tokens
(``window=None`` -> budget // 2). A slot's total restarts at 0 when a new token is written into it. Prompt
attention is not accumulated (the prompt's tokens start at 0 and collect decode attention); prompts over budget
are cut with SnapKV scores (window = the recent window).

    CompressionConfig(policy="h2o", budget=256)              # 128 heavy hitters + 128 recent
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvroll.policies.base import check_budget, check_int, check_range
from kvroll.policies.snapkv import snapkv_prompt_keep


@dataclass(frozen=True)
class H2OParams:
    """H2O hyperparameters: ``window`` recent tokens protected (None = half the budget), ``sink_tokens`` = 0."""

    window: int | None = None
    sink_tokens: int = 0

    def __post_init__(self):
        if self.window is not None:
            check_int("H2OParams", "window", self.window, 1)
        check_int("H2OParams", "sink_tokens", self.sink_tokens, 0)


class H2OPolicy:
    """Every-step eviction of the smallest accumulated attention (see the module docstring)."""

    name, periodic, stat, granularity = "h2o", False, "mass", "head"

    def __init__(self, params: H2OParams):
        self.params = params
        self._window = params.window or 1

    def window_for(self, budget: int) -> int:
        """The protected recent window: ``window`` or, by default, half the budget (the paper's split)."""
        return self.params.window if self.params.window is not None else max(1, budget // 2)

    def validate_budget(self, budget):
        p = self.params
        if p.window is None:  # the default window, budget // 2, fits beside the sinks iff budget > 2 * sink_tokens:
            # blame the budget the user set, not a window they never touched
            check_budget(self.name, budget, max(p.sink_tokens + 2, 2 * p.sink_tokens + 1),
                         f"sink_tokens={p.sink_tokens} + the default window (budget // 2) + at least one heavy hitter")
        else:
            check_budget(self.name, budget, p.sink_tokens + 2, f"sink_tokens={p.sink_tokens} + the current token + one")
        window = self.window_for(budget)
        check_range("H2OParams", "window", window, p.sink_tokens + window < budget,
                    f"< budget - sink_tokens = {budget - p.sink_tokens} (budget={budget}) so heavy hitters fit")

    def protected(self):
        return self.params.sink_tokens, self._window

    def capacity(self, budget, max_len):
        return budget

    def prompt_keep(self, budget):
        return budget - 1

    def init_state(self, cache):
        self._window = self.window_for(cache.budget)
        shape = (cache.num_layers, cache.slots, cache.num_kv_heads, cache.capacity)
        return {"acc": torch.zeros(shape, dtype=torch.float32, device=cache.k.device)}  # [L, S, Hkv, C]

    def observe(self, cache, layer, q, stat):
        acc = cache.state["acc"][layer]  # [S, Hkv, C]
        acc.scatter_(2, cache.write_idx[layer][:, :, None], 0.0)  # this step's token replaced the slot's old one
        acc.add_(stat)

    def reset_slot(self, cache, slot, prompt):
        cache.state["acc"][:, slot] = 0.0

    def step_scores(self, cache, layer, stat):
        return cache.state["acc"][layer]

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        return snapkv_prompt_keep(q, k, keep, scale, window=min(self._window, keep - 1),
                                  sinks=self.params.sink_tokens)
