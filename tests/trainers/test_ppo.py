"""PPOTrainer on a tiny model: 2-step runs (kvroll rollouts with a copied bf16 engine; plain ``model.generate`` with a
shared value head and the KL in the loss), the value loss on a fixed batch, saving, the config errors, and
``kvroll train`` with the shipped PPO config."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, TrainerCallback

from kvroll.trainers import PPOConfig, PPOTrainer
from kvroll.trainers.colocate import weights_checksum
from kvroll.trainers.train import build_parser, main, trainer_name

from .tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer

COMMON = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=10, max_steps=2,
              logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
              learning_rate=1e-2, num_ppo_epochs=1)


def metric(trainer, name):
    return [h[name] for h in trainer.state.log_history if name in h]


def snapshot(module):
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def changed(before, module):
    return [name for name, p in module.named_parameters() if not torch.equal(before[name], p.detach())]


class EngineRecorder(TrainerCallback):
    """After every optimizer step (each one ends an update here): the engine's weights and the policy's."""

    def __init__(self, trainer):
        self.trainer, self.sums = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        policy = self.trainer.accelerator.unwrap_model(self.trainer.model).policy
        engine = self.trainer.kvroll_generation.weights.engine_model
        self.sums.append((weights_checksum(policy, torch.bfloat16), weights_checksum(engine)))


def test_two_steps_kvroll_bf16_engine(tmp_path):
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), rollout_batch_size=4, use_kvroll=True, kvroll_policy="longflow",
                     kvroll_budget=16, kvroll_dtype="bfloat16", vllm_importance_sampling_mode="token_truncate",
                     **COMMON)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    model = trainer.model
    policy, value = snapshot(model.policy), snapshot(model.value_model)
    recorder = EngineRecorder(trainer)
    trainer.add_callback(recorder)
    trainer.train()

    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]
    for name in ("loss", "loss/policy", "loss/value", "grad_norm"):
        assert len(metric(trainer, name)) == 2 and all(math.isfinite(v) for v in metric(trainer, name)), name
    assert changed(policy, model.policy) and changed(value, model.value_model)
    assert "score.weight" in changed(value, model.value_model)
    # One rollout and one update per step: after each, the engine (a bf16 copy) holds the policy's weights.
    assert len(recorder.sums) == 2 and all(ours == engine for ours, engine in recorder.sums)
    assert recorder.sums[0][0] != recorder.sums[1][0], "the second update did not change the policy"
    assert trainer.kvroll_generation.last_sync["copied"] > 0
    for name in ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/min",
                 "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max",
                 "kvroll/is_masked_fraction", "kvroll/rollout_seconds", "kvroll/sync_seconds", "reward",
                 "rewards/length_reward/mean", "objective/kl"):
        values = metric(trainer, name)
        assert values and all(math.isfinite(v) for v in values), name
    # The bf16 engine's logprobs differ slightly from the fp32 trainer's: off-policy, but close.
    assert 0 < metric(trainer, "sampling/sampling_logp_difference/mean")[0] < 0.5
    # The reference is the initial policy: no KL before the first update, some after (k1 can be negative).
    assert metric(trainer, "objective/kl")[0] == 0.0 != metric(trainer, "objective/kl")[1]


def tiny_reward_model(tok):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    base = {k: v for k, v in tiny_llama(tok).config.to_dict().items() if k not in ("id2label", "label2id")}
    config = LlamaConfig(**base, num_labels=1)
    return LlamaForSequenceClassification(config)


def test_two_steps_generate_shared_head_kl_loss_and_save(tmp_path):
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), shared_value_head=True, kl_penalty="loss", kl_estimator="k3",
                     whiten_rewards=True, reward_weights=[1.0, 0.5], **COMMON)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=[length_reward, tiny_reward_model(tok)], args=args,
                         train_dataset=chat_dataset(), processing_class=tok, reward_processing_classes=[None, tok])
    model = trainer.model
    assert trainer.kvroll_generation is None and not hasattr(model, "value_model")
    policy, head = snapshot(model.policy), snapshot(model.value_head)
    trainer.train()
    assert all(math.isfinite(v) for name in ("loss", "loss/kl", "loss/value") for v in metric(trainer, name))
    assert len(metric(trainer, "loss/kl")) == 2 and "objective/kl" in trainer.state.log_history[0]
    assert "sampling/importance_sampling_ratio/mean" not in trainer.state.log_history[0]  # no rollout logprobs
    first = trainer.state.log_history[0]  # the score is length + 0.5 * the reward model's logit
    assert first["reward"] == pytest.approx(first["rewards/length_reward/mean"]
                                            + 0.5 * first["rewards/LlamaForSequenceClassification/mean"], abs=1e-5)
    assert first["rewards/LlamaForSequenceClassification/std"] > 0
    assert changed(policy, model.policy) and changed(head, model.value_head)

    trainer.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert weights_checksum(reloaded) == weights_checksum(model.policy)
    assert (tmp_path / "saved" / "value_model.safetensors").is_file()


def test_value_loss_decreases_on_a_fixed_batch(tmp_path):
    # One rollout of 8, six epochs of one minibatch each: the value model fits the fixed returns.
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), **{**COMMON, "per_device_train_batch_size": 8, "max_steps": 6,
                                                  "num_ppo_epochs": 6, "learning_rate": 1e-2},
                     lr_scheduler_type="constant",
                     rollout_batch_size=8, cliprange_value=10.0, vf_coef=1.0, kl_coef=0.0)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    trainer.train()
    losses = metric(trainer, "loss/value")
    assert len(losses) == 6 and len(metric(trainer, "reward")) == 1  # one rollout
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.5 * losses[0], losses
    assert metric(trainer, "policy/approxkl")[0] == 0.0 < metric(trainer, "policy/approxkl")[-1]


@pytest.mark.parametrize("key", [k for k in ("gradient_checkpointing", "activation_checkpointing")
                                 if k in PPOConfig.__dataclass_fields__])  # the second: transformers > 5.17
def test_checkpointing_reaches_both_backbones_and_leaves_the_losses(tmp_path, key):
    # transformers passes every_n_layers / offload to the model's checkpointing switch: PolicyAndValue refused them
    # (a TypeError at train(); found on an H200 with gradient_checkpointing=True). The recomputation must not change
    # a loss (fp32, no dropout), and the value model's backbone must checkpoint too.
    tok = tokenizer()
    runs = {}
    for on in (False, True):
        args = PPOConfig(output_dir=str(tmp_path / str(on)), rollout_batch_size=4, kl_coef=0.0, **COMMON,
                         **{key: on})
        trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                             train_dataset=chat_dataset(), processing_class=tok)
        trainer.train()
        model = trainer.model
        flags = [[getattr(m, "gradient_checkpointing", False) for m in backbone.modules()]
                 for backbone in (model.policy, model.value_model.backbone)]
        assert all(any(f) == on for f in flags), (on, flags)
        assert model.is_gradient_checkpointing == on
        runs[on] = [metric(trainer, name) for name in ("loss/policy", "loss/value")]
    assert len(runs[True][0]) == 2
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)


def _config_dir(path, **overrides):
    tok = tokenizer()
    config = LlamaConfig(**{**tiny_llama(tok).config.to_dict(), **overrides})
    config.save_pretrained(path)  # a config without weights: loading any would fail
    return str(path)


@pytest.mark.parametrize("field, value", [("hidden_size", 64), ("vocab_size", 1000)])
def test_mismatched_value_model_fails_before_loading(tmp_path, field, value):
    policy = _config_dir(tmp_path / "policy")
    other = _config_dir(tmp_path / "value", **{field: value})
    args = PPOConfig(output_dir=str(tmp_path), value_model_name_or_path=other, use_cpu=True)
    with pytest.raises(ValueError, match=rf"value_model_name_or_path='{other}' has {field}={value}.*policy"):
        PPOTrainer(model=policy, reward_funcs=length_reward, args=args)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=1.5), r"gamma=1\.5 is invalid: it must lie in \[0, 1\]"),
    (dict(gamma=-0.1), r"gamma=-0\.1 is invalid"),
    (dict(lam=2.0), r"lam=2\.0 is invalid: it must lie in \[0, 1\]"),
    (dict(cliprange=0.0), r"cliprange=0\.0 is invalid: a clip range must be a finite number > 0"),
    (dict(cliprange_value=-0.2), r"cliprange_value=-0\.2 is invalid: a clip range must be a finite number > 0"),
    (dict(cliprange=float("inf")), r"cliprange=inf is invalid"),
    (dict(vf_coef=float("nan")), r"vf_coef=nan is invalid: use a finite weight >= 0"),
    (dict(kl_coef=-0.1), r"kl_coef=-0\.1 is invalid: use a finite weight >= 0"),
    (dict(num_ppo_epochs=True), r"num_ppo_epochs=True is invalid: use an integer >= 1"),
    (dict(per_device_train_batch_size=1, rollout_batch_size=True), r"rollout_batch_size=True is invalid: use an "),
    (dict(reward_weights=[1.0, float("nan")]), r"reward_weights=\[1\.0, nan\] is invalid: use a list of finite"),
    (dict(reward_weights=[]), r"reward_weights=\[\] is invalid: use a list of finite numbers, one per reward"),
    (dict(value_model_name_or_path=""), r"value_model_name_or_path='' is not a directory"),  # Path('') is '.'
    (dict(eval_strategy="steps"), r"eval_strategy='steps' is invalid for PPO: .* leave eval_strategy 'no'"),
    (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, rollout_batch_size=12),
     r"rollout_batch_size=12 is not a multiple of the minibatch.* = 8: set rollout_batch_size to a multiple of 8"),
    (dict(shared_value_head=True, value_model_name_or_path="x"), r"shared_value_head=True and value_model_name"),
    (dict(kl_penalty="advantage"), r"kl_penalty='advantage' is invalid"),
    (dict(vllm_importance_sampling_mode="token"), r"vllm_importance_sampling_mode='token' is invalid"),
    (dict(use_kvroll="yes"), r"use_kvroll='yes' is invalid: use True or False"),
    (dict(max_completion_length=0), r"max_completion_length=0 is invalid: use an integer >= 1"),
    (dict(use_kvroll=True, max_completion_length=0), r"max_completion_length=0 is invalid with use_kvroll=True"),
    (dict(value_model_name_or_path="/nonexistent"),
     r"value_model_name_or_path='/nonexistent' is not a directory: pass a local Hugging Face model directory or "
     r"'smollm2'"),
    (dict(kl_penalty="loss", kl_estimator="k1"), r"kl_penalty='loss' with kl_estimator='k1' is invalid: the gradient"),
    (dict(temperature=0.0), r"temperature=0\.0 is invalid for PPO: use a finite sampling temperature >= 1e-05"),
    (dict(temperature=float("inf")), r"temperature=inf is invalid for PPO: use a finite sampling temperature"),
    (dict(temperature=-1.0), r"temperature=-1\.0 is invalid for PPO: use a finite sampling temperature"),
    (dict(generation_kwargs={"temperature": 0.3, "top_p": 0.9}),
     r"generation_kwargs keys \['temperature'\] are not allowed in PPO"),
    (dict(generation_kwargs='{"max_new_tokens": 5}'), r"generation_kwargs keys \['max_new_tokens'\] are not allowed"),
    (dict(use_kvroll=True, generation_kwargs={"do_sample": False}),
     r"generation_kwargs keys \['do_sample'\] are not allowed in PPO"),
    (dict(vllm_importance_sampling_clip_min=5.0, vllm_importance_sampling_clip_max=3.0),
     r"vllm_importance_sampling_clip_min=5\.0 must be < vllm_importance_sampling_clip_max=3\.0"),
    (dict(vllm_importance_sampling_clip_min=3.0, vllm_importance_sampling_clip_max=3.0),  # every ratio clamped to 3
     r"vllm_importance_sampling_clip_min=3\.0 must be < vllm_importance_sampling_clip_max=3\.0"),
    (dict(vllm_importance_sampling_clip_max=-1.0), r"vllm_importance_sampling_clip_max=-1\.0 is invalid"),
    (dict(num_ppo_epochs=0), r"num_ppo_epochs=0 is invalid: use an integer >= 1"),  # no pass: nothing would train
    (dict(vllm_importance_sampling_clip_max=float("inf")), r"vllm_importance_sampling_clip_max=inf is invalid: an "
                                                           r"importance-ratio bound is a finite number"),
    (dict(vllm_importance_sampling_clip_min=True), r"vllm_importance_sampling_clip_min=True is invalid"),
    (dict(whiten_advantages="no"), r"whiten_advantages='no' is invalid: use true or false"),
    (dict(whiten_rewards=1), r"whiten_rewards=1 is invalid: use true or false"),
    (dict(shared_value_head="yes"), r"shared_value_head='yes' is invalid: use true or false"),
    (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
     r"vllm_importance_sampling_mode='token_truncate' needs vllm_importance_sampling_clip_max"),
])
def test_config_errors(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def test_the_kl_estimator_follows_where_the_penalty_goes(tmp_path):
    # k1 in the reward (TRL's old PPO); in the loss k3 (verl's low_var_kl): k1's gradient there is 0 in expectation
    import dataclasses

    from kvroll.trainers.ppo_config import kl_estimator_of

    def config(**kwargs):
        return PPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)

    assert kl_estimator_of(config()) == "k1" and kl_estimator_of(config(kl_penalty="loss")) == "k3"
    assert kl_estimator_of(config(kl_penalty="reward", kl_estimator="k3")) == "k3"
    assert kl_estimator_of(config(kl_penalty="loss", kl_estimator="k1", kl_coef=0.0)) == "k1"  # no KL term to refuse
    # resolved at use: a copy with the KL moved into the loss follows it (resolving in the config made it k1, refused)
    assert kl_estimator_of(dataclasses.replace(config(), kl_penalty="loss")) == "k3"


def test_generation_kwargs_may_restate_the_sampling_fields(tmp_path):
    kwargs = {"temperature": 0.8, "do_sample": True, "max_new_tokens": 12, "max_tokens": 12, "top_p": 0.9}
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, temperature=0.8, max_completion_length=12,
                     generation_kwargs=kwargs)
    assert args.generation_kwargs == kwargs
    for other in ({"do_sample": False}, {"do_sample": 1}, {"max_new_tokens": 11}):
        with pytest.raises(ValueError, match=rf"generation_kwargs keys \['{next(iter(other))}'\] are not allowed"):
            PPOConfig(output_dir=str(tmp_path), use_cpu=True, max_completion_length=12, generation_kwargs=other)


def test_reward_lists_of_other_lengths_are_refused_before_loading(tmp_path):
    policy = _config_dir(tmp_path / "policy")  # a config without weights: loading any would fail
    funcs = [length_reward, length_reward]
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, reward_weights=[1.0])
    with pytest.raises(ValueError, match=r"reward_weights=\[1\.0\] has 1 entries for 2 reward functions"):
        PPOTrainer(model=policy, reward_funcs=funcs, args=args)
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"reward_processing_classes has 1 entries for 2 reward functions"):
        PPOTrainer(model=policy, reward_funcs=funcs, args=args, reward_processing_classes=[None])


def test_a_dataset_smaller_than_one_rollout_is_refused(tmp_path):
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), rollout_batch_size=16, **COMMON)
    with pytest.raises(ValueError, match=r"train_dataset has 8 prompts, fewer than one rollout: "
                                         r"rollout_batch_size=16 x 1 process\(es\) = 16"):
        PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(8),
                   processing_class=tok)


def test_a_reward_model_as_value_model_keeps_its_head(tmp_path):
    from kvroll.trainers.ppo_models import ValueModel

    tok = tokenizer()
    reward_model = tiny_reward_model(tok)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    want = reward_model(input_ids=ids, attention_mask=ones).logits[:, 0]  # the last token's score
    value = ValueModel.from_model(reward_model, copy_weights=True)
    assert value.score is not reward_model.score and torch.equal(value.score.weight, reward_model.score.weight)
    torch.testing.assert_close(value(ids, ones, torch.arange(7).expand(2, -1))[:, -1], want)
    reward_model.save_pretrained(tmp_path / "rm")  # the same from a saved directory (value_model_name_or_path)
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True)
    loaded = PPOTrainer._value_model(str(tmp_path / "rm"), tiny_llama(tok), args)
    torch.testing.assert_close(loaded(ids, ones, torch.arange(7).expand(2, -1))[:, -1], want)
    # a classifier of 2 labels (transformers' default) is not a value: its backbone, a fresh scalar head
    from transformers import LlamaForSequenceClassification

    base = {k: v for k, v in reward_model.config.to_dict().items() if k not in ("id2label", "label2id", "num_labels")}
    LlamaForSequenceClassification(LlamaConfig(**base)).save_pretrained(tmp_path / "classifier")
    fresh = PPOTrainer._value_model(str(tmp_path / "classifier"), tiny_llama(tok), args)
    assert fresh.score.out_features == 1 and fresh.score.bias is not None  # kvroll's value_head


def test_a_reward_model_also_given_as_value_model_is_not_trained(tmp_path):
    # One object as reward function and value model: the value model must be a copy, else PPO's optimizer trains the
    # reward model through the value loss and the next rollouts are scored by moved weights.
    tok = tokenizer()
    reward_model = tiny_reward_model(tok)
    args = PPOConfig(output_dir=str(tmp_path), rollout_batch_size=4, kl_coef=0.0, **{**COMMON, "max_steps": 1})
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=reward_model, value_model=reward_model, args=args,
                         train_dataset=chat_dataset(), processing_class=tok, reward_processing_classes=tok)
    scorer, value = trainer.reward_funcs[0], trainer.model.value_model
    before, value_before = snapshot(scorer), snapshot(value)
    assert value.backbone is not scorer.model and torch.equal(value.score.weight, scorer.score.weight)
    trainer.train()
    assert not changed(before, scorer) and changed(value_before, value)


def test_dropout_off_and_generation_kwargs_over_the_generate_path(tmp_path):
    # As TRL's old PPOTrainer: dropout off everywhere, so the first minibatch is on-policy (ratio 1, approxkl 0) and
    # the reference (the initial policy) is at KL 0; generation_kwargs override the generate path's own settings
    # (top_p is one of them: it was a duplicate keyword)
    tok = tokenizer()
    policy = tiny_llama(tok)
    policy.config.attention_dropout = 0.5
    for module in policy.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    args = PPOConfig(output_dir=str(tmp_path), generation_kwargs={"top_p": 0.9}, **{**COMMON, "max_steps": 1})
    trainer = PPOTrainer(model=policy, reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in trainer.model.modules())
    assert all(getattr(m, "attention_dropout", 0.0) == 0.0 for m in trainer.ref_model.modules())
    assert policy.config.attention_dropout == 0.5  # the modules', not the config (a saved model would carry it)
    trainer.train()
    assert metric(trainer, "policy/approxkl")[0] == 0.0 and metric(trainer, "objective/kl")[0] == 0.0


def test_the_reference_runs_under_the_policys_bf16_autocast(tmp_path):
    # accelerate wraps the policy's forward in autocast; the reference (the same initial weights) must run the same
    # way, or the KL before any update is not 0
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_steps": 1, "bf16": True})
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    trainer.train()
    assert metric(trainer, "objective/kl")[0] == 0.0


def test_embedded_value_model_name_is_accepted(tmp_path):
    assert PPOConfig(output_dir=str(tmp_path), use_cpu=True,
                     value_model_name_or_path="smollm2").value_model_name_or_path == "smollm2"
    assert PPOConfig(output_dir=str(tmp_path), use_cpu=True,
                     value_model_name_or_path=str(tmp_path)).value_model_name_or_path == str(tmp_path)


def test_a_dataset_without_prompts_is_refused_before_loading(tmp_path):
    from datasets import Dataset

    policy = _config_dir(tmp_path / "policy")  # a config without weights: loading any would fail
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column \(its columns: \['question'\]\)"):
        PPOTrainer(model=policy, reward_funcs=length_reward, args=args,
                   train_dataset=Dataset.from_dict({"question": ["1 + 1?"]}))


def test_config_defaults_and_parser(tmp_path):
    from trl import TrlParser

    (args,) = TrlParser((PPOConfig,)).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "2", "--rollout_batch_size", "8", "--gamma", "0.99", "--use_kvroll", "true"])
    assert (args.gamma, args.lam, args.rollout_batch_size, args.steps_per_generation) == (0.99, 0.95, 8, 4)
    assert args.use_kvroll and args.vllm_importance_sampling_correction
    assert PPOConfig(output_dir=str(tmp_path), use_cpu=True).rollout_batch_size == 8  # one minibatch


PPO_CONFIG = Path(__file__).parents[2] / "configs" / "ppo_smollm2.yaml"


def test_kvroll_train_runs_ppo_from_the_shipped_config(tmp_path, capsys):
    tok = tokenizer()
    model_dir = tmp_path / "tiny"
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    # Paths everywhere: a separate value model (a LlamaModel) and the reference load from the policy's directory.
    assert main(["--config", str(PPO_CONFIG), "--model", str(model_dir), "--output_dir", str(out), "--max_steps", "2",
                 "--shared_value_head", "false",
                 "--num_ppo_epochs", "1", "--max_completion_length", "8", "--kvroll_budget", "16",
                 "--task_size", "8", "--learning_rate", "1e-3"]) == 0
    printed = capsys.readouterr().out
    assert "8 rows x 1 rank a rollout, ppo, G=1" in printed  # the config's rollout_batch_size
    assert "ppo, G=1" in printed and "step   1/2  reward" in printed and "step   2/2  reward" in printed
    history = json.loads((out / "log_history.json").read_text())
    assert [h["step"] for h in history if "loss/value" in h] == [1, 2]
    assert (out / "model.safetensors").is_file() and (out / "value_model.safetensors").is_file()
    from safetensors import safe_open

    with safe_open(out / "value_model.safetensors", "pt") as f:
        assert "value_model.score.weight" in f.keys() and any(k.startswith("value_model.backbone.") for k in f.keys())


def test_trainer_choice():
    args, config = build_parser("ppo").parse_args_and_config(["--config", str(PPO_CONFIG)])
    assert args.trainer == "ppo" and isinstance(config, PPOConfig) and config.use_kvroll
    assert config.rollout_batch_size % (config.per_device_train_batch_size * config.gradient_accumulation_steps) == 0
    assert trainer_name(["--config", str(PPO_CONFIG)]) == "ppo"
    assert trainer_name(["--config", str(PPO_CONFIG), "--trainer", "grpo"]) == "grpo"
    assert trainer_name(["--max_steps", "3"]) == "grpo"
    with pytest.raises(ValueError, match="trainer='dpo' is invalid; choose 'grpo', 'rloo' or 'ppo'"):
        trainer_name(["--trainer", "dpo"])


@pytest.mark.gpu
def test_ppo_zero3_engine_weights_follow_the_gathered_policy(tmp_path):
    """``ppo_zero3_worker.py`` in a subprocess (DeepSpeed state is process-global); it passed on CPU too, ~3.5 min:
    ``python tests/trainers/ppo_zero3_worker.py OUT --device cpu``."""
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    worker = Path(__file__).with_name("ppo_zero3_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), "--device", "cuda"], env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PPO ZERO3 OK" in output, output[-6000:]


def test_resume_from_a_checkpoint(tmp_path):
    """Two steps with a checkpoint after each; a fresh trainer resumed from the first starts from its weights."""
    tok = tokenizer()
    common = {**COMMON, "save_strategy": "steps", "save_steps": 1}
    first = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, train_dataset=chat_dataset(),
                       processing_class=tok, args=PPOConfig(output_dir=str(tmp_path), **common))
    first.train()
    seen = []

    class AtStart(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(weights_checksum(second.model))

    second = PPOTrainer(model=tiny_llama(tok, seed=7), reward_funcs=length_reward, train_dataset=chat_dataset(),
                        processing_class=tok, args=PPOConfig(output_dir=str(tmp_path / "again"), **common))
    before = weights_checksum(second.model)
    second.add_callback(AtStart())
    second.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    loaded = PPOTrainer(model=tiny_llama(tok, seed=7), reward_funcs=length_reward, processing_class=tok,
                        args=PPOConfig(output_dir=str(tmp_path / "load"), **COMMON))
    loaded._load_from_checkpoint(str(tmp_path / "checkpoint-1"))
    assert weights_checksum(loaded.model) != before  # policy and value weights came from the checkpoint
    assert seen == [weights_checksum(loaded.model)]  # the resumed run started from them
    assert second.state.global_step == 2 and [h["step"] for h in second.state.log_history if "loss" in h] == [1, 2]
    assert second._step == 2  # micro-steps counted from the checkpoint's step: rollout boundaries kept


@pytest.mark.slow
def test_two_gloo_ranks(tmp_path):
    """Two DDP ranks (gloo): each rolls out its own prompts; both end with the same policy and value weights."""
    import os
    import subprocess
    import sys

    from .test_two_ranks import free_port

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(Path(__file__).with_name("ppo_two_rank_worker.py")), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PPO RANK 0 OK" in output and "PPO RANK 1 OK" in output, output[-6000:]


def test_trust_remote_code_reaches_every_load(tmp_path, monkeypatch):
    """The config's ``trust_remote_code`` goes to the policy's, the reference's and the value model's loads (it
    reached only their configs), unless ``model_init_kwargs`` sets it."""
    import kvroll.trainers.ppo as ppo

    seen = []
    monkeypatch.setattr(ppo.AutoModelForCausalLM, "from_pretrained",
                        lambda source, **kwargs: seen.append(kwargs) or "model")
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, trust_remote_code=True)
    assert PPOTrainer._causal_lm("some/dir", args) == "model" and seen[-1] == {"trust_remote_code": True}
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True, trust_remote_code=True,
                     model_init_kwargs={"trust_remote_code": False, "revision": "main"})
    PPOTrainer._causal_lm("some/dir", args)
    assert seen[-1] == {"trust_remote_code": False, "revision": "main"}
    assert PPOTrainer._load_kwargs(PPOConfig(output_dir=str(tmp_path), use_cpu=True)) == {"trust_remote_code": False}


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_p=2.0), r"top_p=2\.0 is invalid: top_p must be in \(0, 1\]"),
    (dict(generation_kwargs={"top_k": -1}), r"generation_kwargs\['top_k'\]=-1 is invalid"),
    (dict(generation_kwargs={"stop_token_ids": [2], "seed": 1}), r"generation_kwargs keys \['seed', "
                                                                  r"'stop_token_ids'\] are read by kvroll's sampler "
                                                                  r"only; with use_kvroll=False"),
])
def test_hf_rollouts_check_their_sampling_before_loading(tmp_path, kwargs, message):
    """use_kvroll=False: the sampling values are checked as kvroll's are, before any model loads (HF's generate
    checked them after), and keys HF's GenerationConfig would silently ignore are refused."""
    with pytest.raises(ValueError, match=message):
        PPOConfig(output_dir=str(tmp_path), use_cpu=True, use_kvroll=False, **kwargs)
    PPOConfig(output_dir=str(tmp_path), use_cpu=True, use_kvroll=False, generation_kwargs={"top_p": 0.9})


