"""SnapKV observation-window scoring, used to compress prompts longer than a policy's budget.

Li et al., 2024: the last ``window`` prompt queries attend to the prefix; the per-key attention, summed over
the window queries and the query heads of each KV group, is smoothed with ``avg_pool1d`` and the top tokens
are kept together with the window itself.

    keep_idx = snapkv_prompt_keep(q, k, keep=255, scale=0.125)   # [kv_heads, 255], ascending
    CompressionConfig(policy="snapkv", budget=256)                # the decode-time policy (SnapKVPolicy)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvroll.kernels import snapkv_scores as snapkv_kernel
from kvroll.policies.base import check_int, check_range
from kvroll.policies.window import WindowedPolicy, check_window_budget, compress_top_and_recent, window_logits


def snapkv_prefix_scores(q_obs: torch.Tensor, k: torch.Tensor, scale: float, pool_kernel: int = 5) -> torch.Tensor:
    """Pooled attention of the observation window on the prefix.

    q_obs: [Hq, W, D] the last W prompt queries (post-RoPE); k: [Hkv, P, D]. Returns [Hkv, P - W] fp32.
    """
    num_q_heads, window, _ = q_obs.shape
    num_kv_heads, length, _ = k.shape
    group = num_q_heads // num_kv_heads
    k_rep = k.float().repeat_interleave(group, dim=0)  # [Hq, P, D]
    logits = torch.einsum("hwd,hpd->hwp", q_obs.float(), k_rep) * scale  # [Hq, W, P]
    # the window's queries are causal among themselves: query w sits at position P - W + w
    q_pos = torch.arange(length - window, length, device=k.device)[:, None]
    k_pos = torch.arange(length, device=k.device)[None, :]
    logits = logits.masked_fill(k_pos > q_pos, float("-inf"))
    probs = logits.softmax(dim=-1)[..., : length - window]  # [Hq, W, P - W]
    scores = probs.sum(dim=1).view(num_kv_heads, group, -1).sum(dim=1)  # [Hkv, P - W]
    if pool_kernel > 1:
        scores = F.avg_pool1d(scores[:, None], pool_kernel, stride=1, padding=pool_kernel // 2)[:, 0]
    return scores


def snapkv_prompt_keep(
    q: torch.Tensor, k: torch.Tensor, keep: int, scale: float, window: int = 32, pool_kernel: int = 5,
    shared: bool = False, sinks: int = 0, recent: int = 0,
) -> torch.Tensor:
    """Indices of the ``keep`` prompt tokens SnapKV retains, per KV head, sorted ascending.

    q: [Hq, P, D]; k: [Hkv, P, D]; ``shared=True`` sums the scores over KV heads so every head keeps the same
    tokens (layer-granularity policies). What the policy protects at decode time comes first: the newest
    ``recent`` tokens, then the first ``sinks`` (as many as ``keep`` allows, one slot left for the observation
    window); then SnapKV's observation window (the newest ``window`` tokens, cut to what is left); then the
    best-scored tokens between the sinks and the newest kept ones. Returns [Hkv, keep] int64.
    """
    num_kv_heads, length, _ = k.shape
    assert 0 < keep < length, (keep, length)
    recent = min(recent, keep)
    sinks = min(sinks, keep - max(recent, 1))
    window = min(window, keep - sinks, length - 1)
    newest = max(window, recent)
    scores = snapkv_prefix_scores(q[:, length - window :], k, scale, pool_kernel)  # [Hkv, P - W]
    if shared:
        scores = scores.sum(dim=0, keepdim=True).expand(num_kv_heads, -1)
    top = scores[:, sinks : length - newest].topk(keep - newest - sinks, dim=-1).indices + sinks
    fixed = torch.cat([torch.arange(sinks, device=k.device), torch.arange(length - newest, length, device=k.device)])
    return torch.cat([top, fixed.expand(num_kv_heads, -1)], dim=-1).sort(dim=-1).values


@dataclass(frozen=True)
class SnapKVParams:
    """SnapKV at decode time: observation window of 32 queries, ``avg_pool1d(5)``, compressed when budget +
    buffer (128, as R-KV's decode-time setting) is full."""

    window: int = 32
    pool_kernel: int = 5
    buffer: int = 128

    def __post_init__(self):
        name = "SnapKVParams"
        check_int(name, "window", self.window, 1)
        check_int(name, "buffer", self.buffer, 1)
        check_range(name, "window", self.window, self.window <= self.buffer, f"<= buffer={self.buffer}")
        check_int(name, "pool_kernel", self.pool_kernel, 1)
        check_range(name, "pool_kernel", self.pool_kernel, self.pool_kernel % 2 == 1, "odd")


def snapkv_window_scores(q_obs: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, cur_pos: torch.Tensor,
                         scale: float, pool_kernel: int) -> torch.Tensor:
    """Decode-time SnapKV score of every slot: [n, Hkv, C] fp32 (only candidates are meaningful).

    q_obs [n, Hq, W, D] are the queries at positions cur_pos - W .. cur_pos - 1; each attends causally over the
    live keys (softmax over all of them, as at prefill), the weights on the candidates (older than the window)
    are summed over the window and the group's query heads, then ``avg_pool1d`` smooths them along tokens.
    On CUDA the sum is one Triton kernel (``kvroll/kernels/snapkv_scores.py``: no fp32 logits tensor).
    """
    n, num_kv_heads, capacity = k.shape[:3]
    window = q_obs.shape[2]
    if snapkv_kernel.use_kernel(k) and pos.dtype == torch.int32:  # one kernel, no [n, Hkv, G, W, C] logits
        scores = snapkv_kernel.snapkv_scores_triton(q_obs, k, pos, cur_pos, scale)
    else:
        logits = window_logits(q_obs, k).mul_(scale)  # [n, Hkv, G, W, C]
        q_pos = cur_pos[:, None] - window + torch.arange(window, device=k.device)  # [n, W]
        visible = (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= q_pos[:, None, :, None])  # [n, Hkv, W, C]
        probs = logits.masked_fill(~visible[:, :, None], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        cand = (pos >= 0) & (pos < (cur_pos - window)[:, None, None])
        scores = probs.sum(dim=(2, 3)) * cand  # [n, Hkv, C]
    if pool_kernel > 1:
        pooled = F.avg_pool1d(scores.view(n * num_kv_heads, 1, capacity), pool_kernel, stride=1,
                              padding=pool_kernel // 2)
        scores = pooled.view(n, num_kv_heads, capacity)
    return scores


class SnapKVPolicy(WindowedPolicy):
    """Periodic SnapKV: when budget + buffer is full keep the top budget - window by pooled window attention
    plus the window itself, per KV head. Prompts over budget are compressed by ``snapkv_prompt_keep``."""

    name = "snapkv"

    def validate_budget(self, budget):
        check_window_budget("SnapKVParams", self.name, self.params.window, budget, "the window is kept")

    def compress(self, cache, layer, slots):
        return compress_top_and_recent(cache, layer, slots, self.params.window, lambda q_obs, k, pos, cur_pos:
                                       snapkv_window_scores(q_obs, k, pos, cur_pos, cache.scale,
                                                            self.params.pool_kernel))

    def prompt_keep_idx(self, q, k, keep, scale, generator=None):
        return snapkv_prompt_keep(q, k, keep, scale, self.params.window, self.params.pool_kernel)
