"""``kvroll_correction="sparse_rl"``: the rejection rule against a hand-computed example, the trainers' hooks on
hand-made batches, 2-step GRPO / RLOO / PPO runs (nothing rejected: the metric is logged; everything rejected: the
policy does not move), and the config errors."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from kvroll.trainers import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from kvroll.trainers.correction import rejection, sequence_mismatch

from .tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer

NAN = float("nan")
# Three rollouts of up to 4 tokens; row 2 has 2 tokens (the rest is padding, whose values must not count).
TRAINER = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-1.0, -1.0, -1.0, -1.0], [-0.2, -3.0, -9.0, -9.0]])
ROLLOUT = torch.tensor([[-1.2, -1.6, -0.5, -1.0], [-1.5, -0.5, -1.5, NAN], [-1.0, -1.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
# d = trainer - rollout on the counted tokens (row 1's NaN rollout logprob is unknown and left out):
#   row 0: -0.2 +0.4  0  0   -> mean |d| = 0.6/4 = 0.15, |mean d| = 0.2/4 = 0.05
#   row 1: +0.5 -0.5 +0.5    -> mean |d| = 1.5/3 = 0.5,  |mean d| = 0.5/3
#   row 2: +0.8 -2.0         -> mean |d| = 2.8/2 = 1.4,  |mean d| = 1.2/2 = 0.6
MEAN_ABS = [0.15, 0.5, 1.4]
ABS_MEAN = [0.05, 0.5 / 3, 0.6]


def test_statistics_by_hand():
    assert sequence_mismatch(TRAINER, ROLLOUT, MASK, "mean_abs_log_ratio").tolist() == pytest.approx(MEAN_ABS)
    assert sequence_mismatch(TRAINER, ROLLOUT, MASK, "abs_mean_log_ratio").tolist() == pytest.approx(ABS_MEAN)
    empty = sequence_mismatch(TRAINER, ROLLOUT, torch.zeros_like(MASK), "mean_abs_log_ratio")
    assert empty.tolist() == [0.0, 0.0, 0.0]  # no known token: nothing to reject on
    with pytest.raises(ValueError, match="'max' is invalid"):
        sequence_mismatch(TRAINER, ROLLOUT, MASK, "max")


@pytest.mark.parametrize("statistic, threshold, kept", [
    ("mean_abs_log_ratio", 0.3, [1.0, 0.0, 0.0]),
    ("mean_abs_log_ratio", 0.5, [1.0, 1.0, 0.0]),  # equal to the threshold: kept
    ("abs_mean_log_ratio", 0.3, [1.0, 1.0, 0.0]),  # row 1's disagreements cancel
    ("abs_mean_log_ratio", 0.01, [0.0, 0.0, 0.0]),
])
def test_rejection_by_hand(statistic, threshold, kept):
    keep, stat = rejection(TRAINER, ROLLOUT, MASK, statistic, threshold)
    assert keep.shape == (3, 1) and keep[:, 0].tolist() == kept
    assert stat.tolist() == pytest.approx(MEAN_ABS if statistic == "mean_abs_log_ratio" else ABS_MEAN)


def test_rejection_at_the_threshold_is_decided_unrounded():
    """A statistic just above the threshold is rejected, as in fp64 by hand: fp32 trainer logps 0 and rollout
    logps -0.3 (fp32: 0.30000001192...), fp64 -1.0 and -1.3 (0.30000000000000004); exactly 0.25 is kept."""
    for trainer, rollout in [(torch.zeros(1, 1), torch.full((1, 1), -0.3)),
                             (torch.full((1, 2), -1.0, dtype=torch.float64),
                              torch.full((1, 2), -1.3, dtype=torch.float64))]:
        for statistic in ("mean_abs_log_ratio", "abs_mean_log_ratio"):
            keep, stat = rejection(trainer, rollout, torch.ones_like(trainer), statistic, 0.3)
            assert stat.item() > 0.3 and keep.tolist() == [[0.0]]
    keep, _ = rejection(torch.zeros(1, 1), torch.full((1, 1), -0.25), torch.ones(1, 1), "mean_abs_log_ratio", 0.25)
    assert keep.tolist() == [[1.0]]


def fake_trainer(**args):
    gather = SimpleNamespace(gather=lambda x: x)
    return SimpleNamespace(args=SimpleNamespace(kvroll_rejection_statistic="mean_abs_log_ratio", **args),
                           model=SimpleNamespace(training=True), accelerator=gather,
                           _metrics={"train": defaultdict(list)})


def test_grpo_hook_zeroes_the_rejected_rows_ratio():
    trainer = fake_trainer(kvroll_rejection_threshold=0.3)
    ratio = torch.tensor([[1.0, 1.2, 0.9, 1.0], [2.0, 0.5, 1.0, 1.0], [1.5, 0.2, 1.0, 1.0]])  # token_truncate
    output = {"completion_mask": MASK, "old_per_token_logps": TRAINER, "sampling_per_token_logps": ROLLOUT,
              "importance_sampling_ratio": ratio.clone()}
    GRPOTrainer._reject_mismatched(trainer, output)
    assert torch.equal(output["importance_sampling_ratio"], ratio * torch.tensor([[1.0], [0.0], [0.0]]))
    metrics = trainer._metrics["train"]
    assert metrics["kvroll/rejected_fraction"] == [pytest.approx(2 / 3)]
    assert metrics["kvroll/rejection_statistic/mean"] == [pytest.approx(sum(MEAN_ABS) / 3)]
    assert metrics["kvroll/rejection_statistic/max"] == [pytest.approx(1.4)]


def test_grpo_hook_leaves_tool_tokens_out_of_the_statistic():
    """Tool-result tokens (tool_mask 0) were not sampled: their rollout/trainer disagreement must not reject a row.
    Row 2 without its tool token: |d| = 0.8 only (1.4 with it), kept at threshold 1.0."""
    trainer = fake_trainer(kvroll_rejection_threshold=1.0)
    ratio = torch.ones(3, 4)
    output = {"completion_mask": MASK, "tool_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]),
              "old_per_token_logps": TRAINER, "sampling_per_token_logps": ROLLOUT,
              "importance_sampling_ratio": ratio.clone()}
    GRPOTrainer._reject_mismatched(trainer, output)
    assert torch.equal(output["importance_sampling_ratio"], ratio)
    assert trainer._metrics["train"]["kvroll/rejection_statistic/max"] == [pytest.approx(0.8)]


def test_grpo_masked_fraction_counts_every_ranks_loss_tokens():
    """kvroll/is_masked_fraction is a share of tokens over all ranks, not a mean of the ranks' shares, and leaves
    out padding and tool results (not in the loss). Rank 0: 2 tokens of a zeroed row (sequence_mask), a row whose
    2 tool tokens are left out; rank 1 (its counts, as gather returns them): 0 zeroed of 16."""
    trainer = fake_trainer()
    trainer.accelerator = SimpleNamespace(gather=lambda x: torch.cat([x, x.new_tensor([[0.0, 16.0]])]))
    output = {"importance_sampling_ratio": torch.tensor([[0.0], [1.0]]),
              "completion_mask": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]),
              "tool_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    GRPOTrainer._log_masked_fraction(trainer, output)
    assert trainer._metrics["train"]["kvroll/is_masked_fraction"] == [pytest.approx(2 / (4 + 16))]


def test_rejection_metrics_cover_every_ranks_rows():
    """kvroll/rejected_fraction and the statistic's mean / max are over the rows of every rank (gathered), not this
    rank's: rank 1's three rows (keep, statistic), as gather returns them after rank 0's, are all kept."""
    trainer = fake_trainer(kvroll_rejection_threshold=0.3)
    other = torch.tensor([[1.0, 0.1], [1.0, 0.2], [1.0, 0.05]])
    trainer.accelerator = SimpleNamespace(gather=lambda x: torch.cat([x, other]))
    output = {"completion_mask": MASK, "old_per_token_logps": TRAINER, "sampling_per_token_logps": ROLLOUT,
              "importance_sampling_ratio": torch.ones(3, 4)}
    GRPOTrainer._reject_mismatched(trainer, output)
    metrics = trainer._metrics["train"]
    assert metrics["kvroll/rejected_fraction"] == [pytest.approx(2 / 6)]
    assert metrics["kvroll/rejection_statistic/mean"] == [pytest.approx((sum(MEAN_ABS) + 0.35) / 6)]
    assert metrics["kvroll/rejection_statistic/max"] == [pytest.approx(1.4)]


