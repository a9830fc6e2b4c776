"""The name transformers gives a model's KV cache keyword: ``past_key_values`` up to 5.23, ``cache`` from 5.24 (the
old name deprecated until 5.40, with a warning on every call). kvroll's model calls and its fused forwards use
whichever the installed version takes, and the fused forwards accept both from their callers.

    model(input_ids=..., **{CACHE_KW: cache})
    cache, kwargs = pop_cache(kwargs)          # in a forward that takes **kwargs
"""
from __future__ import annotations

import inspect


def _cache_kw() -> str:
    from transformers.models.llama.modeling_llama import LlamaAttention

    return "cache" if "cache" in inspect.signature(LlamaAttention.forward).parameters else "past_key_values"


CACHE_KW = _cache_kw()


def pop_cache(kwargs: dict):
    """(the cache given under either name or None, kwargs without both)."""
    cache = kwargs.pop("cache", None)
    old = kwargs.pop("past_key_values", None)
    return (cache if cache is not None else old), kwargs
