"""What a ``generate(prompt_token_ids, sampling, n)`` request must be, checked before any work (engine and pool).

    prompts = validate_request([[1, 2, 3]], SamplingParams(max_new_tokens=8), n=4, vocab_size=256)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvroll.checks import as_int
from kvroll.rollout.sampling import SamplingParams, token_id


def validate_request(prompt_token_ids, sampling, n, vocab_size: int | None = None,
                     max_positions: int | None = None) -> list[list[int]]:
    """The prompts of a ``generate(prompt_token_ids, sampling, n)`` call as lists of ints, else a ``ValueError``.

        prompts = validate_request([[1, 2, 3]], SamplingParams(max_new_tokens=8), n=4, vocab_size=256)

    ``RolloutEngine`` and ``RolloutPool`` (before any worker runs) pass their model config's ``vocab_size`` and
    ``max_position_embeddings``; left None, token ids need only be ints and prompts may be of any length. A token
    id is a Python or numpy integer (not a bool); the prompts may be lists, 1-D tensors / arrays, or one 2-D
    tensor / array.
    """
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"generate: sampling={sampling!r} must be a kvroll.SamplingParams.")
    if not (as_int(n) is not None and n >= 1):  # a Python or numpy integer, not a bool
        raise ValueError(f"generate: n={n!r} is invalid: n must be an integer >= 1 (samples per prompt).")
    if isinstance(prompt_token_ids, (torch.Tensor, np.ndarray)):
        prompt_token_ids = prompt_token_ids.tolist()
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise ValueError("generate: prompt_token_ids must be a non-empty list of token-id lists.")
    if token_id(prompt_token_ids[0]) is not None:
        raise ValueError(f"generate: prompt_token_ids is a flat list of {len(prompt_token_ids)} ints; it must be "
                         "a list of token-id lists, one per prompt: pass [prompt_ids] for a single prompt.")
    # a stop id past the vocabulary is accepted and never matches: a tokenizer's EOS ids may lie past the model's
    # vocab_size (tests/rollout/test_graphs.py::test_a_stop_id_past_the_vocabulary_never_stops_and_is_accepted)
    return [_prompt_ids(i, ids, vocab_size, max_positions) for i, ids in enumerate(prompt_token_ids)]


def _prompt_ids(i: int, ids, vocab_size: int | None, max_positions: int | None) -> list[int]:
    """Prompt ``i`` of a request as a list of ints, checked against the vocabulary and position limit if given."""
    if isinstance(ids, (torch.Tensor, np.ndarray)) and ids.ndim == 1:
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"generate: prompt_token_ids[{i}]={ids!r} is not a list of token ids; pass one list "
                         "(or 1-D tensor / array) of ints per prompt.")
    if not ids:
        raise ValueError(f"generate: prompt_token_ids[{i}] is empty; every prompt needs at least one token.")
    tokens = [token_id(t) for t in ids]
    if None in tokens:
        raw = ids[tokens.index(None)]
        raise ValueError(f"generate: prompt_token_ids[{i}] holds {raw!r} ({type(raw).__name__}), not an int token "
                         "id; tokenize the prompt and pass its ids (Python or numpy ints).")
    ids = tokens
    bad = [t for t in ids if vocab_size is not None and not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"generate: prompt_token_ids[{i}] holds token id {bad[0]!r} outside the vocabulary "
                         f"[0, {vocab_size}); tokenize with this model's tokenizer.")
    if max_positions is not None and len(ids) > max_positions:
        raise ValueError(f"generate: prompt_token_ids[{i}] has {len(ids)} tokens, more than the model's "
                         f"max_position_embeddings={max_positions}; truncate the prompt.")
    return ids


@dataclass
class Completion:
    """One sample of one prompt."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token, included in token_ids) or "length"
    weight_version: int | None = None  # the synced weight version a Ray worker generated it with
