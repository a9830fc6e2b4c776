"""Sparse-RL-style correction of compressed rollouts (``kvroll_correction="sparse_rl"``): reject the rollouts whose
compressed-rollout and trainer likelihoods disagree anomalously, then reweight the rest per token.

    stat = sequence_mismatch(trainer_logps, rollout_logps, mask, "mean_abs_log_ratio")   # [B] nats per token
    keep = (stat <= 0.3).float()[:, None]                                                 # [B, 1], 0 = rejected
    weights = keep * token_truncated_ratio      # GRPO/PPO: TRL's token_truncate IS ratio of the kept rows

Sparse-RL (arXiv 2601.10079) trains on rollouts generated with a compressed KV cache (R-KV, SnapKV) and corrects the
mismatch between the sparse sampler and the dense learner in two stages: sequence-level rejection of anomalous
rollouts, then token-level importance reweighting of the accepted ones. kvroll's version:

* Statistic, per rollout, over its completion tokens (a NaN rollout logprob, i.e. unknown, is left out), with
  d_t = log pi_trainer(y_t) - log mu_rollout(y_t):
  ``mean_abs_log_ratio`` = mean_t |d_t| (how far the two disagree, whatever the sign) or ``abs_mean_log_ratio`` =
  |mean_t d_t| (the length-normalised sequence log importance ratio, where disagreements of both signs cancel).
* Rejection: a rollout whose statistic exceeds ``kvroll_rejection_threshold`` gets weight 0 in the policy loss, the
  same way TRL's ``*_mask`` importance-sampling modes drop a row.
* Reweighting: GRPO and PPO multiply the kept rows by TRL's truncated per-token ratio (``token_truncate``, clipped
  to [``vllm_importance_sampling_clip_min``, ``..._clip_max``]). TRL 1.16's RLOO has a sequence-level loss and no
  importance sampling at all, so there the rejection is all (a rejected row's advantage becomes 0).
"""
from __future__ import annotations

import torch

CORRECTIONS = ("none", "sparse_rl")
REJECTION_STATISTICS = ("mean_abs_log_ratio", "abs_mean_log_ratio")


def sequence_mismatch(trainer_logps: torch.Tensor, rollout_logps: torch.Tensor, mask: torch.Tensor,
                      statistic: str) -> torch.Tensor:
    """Per-rollout disagreement [B] of two [B, T] logprob tensors over ``mask``'s tokens (module doc); 0 for a
    rollout without a known token. In float64, so a statistic just above the threshold is not rounded onto it."""
    if statistic not in REJECTION_STATISTICS:
        raise ValueError(f"rejection statistic {statistic!r} is invalid; choose one of {list(REJECTION_STATISTICS)}.")
    diff = trainer_logps.double() - rollout_logps.double()  # fp64: the threshold is compared unrounded
    valid = mask.bool() & ~torch.isnan(diff)
    diff = torch.where(valid, diff, torch.zeros_like(diff))
    count = valid.sum(dim=-1).clamp(min=1)
    if statistic == "mean_abs_log_ratio":
        return diff.abs().sum(dim=-1) / count
    return (diff.sum(dim=-1) / count).abs()


def rejection(trainer_logps, rollout_logps, mask, statistic: str, threshold: float):
    """(keep [B, 1] float, 1.0 kept and 0.0 rejected; the statistic [B]) for one batch of rollouts."""
    stat = sequence_mismatch(trainer_logps, rollout_logps, mask, statistic)
    return (stat <= threshold).float()[:, None], stat


def args_rejection(trainer_logps, rollout_logps, mask, args):
    """``rejection`` with the statistic and threshold of a kvroll config."""
    return rejection(trainer_logps, rollout_logps, mask, args.kvroll_rejection_statistic,
                     args.kvroll_rejection_threshold)


def record_rejection(metrics: dict, accelerator, keep: torch.Tensor, stat: torch.Tensor) -> None:
    """Append ``kvroll/rejected_fraction`` (share of every rank's rollouts rejected) and the statistic's mean and max
    over them to ``metrics`` (one mode's dict of lists, as TRL's trainers keep them). Every rank must call it."""
    both = accelerator.gather(torch.stack([keep.flatten().float(), stat.float()], dim=1))  # [all rows, 2]
    metrics["kvroll/rejected_fraction"].append(1.0 - both[:, 0].mean().item())
    metrics["kvroll/rejection_statistic/mean"].append(both[:, 1].mean().item())
    metrics["kvroll/rejection_statistic/max"].append(both[:, 1].max().item())
