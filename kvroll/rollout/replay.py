"""Teacher-forced replay: feed given tokens through the engine's compressed cache and expose per-step logits.

The fidelity evaluation needs two things ``RolloutEngine.generate`` does not offer: feeding the reference tokens
instead of sampled ones, and the logits of every step. This module drives the engine's own internals
(``_prefill``, ``cache.place``, ``cache.compress_slots``, ``_forward_decode``), so the replayed computation is
exactly the one a rollout performs: same prompt compression, same periodic compression points, same attention.

    engine = RolloutEngine(model, compression=CompressionConfig("rkv", budget=128), max_batch=4)
    for step, logits in replay(engine, prompts, targets):      # targets: [B, T] token ids
        ...                                                     # logits: [B, vocab] fp32 predicting targets[:, step]

With ``targets=None`` the replay is greedy (each step feeds its own argmax): ``greedy_reference`` uses that.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from kvroll.rollout.engine import RolloutEngine
from kvroll.rollout.model import check_generation_length
from kvroll.rollout.requests import validate_request
from kvroll.rollout.sampling import SamplingParams


def replay(engine: RolloutEngine, prompts: list[list[int]], targets: torch.Tensor | None = None,
           num_steps: int | None = None, seed: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (step, logits [B, vocab]) for steps 0..T-1; step t's logits predict token t of the continuation.

    Prompt i occupies slot i. ``targets`` [B, T] are fed after each step (teacher forcing); without them the
    argmax is fed (greedy) for ``num_steps`` steps. The call checks its input as ``generate`` does with
    max_new_tokens = T (the prompts, the model's positions and sliding window), and ``targets`` (an integer tensor,
    one row per prompt, ids in the vocabulary), before returning the iterator; a closed engine is refused.
    """
    if engine.closed:
        raise RuntimeError("replay: this engine was closed (close() freed its cache); make a new RolloutEngine.")
    batch = len(prompts)
    if targets is not None:
        _check_targets(targets, batch, engine.vocab_size)
    steps = targets.shape[1] if targets is not None else num_steps
    if batch > engine.max_batch:
        raise ValueError(f"replay: {batch} prompts but the engine has max_batch={engine.max_batch}; replay at most "
                         f"{engine.max_batch} prompts per call, or build the engine with max_batch >= {batch}.")
    if not steps or steps < 1:
        raise ValueError("replay: pass targets [B, T] or num_steps >= 1.")
    # T steps feed prompt + T - 1 tokens, as generate with max_new_tokens=T does: the same limits apply
    prompts = validate_request(prompts, SamplingParams(max_new_tokens=steps), 1, engine.vocab_size,
                               engine.max_positions)
    check_generation_length(engine.model.config, engine.policy.name, max(len(p) for p in prompts), steps)
    return _steps(engine, prompts, targets, steps, seed)


def _check_targets(targets, batch: int, vocab_size: int) -> None:
    """``targets`` must be an integer tensor [B, T], one row per prompt, of ids in the vocabulary."""
    if not isinstance(targets, torch.Tensor) or targets.ndim != 2 or targets.shape[0] != batch \
            or targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        dtype = f" {targets.dtype}" if isinstance(targets, torch.Tensor) else ""
        raise ValueError(f"replay: targets={shape}{dtype} is invalid: pass an integer tensor [B, T] with one row per "
                         f"prompt (B = {batch}), e.g. greedy_reference's tokens.")
    if targets.numel() and not bool(((targets >= 0) & (targets < vocab_size)).all()):
        bad = targets[(targets < 0) | (targets >= vocab_size)][0]
        raise ValueError(f"replay: targets holds token id {int(bad)}, outside the model's vocabulary "
                         f"[0, {vocab_size}); pass ids of the engine's tokenizer.")