@pytest.mark.parametrize("reward_funcs", [None, [], [None], [length_reward, 3]])
def test_a_missing_reward_function_is_refused_before_loading(tmp_path, reward_funcs):
    args = PPOConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"reward_funcs=.* is invalid: PPO needs at least one reward function"):
        PPOTrainer(model=str(tmp_path / "not-loaded"), reward_funcs=reward_funcs, args=args,
                   train_dataset=chat_dataset())


def test_each_ppo_epoch_takes_a_fresh_shuffle_of_the_rollout(tmp_path):
    # One rollout of 8 rows, 2 PPO epochs of 2 minibatches of 4: each epoch covers every row once, in a new order.
    tok = tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_steps": 4, "num_ppo_epochs": 2},
                     rollout_batch_size=8, kl_coef=0.0)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    seen, prepare = [], trainer._prepare_inputs

    def record(batch):
        minibatch = prepare(batch)
        rows = {tuple(r.tolist()): i for i, r in enumerate(trainer._rollout["input_ids"])}
        seen.append([rows[tuple(r.tolist())] for r in minibatch["input_ids"]])
        return minibatch

    trainer._prepare_inputs = record
    trainer.train()
    assert len(metric(trainer, "reward")) == 1 and len(seen) == 4  # one rollout, four optimizer steps
    epochs = [seen[0] + seen[1], seen[2] + seen[3]]
    assert all(sorted(e) == list(range(8)) for e in epochs), epochs
    assert epochs[0] != epochs[1], epochs