def _hooked_grpo(**fields):
    """kvroll's GRPOTrainer, not initialised, with a fake trainer's args (``fields``), model, accelerator and metrics,
    marked as generating with kvroll: its ``_generate_and_score_completions`` hook runs on TRL's patched output."""
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    fake = fake_trainer(**fields)
    trainer.args, trainer.model, trainer.accelerator, trainer._metrics = (fake.args, fake.model, fake.accelerator,
                                                                          fake._metrics)
    trainer.kvroll_generation = object()
    return trainer


def test_grpo_without_sparse_rl_leaves_the_ratio_alone(monkeypatch):
    """kvroll_correction='none': TRL's ratio is not touched (mode token_truncate, a row that sparse_rl would reject
    at the default threshold) and no rejection metric is logged; the masked fraction still is."""
    import trl

    ratio = torch.tensor([[1.0, 1.2, 0.9, 1.0], [2.0, 0.5, 1.0, 1.0], [1.5, 0.2, 1.0, 1.0]])
    output = {"completion_mask": MASK, "old_per_token_logps": TRAINER, "sampling_per_token_logps": ROLLOUT,
              "importance_sampling_ratio": ratio.clone()}
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: output)
    trainer = _hooked_grpo(kvroll_correction="none", kvroll_rejection_threshold=0.3)
    assert trainer._generate_and_score_completions([]) is output
    assert torch.equal(output["importance_sampling_ratio"], ratio)
    assert "kvroll/rejected_fraction" not in trainer._metrics["train"]
    assert trainer._metrics["train"]["kvroll/is_masked_fraction"] == [0.0]


