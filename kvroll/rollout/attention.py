"""The ``kvroll`` attention implementation, registered with transformers' ``AttentionInterface``.

Inside the engine (a ``kvroll_cache=`` keyword reaches it through the model's forward) it runs causal SDPA
over a prompt during prefill and hands the prompt's K/V to the cache, or attends over the static compressed
cache during decode. Anywhere else (a trainer's forward over the same module tree) it is exactly HF's SDPA
attention with SDPA's masks, so a model set to ``kvroll`` still trains normally.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTN_IMPLEMENTATION = "kvroll"


def kvroll_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, Hq, q_len, D]; key/value as returned by the cache. Returns ([B, q_len, Hq, D], None)."""
    cache = kwargs.pop("kvroll_cache", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = module.layer_idx
    if cache.mode == "prefill":
        if cache.prompt_pad is not None:  # right-padded rows (engine._prefill_many): no pad value reaches a prompt
            key, value = key.masked_fill(cache.prompt_pad, 0), value.masked_fill(cache.prompt_pad, 0)
        window = kwargs.get("sliding_window")  # Mistral, Qwen2/Qwen3 sliding layers: attend (p - W, p]
        if window is not None and query.shape[2] > window:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=window_causal_mask(
                query.shape[2], window, query.device), scale=scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        cache.store_prompt(layer, query, key, value)
        return out.transpose(1, 2).contiguous(), None
    out = cache.attend(layer, query[:, :, 0])  # [S, Hq, D]
    return out[:, None], None


def window_causal_mask(length: int, window: int, device) -> torch.Tensor:
    """[length, length] bool: query p attends key j iff p - window < j <= p (transformers' sliding window)."""
    p = torch.arange(length, device=device)
    offset = p[:, None] - p[None, :]
    return (offset >= 0) & (offset < window)


def register() -> None:
    """Idempotent: make ``attn_implementation="kvroll"`` resolvable by transformers."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, kvroll_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def dummy_mask(batch: int, device) -> torch.Tensor:
    """A 4D mask that makes transformers skip mask construction (the cache knows what is live)."""
    return torch.ones(batch, 1, 1, 1, dtype=torch.bool, device=device)
