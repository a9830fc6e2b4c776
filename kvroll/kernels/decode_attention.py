"""Decode attention over the static compressed cache, with the eviction statistics in the same pass.

This file holds the fp32 PyTorch reference (the CPU path and the oracle the Triton kernel is tested
against). One call handles one layer:

    out, stat, evict = decode_attention_torch(q, k_cache, v_cache, valid, scale, stat="contrib",
                                              evictable=evictable)

q: [slots, Hq, D]; k_cache, v_cache: [slots, Hkv, capacity, D]; valid, evictable: [slots, Hkv, capacity] bool.
out: [slots, Hq, D] in q's dtype; stat: [slots, Hkv, capacity] fp32 or None, where
  "contrib" = sum over the group's query heads of ||alpha_i * v_i||_1 (LongFlow) and
  "mass"    = sum over the group's query heads of alpha_i (H2O accumulation);
evict: argmin of stat over evictable slots, [slots, Hkv] (or [slots, 1] with ``layer_shared``), or None.
"""
from __future__ import annotations

import torch

STATS = (None, "contrib", "mass")


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    stat: str | None = None,
    evictable: torch.Tensor | None = None,
    layer_shared: bool = False,
):
    """fp32 reference of the fused decode kernel (see the module docstring)."""
    assert stat in STATS, stat
    slots, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.float().view(slots, num_kv_heads, group, head_dim)
    logits = torch.einsum("shgd,shcd->shgc", qg, k_cache.float()) * scale  # [S, Hkv, G, C]
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.einsum("shgc,shcd->shgd", probs, v_cache.float()).reshape(slots, num_q_heads, head_dim)
    score = None
    if stat is not None:
        score = probs.sum(dim=2)  # [S, Hkv, C]
        if stat == "contrib":
            score = score * v_cache.float().abs().sum(dim=-1)
    evict = None
    if evictable is not None and score is not None:
        evict = masked_argmin_stat(score, evictable, layer_shared)
    return out.to(q.dtype), score, evict


def masked_argmin_stat(score: torch.Tensor, evictable: torch.Tensor, layer_shared: bool) -> torch.Tensor:
    """argmin of ``score`` over evictable slots; ``layer_shared`` sums over KV heads first -> [S, 1]."""
    if layer_shared:
        score, evictable = score.sum(dim=1, keepdim=True), evictable[:, :1]
    return score.masked_fill(~evictable, float("inf")).argmin(dim=-1)