def test_rloo_hook_zeroes_the_rejected_rows_advantage():
    trainer = fake_trainer(kvroll_rejection_threshold=0.6)
    # RLOO drops the rollout logprobs it is given; the adapter keeps this rank's rows ([rows][tokens][1]).
    rows = [[-1.2, -1.6, -0.5, -1.0], [-1.5, -0.5, -1.5, NAN], [-1.0, -1.0]]
    trainer.kvroll_generation = SimpleNamespace(last_logprobs=[[[lp] for lp in row] for row in rows])
    output = {"completion_mask": MASK, "old_logps": (TRAINER * MASK).sum(1),
              "advantages": torch.tensor([0.5, -1.0, 2.0])}
    RLOOTrainer._reject_mismatched(trainer, output, TRAINER)
    assert output["advantages"].tolist() == [0.5, -1.0, 0.0]
    assert trainer._metrics["train"]["kvroll/rejected_fraction"] == [pytest.approx(1 / 3)]
    with pytest.raises(RuntimeError, match="no longer scores the rollout"):  # TRL's call order changed
        RLOOTrainer._reject_mismatched(trainer, output, TRAINER + 1.0)


# ---- 2-step runs on the tiny model ----------------------------------------------------------------------------
COMMON = dict(max_completion_length=12, max_steps=2, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
              save_strategy="no", seed=0, learning_rate=1e-2, use_kvroll=True, kvroll_policy="longflow",
              kvroll_budget=16, kvroll_correction="sparse_rl", kvroll_dtype="bfloat16")
# A bf16 engine for an fp32 trainer: every rollout token's logprob is off by rounding (the tiny random model barely
# notices the compressed prompt), so a threshold of 1e-9 rejects every rollout and 1e6 none.
GROUPS = dict(per_device_train_batch_size=8, num_generations=4, beta=0.0)


def metric(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def unchanged(before, module):
    return all(torch.equal(before[name], p.detach()) for name, p in module.named_parameters())


def check_rejected(trainer, fraction):
    values = metric(trainer, "kvroll/rejected_fraction")
    assert values == [pytest.approx(fraction)] * 2
    stats = metric(trainer, "kvroll/rejection_statistic/mean")
    assert len(stats) == 2 and all(0 < v < 5 for v in stats)  # the prompt is compressed: some mismatch


@pytest.mark.parametrize("threshold", [1e6, 1e-9])
def test_grpo_two_steps(tmp_path, threshold):
    tok = tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_mode="token_truncate",
                      kvroll_rejection_threshold=threshold, **GROUPS, **COMMON)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    before = snapshot(trainer.model)
    trainer.train()
    everything = threshold < 1
    check_rejected(trainer, 1.0 if everything else 0.0)
    # All rollouts rejected: every IS ratio is 0, the loss is 0, no gradient, the policy stays where it was.
    assert unchanged(before, trainer.model) == everything
    masked = metric(trainer, "kvroll/is_masked_fraction")
    assert masked == ([1.0, 1.0] if everything else [0.0, 0.0])  # token_truncate alone masks nothing


def test_rloo_two_steps_everything_rejected(tmp_path):
    tok = tokenizer()
    args = RLOOConfig(output_dir=str(tmp_path), kvroll_rejection_threshold=1e-9, **GROUPS, **COMMON)
    trainer = RLOOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    before = snapshot(trainer.model)
    trainer.train()
    check_rejected(trainer, 1.0)
    assert unchanged(before, trainer.model)  # every advantage 0: no policy gradient


@pytest.mark.parametrize("threshold", [1e6, 1e-9])
def test_ppo_two_steps(tmp_path, threshold):
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, rollout_batch_size=4,
                     num_ppo_epochs=1, vllm_importance_sampling_mode="token_truncate",
                     kvroll_rejection_threshold=threshold, **COMMON)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    policy, value = snapshot(trainer.model.policy), snapshot(trainer.model.value_model)
    trainer.train()
    everything = threshold < 1
    check_rejected(trainer, 1.0 if everything else 0.0)
    assert all(math.isfinite(v) for v in metric(trainer, "loss"))
    # Rejection zeroes the policy loss only (the KL sits in the reward here); the value model still learns.
    assert unchanged(policy, trainer.model.policy) == everything
    assert not unchanged(value, trainer.model.value_model)


