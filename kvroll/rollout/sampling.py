"""Sampling parameters and a host-sync-free sampler that also returns the rollout logprobs.

``logprobs[i]`` is, with ``logprobs_mode="raw"`` (the default), log_softmax(raw_logits / T)[token] (T = 1 for
greedy): the quantity TRL's trainer recomputes, so the trainer can measure the rollout/trainer mismatch; the
processors (repetition penalty, top-k, top-p, min-p) shape only the sampling distribution. With
``logprobs_mode="processed"`` it is the log-probability of the token under the distribution it was drawn from: the
processors applied (penalty, / T, top-k, top-p, min-p; for greedy the penalised logits at T = 1), as vLLM's
``logprobs_mode="processed_logprobs"``, which TRL asks vLLM for, so that its importance-sampling correction weighs
each token by the policy's probability over the behaviour's. Without a processor the two modes are equal.

    params = SamplingParams(max_new_tokens=512, temperature=0.7, top_p=0.95, seed=0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvroll.checks import as_int

# The smallest positive temperature: below it logits / T overflows fp32 (1e-40 gave token 0 and NaN logprobs).
# vLLM samples greedily under 1e-5; kvroll refuses instead, since the logprobs are log_softmax(logits / T).
MIN_TEMPERATURE = 1e-5
LOGPROBS_MODES = ("raw", "processed")
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes (a negative seed wraps modulo 2**64)


def finite_number(value) -> bool:
    """An int or float, Python's or numpy's (not a bool), that is finite."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)) \
        and math.isfinite(value)


def _int(value, low: int) -> bool:
    return as_int(value) is not None and value >= low


token_id = as_int  # a token id is an integer as every integer argument is


def _bad(field: str, value, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{field}={value!r} is invalid: {field} must be {allowed}.")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. ``temperature=0`` is greedy; ``stop_token_ids=None`` means the model's EOS ids, and
    given ids replace them (add the EOS ids to keep stopping there); ``ignore_eos`` drops the EOS ids, not given
    ones. A ``seed`` makes a call reproducible for the same prompts, ``n`` and engine ``max_batch`` and
    ``sync_every``: the draws follow the slots' order, and a freed slot is refilled at a window's end, so another
    batch size, ``n`` or ``sync_every`` (16 on CUDA, 1 on CPU by default) draws other tokens once a sequence stops
    before ``max_new_tokens``."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs_mode: str = "raw"  # "raw" | "processed" (module docstring)

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "seed"):  # numpy integers are taken, as Python ints
            if as_int(getattr(self, name)) is not None:
                object.__setattr__(self, name, as_int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):  # numpy numbers, as Python floats
            if isinstance(getattr(self, name), (np.floating, np.integer)):
                object.__setattr__(self, name, float(getattr(self, name)))
        if isinstance(self.ignore_eos, np.bool_):
            object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if not _int(self.max_new_tokens, 1):
            raise _bad("max_new_tokens", self.max_new_tokens,
                       "an integer >= 1" + (", not a bool" if isinstance(self.max_new_tokens, bool) else ""))
        if not (finite_number(self.temperature) and self.temperature >= 0):
            raise _bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise _bad("temperature", self.temperature, f"0 (greedy) or >= {MIN_TEMPERATURE}: the logprobs are "
                       "log_softmax(logits / T), which overflows fp32 at a smaller T; use 0 for greedy")
        if not (finite_number(self.top_p) and 0 < self.top_p <= 1):
            raise _bad("top_p", self.top_p, "in (0, 1] (1 disables top-p)")
        if not _int(self.top_k, 0):
            raise _bad("top_k", self.top_k,
                       "an integer >= 0 (0 disables top-k)" + (", not a bool" if isinstance(self.top_k, bool) else ""))
        if not (finite_number(self.min_p) and 0 <= self.min_p <= 1):
            raise _bad("min_p", self.min_p, "in [0, 1] (0 disables min-p)")
        if not (finite_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise _bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 disables it)")
        if self.stop_token_ids is not None:
            given = self.stop_token_ids
            iterable = hasattr(given, "__iter__") and not isinstance(given, (str, bytes, dict, torch.Tensor))
            ids = [token_id(t) for t in given] if iterable else [None]  # not a bare int: a list, tuple, set, range
            if not all(t is not None and t >= 0 for t in ids):
                raise _bad("stop_token_ids", self.stop_token_ids, "a list, tuple or set of non-negative int token "
                           "ids (e.g. [2] for one), or None for the model's EOS")
            object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise _bad("logprobs_mode", self.logprobs_mode, f"one of {list(LOGPROBS_MODES)}")
        if self.seed is not None and not (_int(self.seed, SEED_RANGE[0]) and self.seed < SEED_RANGE[1]):
            raise _bad("seed", self.seed, "an integer in [-2**63, 2**64) (what torch.manual_seed takes), or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF semantics: a seen token's positive logit is divided by the penalty, a negative one multiplied."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """top-k, then top-p, then min-p, as masks of -inf over [batch, vocab] fp32 logits (already / T)."""
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1.0 - params.top_p)
        drop_sorted[:, -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        limit = probs.max(dim=-1, keepdim=True).values * params.min_p
        logits = logits.masked_fill(probs < limit, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           seen: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of fp32 ``logits`` [batch, vocab]; returns (tokens [batch], logprobs [batch]), the
    logprobs as ``params.logprobs_mode`` says (module docstring).

    No host synchronisation: the draw is argmax(probs / Exponential(1)) (the Gumbel-max trick), which a CUDA
    graph can capture.
    """
    logits = logits.float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    shaped = logits
    if params.repetition_penalty != 1.0 and seen is not None:
        shaped = apply_repetition_penalty(shaped, seen, params.repetition_penalty)
    if params.greedy:
        tokens = shaped.argmax(dim=-1)
        drawn_from = shaped  # vLLM's processed logprobs of a greedy row: the penalised logits at T = 1
    else:
        drawn_from = filter_logits(shaped / temperature, params)
        probs = drawn_from.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
        tokens = (probs / noise).argmax(dim=-1)
    source = drawn_from if params.logprobs_mode == "processed" else logits / temperature
    logprobs = source.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs
