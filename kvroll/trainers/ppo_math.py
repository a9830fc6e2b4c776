"""PPO's arithmetic on [batch, tokens] tensors, free of models and trainers so it can be checked by hand.

    rewards = token_rewards(scores, kl, mask, kl_coef)            # KL penalty per token, the score on the last one
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    advantages = masked_whiten(advantages, mask)
    weights = importance_weights(trainer_logps, rollout_logps, mask, "token_truncate", None, 3.0)
    loss, clipfrac, approxkl = policy_loss(logps, old_logps, advantages, mask, clip_range=0.2, weights=weights)
    value, value_clipfrac = value_loss(values_new, values, returns, mask, clip_range=0.2)

``mask`` is 1 on completion tokens (the EOS included) and 0 on the right padding. Token t's value is the value of
the state it is sampled from; the state after the last completion token is terminal (value 0), so a completion cut
at ``max_completion_length`` is treated as finished, as TRL's old PPO and OpenRLHF do.
"""
from __future__ import annotations

import math

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
KL_ESTIMATORS = ("k1", "k3")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when there are none)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the masked positions, the variance with Bessel's correction n / (n - 1) as TRL's
    ``masked_whiten`` (and verl's, OpenRLHF's) takes it; over a single position, where the correction is undefined
    (TRL divides by zero there), the variance is 0. ``shift_mean=False`` adds the mean back.

    Positions outside the mask come back as 0.
    """
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_mean((x - mean) ** 2, mask) * torch.where(n > 1, n / (n - 1).clamp(min=1), torch.ones_like(n))
    whitened = (x - mean) * torch.rsqrt(var + eps)
    return (whitened if shift_mean else whitened + mean) * mask


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens: k1 = log(p/q), k3 = q/p - 1 - log(q/p)."""
    log_ratio = ref_logps - logps  # log(q / p)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.expm1(log_ratio) - log_ratio
    raise ValueError(f"kl_estimator={estimator!r} is invalid; choose one of {list(KL_ESTIMATORS)}.")


def token_rewards(scores: torch.Tensor, kl: torch.Tensor | None, mask: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """Per-token rewards [B, T]: -kl_coef * kl on every completion token, plus each score [B] on the last token."""
    rewards = torch.zeros_like(mask, dtype=torch.float32) if kl is None else -kl_coef * kl * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)  # right padding: the last completion token
    rewards[torch.arange(len(scores), device=scores.device), last] += scores.to(rewards.dtype)
    return rewards * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over right-padded rows; returns (advantages, returns), 0 on padding.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0); A_t = delta_t + gamma * lam * A_{t+1}.
    """
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(running)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
        next_value = values[:, t]
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


def policy_loss(logps, old_logps, advantages, mask, clip_range: float,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, a masked token mean; returns (loss, clip fraction, approximate KL to the old policy).

    ``weights`` ([B, T] or [B, 1], constant) scales each token's loss: the rollout/trainer importance weights.
    """
    log_ratio = logps - old_logps
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    per_token = torch.maximum(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights.detach()
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    approxkl = 0.5 * masked_mean(log_ratio.detach() ** 2, mask)
    return masked_mean(per_token, mask), clipfrac.detach(), approxkl


def value_loss(values, old_values, returns, mask, clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped within clip_range of the rollout's V;
    returns (loss, clip fraction)."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    return loss, masked_mean((loss_clipped > loss_unclipped).float(), mask).detach()


def importance_weights(trainer_logps, rollout_logps, mask, mode: str, clip_min: float | None,
                       clip_max: float | None) -> torch.Tensor:
    """Rollout/trainer importance weights exp(logp_trainer - logp_rollout), as TRL GRPO's
    ``vllm_importance_sampling_*`` fields compute them.

    ``token_*`` modes: one ratio per token [B, T]; ``sequence_*``: the product over the completion [B, 1].
    ``*_truncate`` clamps to [clip_min, clip_max]; ``*_mask`` sets ratios outside it to 0. A NaN rollout logprob
    (unknown) counts as no difference.
    """
    if mode not in IS_MODES:
        raise ValueError(f"importance sampling mode {mode!r} is invalid; choose one of {list(IS_MODES)}.")
    diff = torch.nan_to_num((trainer_logps - rollout_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def importance_stats(trainer_logps, rollout_logps, weights, mask) -> dict[str, torch.Tensor]:
    """This rank's mismatch statistics: |logp_trainer - logp_rollout| (mean, max) over completion tokens, the weights'
    min/mean/max (per token or per sequence) and the share of completion tokens whose weight is 0 (masked)."""
    valid = mask.bool()
    delta = (trainer_logps - rollout_logps).abs()[valid]
    delta = delta[~torch.isnan(delta)]
    flat = weights.flatten() if weights.shape[-1] == 1 else weights[valid]
    zero = torch.zeros((), device=mask.device)
    masked = (weights == 0).expand_as(mask)[valid].float()
    return {
        "sampling/sampling_logp_difference/mean": delta.mean() if delta.numel() else zero,
        "sampling/sampling_logp_difference/max": delta.max() if delta.numel() else zero,
        "sampling/importance_sampling_ratio/min": flat.min() if flat.numel() else zero,
        "sampling/importance_sampling_ratio/mean": flat.mean() if flat.numel() else zero,
        "sampling/importance_sampling_ratio/max": flat.max() if flat.numel() else zero,
        "kvroll/is_masked_fraction": masked.mean() if masked.numel() else zero,
    }