# ---- config errors ---------------------------------------------------------------------------------------------
BASE = dict(report_to="none", use_cpu=True, per_device_train_batch_size=4, num_generations=4)
ON = dict(use_kvroll=True, kvroll_correction="sparse_rl", vllm_importance_sampling_mode="token_truncate")


@pytest.mark.parametrize("kwargs, message", [
    (dict(kvroll_correction="jackpot"), r"kvroll_correction='jackpot' is invalid; choose one of \['none', "),
    (dict(kvroll_rejection_statistic="max"), "kvroll_rejection_statistic='max' is invalid"),
    (dict(kvroll_rejection_threshold=0), "kvroll_rejection_threshold=0 is invalid: use a number"),
    (dict(kvroll_rejection_threshold=-0.1), "kvroll_rejection_threshold=-0.1 is invalid"),
    (dict(kvroll_rejection_threshold=math.inf), "kvroll_rejection_threshold=inf is invalid"),
    (dict(kvroll_rejection_threshold="0.3"), "kvroll_rejection_threshold='0.3' is invalid"),
    (dict(use_kvroll=False), r"use_kvroll=False: set use_kvroll=True, or set kvroll_correction='none'"),
    (dict(vllm_importance_sampling_mode="sequence_mask"),
     r"vllm_importance_sampling_mode='sequence_mask': set vllm_importance_sampling_mode='token_truncate'"),
    (dict(vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction=False: set it to True"),
    (dict(loss_type="vespo"), "cannot drop rows under loss_type='vespo'"),
])
def test_grpo_config_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(output_dir=str(tmp_path), **BASE, **{**ON, **kwargs})


def test_ppo_and_rloo_configs(tmp_path):
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode='sequence_mask'"):  # PPO's default mode
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, use_kvroll=True, kvroll_correction="sparse_rl")
    with pytest.raises(ValueError, match="kvroll_rejection_threshold=0 is invalid"):
        RLOOConfig(output_dir=str(tmp_path), **BASE, use_kvroll=True, kvroll_correction="sparse_rl",
                   kvroll_rejection_threshold=0)
    # RLOO has no importance-sampling fields: the rejection needs nothing else.
    args = RLOOConfig(output_dir=str(tmp_path), **BASE, use_kvroll=True, kvroll_correction="sparse_rl")
    assert (args.kvroll_rejection_statistic, args.kvroll_rejection_threshold) == ("mean_abs_log_ratio", 0.3)
    assert GRPOConfig(output_dir=str(tmp_path), **BASE).kvroll_correction == "none"  # off by default


def test_rloo_two_steps_with_a_reference_model(tmp_path):
    """beta > 0: RLOO scores the reference model too (its second _get_per_token_logps_and_entropies call); the
    rejection must compare with the policy's logprobs of the first call, not the reference's, which differ from the
    second step on (nothing rejected: the policy moves after step 1)."""
    tok = tokenizer()
    model_dir = tmp_path / "tiny"  # TRL loads the reference model from the policy's directory
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = RLOOConfig(output_dir=str(tmp_path / "out"), kvroll_rejection_threshold=1e6,
                      **{**GROUPS, "beta": 0.05}, **COMMON)
    trainer = RLOOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    before = snapshot(trainer.model)
    trainer.train()
    check_rejected(trainer, 0.0)
    assert not unchanged(before, trainer.model) and len(metric(trainer, "kl")) == 2


def test_grpo_hook_runs_on_a_tool_calling_batch(monkeypatch):
    """A batch with GRPO tools carries a tool_mask: the sparse_rl rejection and the masked fraction still run on it
    through _generate_and_score_completions, the tool token left out of both (row 2's statistic is 0.8, not 1.4;
    at threshold 0.4 rows 1 and 2 are rejected)."""
    import trl

    output = {"completion_mask": MASK, "tool_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]]),
              "old_per_token_logps": TRAINER, "sampling_per_token_logps": ROLLOUT,
              "importance_sampling_ratio": torch.ones(3, 4)}
    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: output)
    trainer = _hooked_grpo(kvroll_correction="sparse_rl", kvroll_rejection_threshold=0.4)
    trainer._generate_and_score_completions([])
    assert output["importance_sampling_ratio"][:, 0].tolist() == [1.0, 0.0, 0.0]  # row 2: 0.8 > 0.4
    metrics = trainer._metrics["train"]
    assert metrics["kvroll/rejection_statistic/max"] == [pytest.approx(0.8)]
    assert metrics["kvroll/is_masked_fraction"] == [pytest.approx(5 / 9)]  # 4 + 1 zeroed of 4 + 4 + 1 loss tokens