def _steps(engine: RolloutEngine, prompts: list[list[int]], targets: torch.Tensor | None, steps: int,
           seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    batch = len(prompts)
    _prepare(engine, max(len(p) for p in prompts) + steps, seed)
    cache = engine.cache
    logits = torch.empty(engine.max_batch, engine.vocab_size, device=engine.device)
    for slot, ids in enumerate(prompts):
        prompt, first = engine._prefill(ids)
        cache.place(slot, prompt)
        logits[slot] = first
    tokens = torch.zeros(engine.max_batch, dtype=torch.int64, device=engine.device)
    for step in range(steps):
        yield step, logits[:batch]
        if step == steps - 1:
            return
        tokens[:batch] = targets[:, step] if targets is not None else logits[:batch].argmax(dim=-1)
        if engine.policy.periodic:
            due = cache.due_for_compression()
            due[batch:] = False
            if bool(due.any()):
                cache.compress_slots(due.nonzero()[:, 0])
        logits = engine._forward_decode(tokens)


@torch.no_grad()
def greedy_reference(engine: RolloutEngine, prompts: list[list[int]], num_steps: int,
                     store_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuation and its log-probabilities: (tokens [B, T] int64, logprobs [B, T, vocab] store_dtype).

    The log-probabilities are kept in ``store_dtype`` (fp16 by default: 4 prompts x 1024 steps x 49k vocab is
    about 400 MB) and are the reference distribution of ``kl_and_agreement``.
    """
    replayed = replay(engine, prompts, num_steps=num_steps)  # checks the input before the buffers are allocated
    batch = len(prompts)
    tokens = torch.zeros(batch, num_steps, dtype=torch.int64)
    logprobs = torch.empty(batch, num_steps, engine.vocab_size, dtype=store_dtype)
    for step, logits in replayed:
        tokens[:, step] = logits.argmax(dim=-1).cpu()
        logprobs[:, step] = logits.log_softmax(dim=-1).to(store_dtype).cpu()
    return tokens, logprobs


@torch.no_grad()
def kl_and_agreement(engine: RolloutEngine, prompts: list[list[int]], ref_tokens: torch.Tensor,
                     ref_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-force ``ref_tokens`` through ``engine``: (KL(ref || engine) [B, T] fp32, argmax == ref [B, T] bool).

    KL is computed in fp32 from the stored reference log-probabilities and this run's fp32 logits; a token the
    reference gives probability 0 (log-probability -inf) adds 0, as p log p / q does at p = 0.
    """
    batch, steps = ref_tokens.shape
    device = engine.device
    targets = ref_tokens.to(device)
    replayed = replay(engine, prompts, targets)  # checks the input before the buffers are allocated
    if tuple(ref_logprobs.shape) != (batch, steps, engine.vocab_size):  # a [1, T, V] or [B, T, 1] would broadcast
        raise ValueError(f"kl_and_agreement: ref_logprobs has shape {list(ref_logprobs.shape)}, not [B, T, vocab] = "
                         f"{[batch, steps, engine.vocab_size]} (ref_tokens' [B, T], the engine's vocab_size); pass "
                         "greedy_reference's log-probabilities of these prompts under this model.")
    kl = torch.empty(batch, steps, device=device)
    agree = torch.empty(batch, steps, dtype=torch.bool, device=device)
    for step, logits in replayed:
        logq = logits.float().log_softmax(dim=-1)
        logp = ref_logprobs[:, step].to(device, non_blocking=True).float()
        p = logp.exp()
        kl[:, step] = torch.where(p > 0, p * (logp - logq), 0.0).sum(dim=-1).clamp_min(0)
        agree[:, step] = logits.argmax(dim=-1) == targets[:, step]
    kl, agree = kl.cpu(), agree.cpu()
    return kl, agree


def _prepare(engine: RolloutEngine, max_len: int, seed: int) -> None:
    """Size the cache (``full`` holds prompt + continuation) and seed the cache's generator, as generate does."""
    if engine.policy.name == "full" and (engine.cache is None or engine.cache.capacity < max_len):
        engine._allocate(max_len)
    generator = torch.Generator(device=engine.device)
    generator.manual_seed(seed)
    engine.cache.generator = generator
