"""LongFlow (papers/longflow.txt): evict one token per step by its contribution to the current output.

score(i) = ||alpha_i * v_i||_1 from the current query alone, a by-product of the attention computation
(Algorithm 1). ``granularity="head"`` sums the score over each KV group's query heads and lets every KV head
evict its own token; ``granularity="layer"`` averages over all query heads of the layer, as the authors'
kernel does, so all KV heads overwrite the same slot. Empty slots fill first. A prompt longer than the
budget is compressed to ``budget - 1`` with SnapKV (window 32, avg_pool1d kernel 5), as the authors do, keeping
the sinks and the protected window the decode steps protect (none and the newest token by default).

    CompressionConfig(policy="longflow", budget=3200, granularity="head")
"""
from __future__ import annotations

from dataclasses import dataclass

from kvroll.policies.base import check_budget, check_int, check_range
from kvroll.policies.snapkv import snapkv_prompt_keep


@dataclass(frozen=True)
class LongFlowParams:
    """LongFlow hyperparameters. The paper protects no sinks; ``window=1`` protects the current token (i < t)."""

    granularity: str = "head"
    sink_tokens: int = 0
    window: int = 1
    prompt_window: int = 32
    prompt_pool_kernel: int = 5

    def __post_init__(self):
        name = "LongFlowParams"
        check_range(name, "granularity", self.granularity, self.granularity in ("head", "layer"), "'head' or 'layer'")
        check_int(name, "sink_tokens", self.sink_tokens, 0)
        check_int(name, "window", self.window, 1)
        check_int(name, "prompt_window", self.prompt_window, 1)
        check_int(name, "prompt_pool_kernel", self.prompt_pool_kernel, 1)
        check_range(name, "prompt_pool_kernel", self.prompt_pool_kernel, self.prompt_pool_kernel % 2 == 1, "odd")


class LongFlowPolicy:
    """Every-step eviction of the token with the smallest ||alpha v||_1 (see the module docstring)."""

    name, periodic, stat = "longflow", False, "contrib"

    def __init__(self, params: LongFlowParams):
        self.params = params
        self.granularity = params.granularity

    def validate_budget(self, budget):
        p = self.params
        check_budget(self.name, budget, p.sink_tokens + p.window + 1,
                     f"sink_tokens={p.sink_tokens} + window={p.window} + one evictable slot")

    def protected(self):
        return self.params.sink_tokens, self.params.window

    def capacity(self, budget, max_len):
        return budget

    def prompt_keep(self, budget):
        return budget - 1

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        p = self.params
        return snapkv_prompt_keep(q, k, keep, scale, p.prompt_window, p.prompt_pool_kernel,
                                  shared=self.granularity == "layer", sinks=p.sink_tokens, recent=p.window)

    def step_scores(self, cache, layer, stat):
        return stat  # [slots, kv_heads, capacity] contribution, already summed over each group
