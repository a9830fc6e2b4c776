"""SnapKV observation-window scoring, used to compress prompts longer than a policy's budget.

Li et al., 2024: the last ``window`` prompt queries attend to the prefix; the per-key attention, summed over
the window queries and the query heads of each KV group, is smoothed with ``avg_pool1d`` and the top tokens
are kept together with the window itself.

    keep_idx = snapkv_prompt_keep(q, k, keep=255, scale=0.125)   # [kv_heads, 255], ascending
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    shared: bool = False,
) -> torch.Tensor:
    """Indices of the ``keep`` prompt tokens SnapKV retains, per KV head, sorted ascending.

    q: [Hq, P, D]; k: [Hkv, P, D]; ``shared=True`` sums the scores over KV heads so every head keeps the same
    tokens (layer-granularity policies). Returns [Hkv, keep] int64.
    """
    num_kv_heads, length, _ = k.shape
    assert 0 < keep < length, (keep, length)
    window = min(window, keep, length - 1)
    scores = snapkv_prefix_scores(q[:, length - window :], k, scale, pool_kernel)  # [Hkv, P - W]
    if shared:
        scores = scores.sum(dim=0, keepdim=True).expand(num_kv_heads, -1)
    top = scores.topk(keep - window, dim=-1).indices  # [Hkv, keep - W]
    recent = torch.arange(length - window, length, device=k.device).expand(num_kv_heads, -1)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values