def test_a_peft_model_is_refused_before_training(tmp_path):
    peft = pytest.importorskip("peft")
    tok = tokenizer()
    model = peft.get_peft_model(tiny_llama(tok), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    args = PPOConfig(output_dir=str(tmp_path), rollout_batch_size=4, **COMMON)
    with pytest.raises(ValueError, match="PPOTrainer: model is a PEFT model"):
        PPOTrainer(model=model, reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                   processing_class=tok)


def test_is_masked_fraction_is_the_share_of_every_ranks_tokens():
    # Two ranks (gather faked): rank 0 holds 1 completion token, zeroed by sequence_mask; rank 1 holds 9, none zeroed.
    # The share of all ranks' tokens is 1/10, as GRPO logs it; a mean of the ranks' shares would be 0.5.
    import types
    from collections import defaultdict

    class Capture:
        def gather(self, x):
            self.sent = x
            return x

    class TwoRanks:
        def __init__(self, other):
            self.other = other

        def gather(self, x):
            return torch.cat([x, self.other])

    def log(accelerator, weights, mask):
        trainer = types.SimpleNamespace(accelerator=accelerator, _metrics={"train": defaultdict(list)})
        PPOTrainer._log_importance(trainer, torch.zeros_like(mask), torch.zeros_like(mask), weights, mask)
        return trainer._metrics["train"]

    short, long = torch.zeros(1, 9), torch.ones(1, 9)
    short[0, 0] = 1.0
    rank1 = Capture()
    log(rank1, torch.ones(1, 1), long)
    metrics = log(TwoRanks(rank1.sent), torch.zeros(1, 1), short)
    assert metrics["kvroll/is_masked_fraction"] == [pytest.approx(0.1)]
    assert metrics["sampling/importance_sampling_ratio/mean"] == [pytest.approx(0.5)]  # TRL's: a mean of the ranks'
    assert metrics["sampling/importance_sampling_ratio/max"] == [1.0]
