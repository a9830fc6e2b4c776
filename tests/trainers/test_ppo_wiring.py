"""PPOTrainer's rollout tensors and loss against an independent recomputation: each row scored alone (no padding) in
fp64 by the policy, the value model and a reference that differs from the policy, then GAE and whitening by hand."""
from __future__ import annotations

import math

import pytest
import torch

from kvroll.trainers import PPOConfig, PPOTrainer
from kvroll.trainers.ppo_math import gae, masked_whiten

from .tiny_model import chat_dataset, tiny_llama, tokenizer


def token_count_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def alone(model, prompt, completion, temperature):
    """(logprobs, values of the state each token is sampled from) of one row without padding, fp64."""
    ids = torch.tensor([prompt + completion])
    logits = model.policy(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature
    logps = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
    values = model.value_model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0, len(prompt) - 1:-1]
    return logps, values.double()


@pytest.mark.parametrize("kl_penalty", ["reward", "loss"])
def test_rollout_and_loss_match_an_independent_recomputation(tmp_path, kl_penalty):
    tok, temperature, kl_coef, vf_coef = tokenizer(), 0.7, 0.3, 0.25
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, rollout_batch_size=4, use_cpu=True,
                     bf16=False, report_to="none", save_strategy="no", max_completion_length=6, num_ppo_epochs=1,
                     temperature=temperature, kl_coef=kl_coef, vf_coef=vf_coef, kl_penalty=kl_penalty,
                     whiten_rewards=True, seed=0)
    dataset = chat_dataset(12)
    trainer = PPOTrainer(model=tiny_llama(tok, eos_logit=6.0), ref_model=tiny_llama(tok, seed=1, eos_logit=6.0),
                         reward_funcs=token_count_reward, args=args, train_dataset=dataset, processing_class=tok)
    rows = [dataset[i] for i in (0, 10, 5, 11)]  # prompts of different lengths: left padding
    batch = trainer._make_rollout(rows)
    model, ref, mask = trainer.model, trainer.ref_model, batch["completion_mask"]
    width = mask.shape[1]
    assert len({int(n) for n in batch["attention_mask"][:, :-width].sum(1)}) > 1, "no left padding"

    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    kl_sums = []
    with torch.no_grad():
        for i in range(len(rows)):
            n = int(mask[i].sum())
            prompt = batch["input_ids"][i, :-width][batch["attention_mask"][i, :-width].bool()].tolist()
            completion = batch["input_ids"][i, -width:][:n].tolist()
            logps, values = alone(model, prompt, completion, temperature)
            ids = torch.tensor([prompt + completion])
            ref_logps = (ref(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature).log_softmax(-1) \
                .gather(-1, torch.tensor(completion)[:, None])[:, 0]
            torch.testing.assert_close(batch["old_logps"][i, :n].double(), logps, atol=1e-4, rtol=0)
            torch.testing.assert_close(batch["old_values"][i, :n].double(), values, atol=1e-4, rtol=0)
            torch.testing.assert_close(batch["ref_logps"][i, :n].double(), ref_logps, atol=1e-4, rtol=0)
            kl = logps - ref_logps  # k1 in the reward; in the loss the reward carries no KL
            kl_sums.append(float(kl.sum()) if kl_penalty == "reward" else None)
            if kl_penalty == "reward":
                rewards[i, :n] = -kl_coef * kl
            rewards[i, n - 1] += n  # the score (the completion's token count) on its last token
    mask64 = mask.double()
    rewards = masked_whiten(rewards, mask64, shift_mean=False)
    advantages, returns = gae(rewards, batch["old_values"].double(), mask64, gamma=1.0, lam=0.95)
    torch.testing.assert_close(batch["returns"].double(), returns, atol=1e-4, rtol=0)
    torch.testing.assert_close(batch["advantages"].double(), masked_whiten(advantages, mask64), atol=1e-4, rtol=0)
    if kl_penalty == "reward":
        assert trainer._metrics["train"]["objective/kl"][-1] == pytest.approx(sum(kl_sums) / len(kl_sums), abs=1e-4)

    # The loss of the whole rollout as one micro-batch, before any update: ratio 1, values = the rollout's.
    loss = trainer.compute_loss(model, batch)
    pg = -(batch["advantages"].double() * mask64).sum() / mask64.sum()
    vf = 0.5 * (((batch["old_values"].double() - batch["returns"].double()) ** 2) * mask64).sum() / mask64.sum()
    expected = pg + vf_coef * vf
    if kl_penalty == "loss":  # k3 = q/p - 1 - log(q/p)
        log_q_p = (batch["ref_logps"] - batch["old_logps"]).double()
        expected += kl_coef * ((torch.expm1(log_q_p) - log_q_p) * mask64).sum() / mask64.sum()
        # The KL term alone (no advantage, values at their returns) still moves the policy toward the reference.
        model.zero_grad()
        still = {**batch, "advantages": torch.zeros_like(mask), "returns": batch["old_values"]}
        trainer.compute_loss(model, still).backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.policy.parameters())
    assert float(loss.detach()) == pytest.approx(float(expected), abs=1e-4)


def test_importance_weights_are_trainer_over_rollout(tmp_path):
    """Each token's policy-loss weight is exp(logp_trainer - logp_rollout), not its inverse. The rollout backend is
    faked: fixed completions whose rollout logprobs are the trainer's shifted by -0.4 / +0.3 (weights e^0.4 / e^-0.3,
    inside the bounds)."""
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, rollout_batch_size=4, use_cpu=True,
                     bf16=False, report_to="none", save_strategy="no", max_completion_length=6, num_ppo_epochs=1,
                     kl_coef=0.0, vllm_importance_sampling_mode="token_truncate",
                     vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=3.0, seed=0)
    dataset = chat_dataset(4)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=token_count_reward, args=args, train_dataset=dataset,
                         processing_class=tok)
    completions = [[100, 200, tok.eos_token_id], [300], [400, 500], [600, 700, 800, 900]]

    class FakeBackend:
        logps = [[0.0] * len(c) for c in completions]

        def sync_weights(self):
            pass

        def generate(self, prompts, images, num_generations):
            return prompts, completions, [[[lp] for lp in row] for row in self.logps], None

    trainer.kvroll_generation = backend = FakeBackend()
    rows = [dataset[i] for i in range(4)]
    old = trainer._make_rollout(rows)["old_logps"]
    shift = [[-0.4 if t % 2 == 0 else 0.3 for t in range(len(c))] for c in completions]
    backend.logps = [[float(old[i, t]) + s for t, s in enumerate(row)] for i, row in enumerate(shift)]
    batch = trainer._make_rollout(rows)
    mask = batch["completion_mask"]
    expected = torch.zeros_like(mask)
    for i, row in enumerate(shift):
        expected[i, :len(row)] = torch.exp(-torch.tensor(row))
    torch.testing.assert_close(batch["is_weights"] * mask, expected, atol=1e-5, rtol=0)
    assert trainer._metrics["train"]["sampling/importance_sampling_ratio/max"][-1] == pytest.approx(math.exp(0.4),
                                                                                                     abs=1e-5)
