"""The fidelity numbers against fp64 by hand: KL(ref || policy) with -inf log-probabilities, the shape contract of
the reference, the EOS cut, and the summary (mean, p99, top-1, greedy prefix) over each row's scored steps."""
import math

import numpy as np
import pytest
import torch

import kvroll.rollout.replay as replay_module
from kvroll.bench.fidelity import fidelity_metrics, policy_kwargs, reference_lengths


class _Engine:
    device = torch.device("cpu")

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size


def _kl(monkeypatch, ref_logits, policy_logits):
    """kl_and_agreement with the replay's per-step logits given (no model); and the fp64 hand value."""
    monkeypatch.setattr(replay_module, "replay", lambda engine, prompts, targets: (
        (step, policy_logits[:, step]) for step in range(targets.shape[1])))
    ref_logp = ref_logits.double().log_softmax(-1)
    tokens = ref_logits.argmax(-1)
    kl, agree = replay_module.kl_and_agreement(_Engine(ref_logits.shape[-1]), [[1]] * len(tokens), tokens,
                                               ref_logp.float())
    p, logq = ref_logp.exp(), policy_logits.double().log_softmax(-1)
    hand = torch.where(p > 0, p * (ref_logp - logq), torch.zeros((), dtype=torch.float64)).sum(-1)
    return kl, agree, hand


def test_kl_matches_fp64_with_tokens_the_reference_rules_out(monkeypatch):
    """A token of log-probability -inf under the reference adds 0 (p log p/q at p = 0), whatever the policy says
    of it; it was NaN (0 x -inf), and the NaN made the report's KL mean and p99 NaN."""
    gen = torch.Generator().manual_seed(0)
    ref, pol = torch.randn(2, 3, 5, generator=gen), torch.randn(2, 3, 5, generator=gen)
    ref[0, 0, 4] = pol[0, 0, 4] = -math.inf  # both rule it out
    ref[1, 1, 3] = -math.inf  # only the reference does
    kl, agree, hand = _kl(monkeypatch, ref, pol)
    assert torch.isfinite(kl).all(), kl
    assert kl.double() == pytest.approx(hand, abs=1e-5)
    assert agree.tolist() == (pol.argmax(-1) == ref.argmax(-1)).tolist()
    assert math.isfinite(fidelity_metrics(kl, agree)["kl_mean"])


def test_kl_is_infinite_where_the_policy_rules_out_a_reference_token(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    ref, pol = torch.randn(1, 2, 4, generator=gen), torch.randn(1, 2, 4, generator=gen)
    pol[0, 1, 2] = -math.inf
    kl, _, hand = _kl(monkeypatch, ref, pol)
    assert math.isinf(float(kl[0, 1])) and math.isinf(float(hand[0, 1]))
    assert float(kl[0, 0]) == pytest.approx(float(hand[0, 0]), abs=1e-6)


def test_tied_policy_logits_agree_only_with_the_first_index(monkeypatch):
    """argmax ties resolve to the lowest index, as a greedy decode does: that is the token it would produce."""
    ref = torch.tensor([[[0.0, 3.0, 1.0], [4.0, 0.0, 0.0]]])
    pol = torch.tensor([[[2.0, 2.0, 2.0], [2.0, 2.0, 0.0]]])
    _, agree, _ = _kl(monkeypatch, ref, pol)
    assert agree.tolist() == [[False, True]]


@pytest.mark.parametrize("shape", [(2, 3, 1), (1, 3, 5), (2, 3, 7)])
def test_a_reference_of_another_shape_is_refused_by_name(monkeypatch, shape):
    """[B, T, 1] and [1, T, V] broadcast silently against the policy's [B, V] (KL against the wrong rows)."""
    monkeypatch.setattr(replay_module, "replay", lambda engine, prompts, targets: (
        (step, torch.zeros(2, 5)) for step in range(targets.shape[1])))
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \[.*\], not \[B, T, vocab\] = \[2, 3, 5\]"):
        replay_module.kl_and_agreement(_Engine(5), [[1], [1]], torch.zeros(2, 3, dtype=torch.int64),
                                       torch.zeros(shape))


def test_summary_by_hand_to_each_eos():
    tokens = torch.tensor([[4, 2, 0, 0], [1, 1, 1, 1], [2, 9, 9, 9], [3, 7, 3, 7]])
    lengths = reference_lengths(tokens, {2, 7})  # two EOS ids; EOS counted; none: all steps
    assert lengths.tolist() == [2, 4, 1, 2]
    kl = torch.tensor([[0.1, 0.2, 50., 50.], [0.3, 0.0, 0.0, 0.6], [0.7, 9., 9., 9.], [0.4, 0.5, 9., 9.]])
    agree = torch.tensor([[True, True, False, False], [True, False, True, True], [True, False, False, False],
                          [True, True, False, False]])
    m = fidelity_metrics(kl, agree, lengths)
    scored = np.array([0.1, 0.2, 0.3, 0.0, 0.0, 0.6, 0.7, 0.4, 0.5])
    assert m["kl_mean"] == pytest.approx(scored.mean(), rel=1e-6)
    assert m["kl_p99"] == pytest.approx(np.percentile(scored, 99), rel=1e-6)
    assert m["top1_agreement"] == pytest.approx(8 / 9)
    # a row that agrees on all its scored steps has its whole length as prefix (row 0: 2, not 4)
    assert (m["greedy_prefix_mean"], m["greedy_prefix_min"]) == (pytest.approx((2 + 1 + 1 + 2) / 4), 1)


def test_lagkv_lag_is_the_largest_power_of_two_that_fits():
    """16 + 3 x lag <= budget, lag <= 128 (the LagKV static-budget rule), other policies their defaults."""
    for budget in (19, 22, 40, 64, 111, 112, 207, 208, 399, 400, 4096):
        lag = policy_kwargs("lagkv", budget)["lag"]
        assert lag & (lag - 1) == 0 and lag <= 128
        assert 16 + 3 * lag <= budget and (lag == 128 or 16 + 3 * 2 * lag > budget), (budget, lag)
    assert policy_kwargs("rkv", 64) == {} and policy_kwargs("full", 64) == {}
