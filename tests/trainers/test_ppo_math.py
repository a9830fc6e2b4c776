"""PPO's arithmetic against hand-computed examples: GAE, per-token rewards, whitening, KL estimators, the clipped
policy and value losses and the rollout/trainer importance weights in GRPO's four modes."""
from __future__ import annotations

import math

import pytest
import torch

from kvroll.trainers.ppo_math import gae, importance_stats, importance_weights, kl_estimate, masked_whiten, \
    policy_loss, token_rewards, value_loss

T = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, T(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_gae_by_hand():
    # Row 0: three tokens then padding (whose reward 5 and value 9 must be ignored); row 1: four tokens.
    rewards = T([[0.0, 0.0, 1.0, 5.0], [0.1, 0.0, 0.0, 2.0]])
    values = T([[0.5, 0.2, 0.4, 9.0], [1.0, 1.0, 1.0, 1.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # Row 0: d2 = 1 - 0.4 = 0.6; d1 = 0.9*0.4 - 0.2 = 0.16, A1 = 0.16 + 0.72*0.6 = 0.592;
    #        d0 = 0.9*0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72*0.592 = 0.10624.
    # Row 1: d3 = 2 - 1 = 1; d2 = d1 = 0.9 - 1 = -0.1, A2 = 0.62, A1 = 0.3464; d0 = 0.1 + 0.9 - 1 = 0, A0 = 0.249408.
    close(advantages, [[0.10624, 0.592, 0.6, 0.0], [0.249408, 0.3464, 0.62, 1.0]])
    close(returns, [[0.60624, 0.792, 1.0, 0.0], [1.249408, 1.3464, 1.62, 2.0]])


def test_gae_limits():
    rewards = T([[0.5, -1.0, 2.0]])
    values = T([[0.3, 0.7, -0.2]])
    mask = torch.ones(1, 3)
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(returns, [[1.5, 1.0, 2.0]])  # gamma = lam = 1: Monte-Carlo reward-to-go
    close(advantages, [[1.2, 0.3, 2.2]])
    advantages, _ = gae(rewards, values, mask, gamma=0.5, lam=0.0)
    close(advantages, [[0.5 + 0.35 - 0.3, -1.0 - 0.1 - 0.7, 2.2]])  # lam = 0: one-step TD errors


def test_token_rewards_kl_on_every_token_score_on_the_last():
    kl = T([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]])
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rewards = token_rewards(T([2.0, -1.0]), kl, mask, kl_coef=0.5)
    close(rewards, [[-0.05, 1.9, 0.0, 0.0], [-0.05, -0.1, -0.15, -1.2]])
    close(token_rewards(T([2.0, -1.0]), None, mask, kl_coef=0.5), [[0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]])


def test_masked_whiten():
    x, mask = T([[1.0, 2.0, 3.0, 100.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    scale = 1.0  # 1 / the sample std of (1, 2, 3), Bessel-corrected as TRL's masked_var: ((1 + 0 + 1) / 2) ** 0.5
    close(masked_whiten(x, mask), [[-scale, 0.0, scale, 0.0]], atol=1e-5)
    close(masked_whiten(x, mask, shift_mean=False), [[2.0 - scale, 2.0, 2.0 + scale, 0.0]], atol=1e-5)
    y, m = torch.randn(3, 7, dtype=torch.float64), (torch.rand(3, 7) < 0.6).double()
    m[0, 0] = 1.0
    picked = y[m.bool()]
    close(masked_whiten(y, m), ((y - picked.mean()) / (picked.var(unbiased=True) + 1e-8) ** 0.5 * m).tolist(),
          atol=1e-6)
    one = T([[0.0, 1.0, 0.0]])  # a single position: variance 0, no division by zero
    close(masked_whiten(T([[1.0, 4.0, 9.0]]), one), [[0.0, 0.0, 0.0]])


def test_kl_estimators():
    logps, ref = T([-1.0, -3.0]), T([-2.0, -3.0])
    close(kl_estimate(logps, ref, "k1"), [1.0, 0.0])
    close(kl_estimate(logps, ref, "k3"), [math.exp(-1.0), 0.0])  # e^(q-p) - (q-p) - 1 = e^-1 + 1 - 1
    with pytest.raises(ValueError, match="kl_estimator='k2'"):
        kl_estimate(logps, ref, "k2")


def test_clipped_policy_loss_by_hand():
    # ratios 1.5 (A=+1, clipped to 1.2), 0.5 (A=+1, unclipped is the max), 1.1 (A=-2, inside), 0.5 (A=-2, clipped
    # to 0.8), and a padding token that must not count.
    ratio, adv = T([[1.5, 0.5, 1.1, 0.5, 3.0]]), T([[1.0, 1.0, -2.0, -2.0, 5.0]])
    mask = T([[1.0, 1.0, 1.0, 1.0, 0.0]])
    old = torch.zeros(1, 5)
    logps = ratio.log().requires_grad_()
    loss, clipfrac, approxkl = policy_loss(logps, old, adv, mask, clip_range=0.2)
    # per token: max(-1.5, -1.2) = -1.2; max(-0.5, -0.8) = -0.5; 2.2; max(1.0, 1.6) = 1.6 -> mean 2.1 / 4
    close(loss.detach(), 0.525)
    close(clipfrac, 0.5)
    close(approxkl, 0.5 * sum(math.log(r) ** 2 for r in (1.5, 0.5, 1.1, 0.5)) / 4)
    loss.backward()
    # Clipped tokens get no gradient; the others -A * ratio / 4.
    close(logps.grad, [[0.0, -0.5 / 4, 2.2 / 4, 0.0, 0.0]])
    weighted, _, _ = policy_loss(ratio.log(), old, adv, mask, 0.2, weights=T([[1.0, 0.0, 2.0, 1.0, 1.0]]))
    close(weighted, (-1.2 + 0.0 + 4.4 + 1.6) / 4)


def test_clipped_value_loss_by_hand():
    old, returns = T([[1.0, 1.0, 0.0, 7.0]]), T([[2.0, 0.0, 0.5, 7.0]])
    values = T([[1.5, 0.875, -0.5, 0.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = value_loss(values, old, returns, mask, clip_range=0.25)
    # t0: V clipped to 1.25: max(0.25, 0.5625) = 0.5625 (clipped); t1: inside, 0.765625;
    # t2: V clipped to -0.25: max(1.0, 0.5625) = 1.0 (the unclipped loss is larger).
    close(loss, 0.5 * (0.5625 + 0.765625 + 1.0) / 3)
    close(clipfrac, 1 / 3)


def test_importance_weights_modes_by_hand():
    rollout = T([[-1.0, -1.0, -1.0, -1.0]])
    trainer = T([[-0.5, -3.0, -0.9, 4.0]])  # differences 0.5, -2.0, 0.1 and a padding token
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    e = math.exp
    close(importance_weights(trainer, rollout, mask, "token_truncate", None, 1.5), [[1.5, e(-2.0), e(0.1), 1.0]])
    close(importance_weights(trainer, rollout, mask, "token_mask", 0.2, 1.5), [[0.0, 0.0, e(0.1), 1.0]])
    close(importance_weights(trainer, rollout, mask, "sequence_truncate", None, 3.0), [[e(-1.4)]])
    close(importance_weights(trainer, rollout, mask, "sequence_truncate", 0.5, 3.0), [[0.5]])
    close(importance_weights(trainer, rollout, mask, "sequence_mask", 0.5, 3.0), [[0.0]])
    close(importance_weights(trainer, rollout, mask, "sequence_mask", None, 3.0), [[e(-1.4)]])
    unknown = T([[float("nan"), -1.0, -1.0, -1.0]])  # an unknown rollout logprob counts as no difference
    close(importance_weights(trainer, unknown, mask, "token_truncate", None, 3.0), [[1.0, e(-2.0), e(0.1), 1.0]])


def test_importance_stats():
    rollout, trainer = T([[-1.0, -1.0, -1.0, -1.0]]), T([[-0.5, -3.0, -0.9, 4.0]])
    mask = T([[1.0, 1.0, 1.0, 0.0]])
    weights = importance_weights(trainer, rollout, mask, "token_mask", 0.2, 1.5)
    stats = {k: v.item() for k, v in importance_stats(trainer, rollout, weights, mask).items()}
    assert stats["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 2.0 + 0.1) / 3)
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    assert stats["sampling/importance_sampling_ratio/min"] == 0.0
    assert stats["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.1))
    assert stats["kvroll/is_masked_fraction"] == pytest.approx(2 / 3)
    sequence = importance_weights(trainer, rollout, mask, "sequence_mask", 0.5, 3.0)
    assert importance_stats(trainer, rollout, sequence, mask)["kvroll/is_masked_fraction"].item() == 1.0


def test_pad_rollout_left_pads_prompts_and_right_pads_completions_by_hand():
    """The PPO batch layout, written out: prompts right-aligned against the completions (so each completion starts
    at column P), completions left-aligned with their mask and logprobs, padding elsewhere; generation is cut after
    the first EOS (kept)."""
    from kvroll.trainers.ppo_rollout import cut_at_eos, pad_rollout

    assert cut_at_eos([5, 6, 2, 7, 2], {2}) == [5, 6, 2] and cut_at_eos([5, 6], {2}) == [5, 6]
    assert cut_at_eos([3, 5], {2, 3}) == [3]
    batch = pad_rollout([[11, 12, 13], [21]], [[31], [41, 42, 2]], [[-0.5], [-1.0, -2.0, -3.0]], pad=0,
                        device="cpu")
    assert batch["prompt_length"] == 3
    assert batch["input_ids"].tolist() == [[11, 12, 13, 31, 0, 0], [0, 0, 21, 41, 42, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["completion_mask"].tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert batch["rollout_logps"].tolist() == [[-0.5, 0.0, 0.0], [-1.0, -2.0, -3.0]]
    assert "rollout_logps" not in pad_rollout([[1]], [[2]], None, pad=0, device="cpu")


def test_positions_skip_left_padding():
    # RoPE models are blind to a constant shift, so only a model with absolute positions (or this) sees it.
    from kvroll.trainers.ppo_models import positions

    mask = T([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]])
    assert positions(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 1]]


def test_importance_stats_count_only_zero_weights_as_masked():
    rollout, trainer = T([[-1.0, -1.0, -1.0]]), T([[-9.0, -1.0, -1.2]])  # ratios e^-8 (small, kept), 1, e^-0.2
    mask = torch.ones(1, 3)
    weights = importance_weights(trainer, rollout, mask, "token_truncate", None, 3.0)
    stats = importance_stats(trainer, rollout, weights, mask)
    assert stats["kvroll/is_masked_fraction"].item() == 0.0
    assert stats["sampling/importance_sampling_ratio/min"].item() == pytest.approx(math.exp(-8.0))


def test_reward_scores_none_is_nan_and_weights_apply_per_function():
    # As TRL GRPO: None (the function does not apply to the row) is NaN, so the per-function mean leaves it out and the
    # weighted score (a nansum) counts only the functions that scored the row.
    from kvroll.trainers.ppo_rollout import reward_scores

    def half(completions, **kwargs):
        return [1.0, None, 3.0]

    def column(completions, answer, **kwargs):
        return [float(a) for a in answer]

    inputs = [{"prompt": "p", "answer": a} for a in (10, 20, 30)]
    out = reward_scores([half, column], [None, None], inputs, ["p"] * 3, ["c"] * 3, [[1], [2], [3]], "cpu")
    assert torch.isnan(out[1, 0]) and out[[0, 2], 0].tolist() == [1.0, 3.0] and out[:, 1].tolist() == [10.0, 20.0, 30.0]
    assert torch.nanmean(out[:, 0]).item() == 2.0
    assert (out * T([0.5, 2.0])).nansum(dim=1).tolist() == [20.5, 40.0, 61.5]


def test_a_reward_model_scores_each_row_as_it_would_alone():
    # Right padding: a reward model with absolute positions (GPT-2) sees each text at positions 0.., as it would alone
    # (RoPE models are blind to left padding's shift; this one is not).
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from kvroll.trainers.ppo_rollout import _model_scores

    from .tiny_model import tokenizer

    tok = tokenizer()
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2,
                                                     num_labels=1, pad_token_id=tok.pad_token_id)).eval()
    prompts, completions = ["What is 2 + 3?", "Hi"], [" It is 5, because two plus three is five.", " Hello"]
    batch = _model_scores(model, tok, prompts, completions, "cpu")
    alone = torch.cat([_model_scores(model, tok, [p], [c], "cpu") for p, c in zip(prompts, completions)])
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=0)
