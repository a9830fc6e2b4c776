"""``PPOConfig`` / ``PPOTrainer``: actor-critic PPO for language models, rollouts behind kvroll's switch.

    from kvroll.trainers import PPOConfig, PPOTrainer
    args = PPOConfig(output_dir="out", use_kvroll=True, kvroll_policy="rkv", kvroll_budget=1024, kl_coef=0.05)
    trainer = PPOTrainer(model="smollm2", reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()

TRL removed its PPO trainer in 1.13; this one keeps TRL's conventions (config fields, reward functions, GRPO's
rollout metric names, ``use_kvroll``; the loss metrics drop the old PPO's ``_avg``). Without ``use_kvroll``
rollouts come from ``model.generate``, as in TRL's old PPO.

Why a ``transformers.Trainer`` subclass and not a loop of our own: the Trainer already brings accelerate,
DeepSpeed (ZeRO configs), gradient accumulation and clipping, the LR schedule, callbacks, logging and checkpoints.
PPO fits its loop the way TRL's GRPO does: the dataloader yields a rollout batch each step; ``_prepare_inputs``
rolls out once every ``num_ppo_epochs * steps_per_generation`` micro-steps, computes values, rewards and GAE, then
hands out micro-batches of a fresh shuffle each epoch; ``compute_loss`` is the PPO loss of one micro-batch. The
trained module is ``PolicyAndValue`` (policy + value model, one optimizer); kvroll's adapter sees the policy only.
"""
from __future__ import annotations

import copy
import os
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, \
    GenerationConfig, PreTrainedModel, Trainer, TrainerCallback

from kvroll.trainers._trl import check_trl_version

check_trl_version()

from trl.models.utils import prepare_deepspeed, unwrap_model_for_generation  # noqa: E402
from trl.trainer.utils import RepeatSampler, disable_dropout_in_model, identity, \
    selective_log_softmax  # noqa: E402

from kvroll.trainers import switch  # noqa: E402
from kvroll.trainers.adapter import KVRollGeneration  # noqa: E402
from kvroll.trainers.correction import args_rejection, record_rejection  # noqa: E402
from kvroll.trainers.ppo_config import PPOConfig, kl_estimator_of  # noqa: E402
from kvroll.trainers.ppo_math import gae, importance_stats, importance_weights, kl_estimate, masked_mean, \
    masked_whiten, policy_loss, token_rewards, value_loss  # noqa: E402
from kvroll.trainers.ppo_models import PolicyAndValue, ValueModel, check_value_model, positions, \
    value_source  # noqa: E402
from kvroll.trainers.ppo_rollout import completion_texts, cut_at_eos, left_pad, pad_rollout, reward_name, \
    reward_scores, tokenize_prompts  # noqa: E402

__all__ = ["PPOConfig", "PPOTrainer"]
VALUE_WEIGHTS = "value_model.safetensors"


class PPOTrainer(Trainer):
    """PPO with a value model, GAE, clipped policy and value losses and a KL penalty to a frozen reference.

    ``model``: a causal LM or its path (``"smollm2"`` for the embedded model). ``value_model``: a model or path the
    value model is initialised from (default ``args.value_model_name_or_path``, else the policy's weights).
    ``ref_model``: the reference (default: a frozen copy of the initial policy; none when ``kl_coef == 0``).
    ``reward_funcs``: as in TRL's GRPO (callables, sequence-classification models or their paths).
    """

    loss_is_scaled_for_ga = False  # compute_loss returns a micro-batch mean; the Trainer divides by accumulation

    def __init__(self, model, reward_funcs, args: PPOConfig | None = None, train_dataset=None, processing_class=None,
                 reward_processing_classes=None, value_model=None, ref_model=None, callbacks=None,
                 optimizers=(None, None)):
        args = args if args is not None else PPOConfig(output_dir="ppo-output")
        model, compression = switch.prepare(model, args, {})
        switch.check_prompt_column(train_dataset)
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        bad = [f for f in funcs if not (callable(f) or isinstance(f, str))]  # a Module is callable
        if not funcs or bad:  # before any model loads (TRL's GRPO refuses a run without a reward source too)
            raise ValueError(f"reward_funcs={reward_funcs!r} is invalid: PPO needs at least one reward function, each "
                             "a callable f(prompts, completions, completion_ids, **columns) -> list[float], a "
                             "sequence-classification model or its path.")
        n_funcs = len(funcs)
        if args.reward_weights is not None and len(args.reward_weights) != n_funcs:  # before any model loads
            raise ValueError(f"reward_weights={args.reward_weights} has {len(args.reward_weights)} entries for "
                             f"{n_funcs} reward functions; give one weight per function.")
        if isinstance(reward_processing_classes, (list, tuple)) and len(reward_processing_classes) != n_funcs:
            raise ValueError(f"reward_processing_classes has {len(reward_processing_classes)} entries for {n_funcs} "
                             "reward functions; give one per function (None for a callable).")
        value_from = value_source(value_model, args, model)
        field_name = "value_model" if value_model is not None else "value_model_name_or_path"
        check_value_model(model, value_from, field_name, args.trust_remote_code)  # configs only, before any load
        policy = self._causal_lm(model, args)
        critic = None if args.shared_value_head else self._value_model(value_from, policy, args,
                                                                        others=[*funcs, ref_model])
        self.ref_model = self._reference(ref_model, model, policy, args) if args.kl_coef > 0 else None
        processing_class = processing_class or AutoTokenizer.from_pretrained(
            policy.config._name_or_path, trust_remote_code=args.trust_remote_code)
        if processing_class.pad_token is None:
            processing_class.pad_token = processing_class.eos_token
        self._set_reward_funcs(reward_funcs, reward_processing_classes, args)
        # As TRL's old PPOTrainer: old_logps, values and the KL are computed in train mode, the reference and the
        # rollout engine in eval mode; dropout would make on-policy ratios != 1 and the KL to an identical ref != 0.
        for module in [policy, critic, self.ref_model, *self.reward_funcs]:
            if isinstance(module, torch.nn.Module):
                _disable_dropout(module)
        super().__init__(model=PolicyAndValue(policy, critic), args=args, data_collator=identity,
                         train_dataset=train_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        self._tokenizer = processing_class
        needed = args.rollout_batch_size * self.accelerator.num_processes
        if train_dataset is not None and hasattr(train_dataset, "__len__") and len(train_dataset) < needed:
            raise ValueError(f"train_dataset has {len(train_dataset)} prompts, fewer than one rollout: "
                             f"rollout_batch_size={args.rollout_batch_size} x {self.accelerator.num_processes} "
                             f"process(es) = {needed}; training would take 0 steps. Use a larger dataset (task_size) "
                             "or a smaller rollout_batch_size.")
        self.eos_token_ids = _eos_ids(policy, processing_class)
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._step, self._rollout, self._minibatches = 0, None, None
        self._synced_step = -1  # the global step whose weights the rollout engine holds
        self._place_frozen_models()
        self.kvroll_generation = None
        if compression is not None:
            self.kvroll_generation = KVRollGeneration(_PolicyView(self), compression)
            self.add_callback(_SyncAfterUpdate(self))

    # ---- set-up ------------------------------------------------------------------------------------------------
    @staticmethod
    def _load_kwargs(args) -> dict:
        """``from_pretrained``'s keywords: the config's ``trust_remote_code``, unless ``model_init_kwargs`` sets it."""
        return {"trust_remote_code": args.trust_remote_code, **(args.model_init_kwargs or {})}

    @staticmethod
    def _causal_lm(model, args) -> PreTrainedModel:
        if isinstance(model, str):
            return AutoModelForCausalLM.from_pretrained(model, **PPOTrainer._load_kwargs(args))
        from kvroll.rollout.sources import base_model

        if base_model(model) is not model or any(type(m).__module__.startswith("peft.") for m in model.modules()):
            raise ValueError(f"PPOTrainer: model is a PEFT model ({type(model).__name__}); kvroll's PPO does not "
                             "support PEFT yet (docs/trl_integration.md, 'Not yet (PPO)'). Pass the plain "
                             "transformers model, or use GRPOTrainer / RLOOTrainer with peft_config.")
        return model

    @staticmethod
    def _value_model(source, policy, args, others=()) -> ValueModel:
        """The value model from ``source``; a module that is the policy, a reward function or the reference is
        copied (the optimizer trains the value model: sharing would train the reward model or the reference)."""
        if isinstance(source, str):
            from transformers import AutoConfig

            kwargs = PPOTrainer._load_kwargs(args)
            config = AutoConfig.from_pretrained(source, trust_remote_code=kwargs["trust_remote_code"])
            architectures = config.architectures or []
            if (any(a.endswith("ForSequenceClassification") for a in architectures)
                    and getattr(config, "num_labels", None) == 1):  # a reward model: keep its one-output head
                return ValueModel.from_model(AutoModelForSequenceClassification.from_pretrained(
                    source, num_labels=1, **kwargs), copy_weights=False)
            return ValueModel(AutoModel.from_pretrained(source, **kwargs))
        return ValueModel.from_model(source, copy_weights=source is policy or any(source is m for m in others))

    @staticmethod
    def _reference(ref_model, model, policy, args) -> PreTrainedModel:
        ref_model = model if ref_model is None else ref_model  # default: the initial policy
        if isinstance(ref_model, str):
            ref = AutoModelForCausalLM.from_pretrained(ref_model, **PPOTrainer._load_kwargs(args))
        else:
            ref = copy.deepcopy(policy) if ref_model is policy else ref_model
        return ref.eval().requires_grad_(False)

    def _set_reward_funcs(self, reward_funcs, processing_classes, args) -> None:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        funcs = [AutoModelForSequenceClassification.from_pretrained(f, num_labels=1) if isinstance(f, str) else f
                 for f in funcs]
        tokenizers = (list(processing_classes) if isinstance(processing_classes, (list, tuple))
                      else [processing_classes] * len(funcs))
        for i, func in enumerate(funcs):
            if isinstance(func, PreTrainedModel) and tokenizers[i] is None:
                tokenizers[i] = AutoTokenizer.from_pretrained(func.config._name_or_path)
            if isinstance(func, PreTrainedModel) and tokenizers[i].pad_token_id is None:
                tokenizers[i].pad_token = tokenizers[i].eos_token
            if isinstance(func, PreTrainedModel):  # it scores the last token that is not padding
                func.config.get_text_config().pad_token_id = tokenizers[i].pad_token_id
        self.reward_funcs, self.reward_processing_classes = funcs, tokenizers
        self.reward_func_names = [reward_name(f) for f in funcs]
        self.reward_weights = torch.tensor(args.reward_weights or [1.0] * len(funcs), dtype=torch.float32)

    def _place_frozen_models(self) -> None:
        frozen = [self.ref_model] + [f for f in self.reward_funcs if isinstance(f, PreTrainedModel)]
        placed = [None if m is None else prepare_deepspeed(m, self.accelerator) if self.is_deepspeed_enabled
                  else m.to(self.accelerator.device) for m in frozen]
        self.ref_model = placed[0]
        it = iter(placed[1:])
        self.reward_funcs = [next(it) if isinstance(f, PreTrainedModel) else f for f in self.reward_funcs]

    # ---- the Trainer's loop, fed from rollouts ------------------------------------------------------------------
    @property
    def _period(self) -> int:
        """Micro-steps between two rollouts."""
        return self.args.num_ppo_epochs * self.args.steps_per_generation

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    def get_train_dataloader(self):
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self.args.rollout_batch_size, sampler_fn=self._get_train_sampler,
                                    is_training=True)

    def _get_train_sampler(self, dataset=None):
        # Each rollout's prompts come back once per micro-step of its update (the Trainer's epoch accounting).
        return RepeatSampler(data_source=dataset if dataset is not None else self.train_dataset, mini_repeat_count=1,
                             batch_size=self.args.rollout_batch_size * self.accelerator.num_processes,
                             repeat_count=self._period, shuffle=True, seed=self.args.seed)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        return loss

    def _prepare_inputs(self, rollout_batch):
        if not self.model.training:
            raise NotImplementedError("PPOTrainer does not evaluate yet; set eval_strategy='no'.")
        if self._step == 0 and self.state.global_step > 0:  # resumed: keep the rollout boundaries where they were
            self._step = self.state.global_step * self.args.gradient_accumulation_steps
        if self._step % self._period == 0 or self._rollout is None:
            self._rollout = self._make_rollout(rollout_batch)
        per_epoch = self.args.steps_per_generation
        if self._step % per_epoch == 0 or self._minibatches is None:  # a fresh shuffle every PPO epoch
            self._minibatches = _shuffled_split(self._rollout, per_epoch)
        return self._minibatches[self._step % per_epoch]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args, mask = self.args, inputs["completion_mask"]
        logits, values = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                               logits_to_keep=mask.shape[1] + 1)
        # fp32 as in _score_tokens, so that on-policy ratios are exactly 1 in bf16 runs too
        logps = selective_log_softmax(logits[:, :-1].float() / args.temperature,
                                      inputs["input_ids"][:, -mask.shape[1]:])
        pg_loss, pg_clipfrac, approxkl = policy_loss(logps, inputs["old_logps"], inputs["advantages"], mask,
                                                     args.cliprange, inputs.get("is_weights"))
        vf_loss, vf_clipfrac = value_loss(values[:, :-1].float(), inputs["old_values"], inputs["returns"], mask,
                                          args.cliprange_value)
        loss = pg_loss + args.vf_coef * vf_loss
        stats = {"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), "policy/clipfrac": pg_clipfrac,
                 "policy/approxkl": approxkl, "value/clipfrac": vf_clipfrac}
        if self.ref_model is not None and args.kl_penalty == "loss":
            kl = masked_mean(kl_estimate(logps, inputs["ref_logps"], kl_estimator_of(args)), mask)
            loss = loss + args.kl_coef * kl
            stats["loss/kl"] = kl.detach()
        self._log_means(stats)
        return loss

    # ---- rollouts ----------------------------------------------------------------------------------------------
    def _make_rollout(self, inputs: list[dict]) -> dict:
        args, device = self.args, self.accelerator.device
        prompts = [row["prompt"] for row in inputs]
        prompt_ids = tokenize_prompts(self.processing_class, prompts, args.chat_template_kwargs)
        rollout_logps = None
        if self.kvroll_generation is not None:
            if self._synced_step != self.state.global_step:  # the first rollout (or one after a resume)
                self.sync_rollout_weights()
            _, completion_ids, lps, _ = self.kvroll_generation.generate(prompts=prompt_ids, images=None,
                                                                        num_generations=1)
            rollout_logps = [[lp[0] for lp in row] for row in lps]
        else:
            completion_ids = self._hf_generate(prompt_ids)
        batch = pad_rollout(prompt_ids, completion_ids, rollout_logps, self.processing_class.pad_token_id, device)
        mask = batch["completion_mask"]
        old_logps, old_values, ref_logps = self._score_tokens(batch)
        completions = completion_texts(self.processing_class, prompts, completion_ids)
        per_func = reward_scores(self.reward_funcs, self.reward_processing_classes, inputs, prompts, completions,
                                 completion_ids, device, trainer_state=self.state)
        scores = (per_func * self.reward_weights.to(device)).nansum(dim=1)
        kl = kl_estimate(old_logps, ref_logps, kl_estimator_of(args)) * mask if ref_logps is not None else None
        rewards = token_rewards(scores, kl if args.kl_penalty == "reward" else None, mask, args.kl_coef)
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        if args.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        batch.update(old_logps=old_logps, old_values=old_values, advantages=advantages, returns=returns)
        if ref_logps is not None:
            batch["ref_logps"] = ref_logps
        if rollout_logps is not None and args.vllm_importance_sampling_correction:
            batch["is_weights"] = importance_weights(old_logps, batch["rollout_logps"], mask,
                                                     args.vllm_importance_sampling_mode,
                                                     args.vllm_importance_sampling_clip_min,
                                                     args.vllm_importance_sampling_clip_max)
            if args.kvroll_correction == "sparse_rl":  # rejected rows: weight 0 (correction.py)
                keep, stat = args_rejection(old_logps, batch["rollout_logps"], mask, args)
                batch["is_weights"] = batch["is_weights"] * keep
                record_rejection(self._metrics["train"], self.accelerator, keep, stat)
            self._log_importance(old_logps, batch["rollout_logps"], batch["is_weights"], mask)
        self._log_rollout(per_func, scores, kl, mask, completion_ids)
        return batch

    def sync_rollout_weights(self) -> None:
        """Bring the rollout engine's (or Ray workers') weights to the policy's; every rank must call it."""
        self.kvroll_generation.sync_weights()
        self._synced_step = self.state.global_step

    @torch.no_grad()
    def _score_tokens(self, batch: dict):
        """Trainer logprobs, values and reference logprobs [B, T] under the current weights, in micro-batches."""
        mask = batch["completion_mask"]
        width, step = mask.shape[1], self.args.per_device_train_batch_size
        completion = batch["input_ids"][:, -width:]
        logps, values, ref_logps = [], [], []
        for start in range(0, len(mask), step):
            ids, attention = batch["input_ids"][start:start + step], batch["attention_mask"][start:start + step]
            logits, value = self.model(input_ids=ids, attention_mask=attention, logits_to_keep=width + 1)
            logps.append(selective_log_softmax(logits[:, :-1].float() / self.args.temperature,
                                               completion[start:start + step]))
            values.append(value[:, :-1].float())
            if self.ref_model is not None:
                with self.accelerator.autocast():  # the policy's forward is autocast-wrapped by accelerate
                    ref_logits = self.ref_model(input_ids=ids, attention_mask=attention,
                                                position_ids=positions(attention), logits_to_keep=width + 1,
                                                use_cache=False).logits
                ref_logps.append(selective_log_softmax(ref_logits[:, :-1].float() / self.args.temperature,
                                                       completion[start:start + step]))
        ref = torch.cat(ref_logps) * mask if ref_logps else None
        return torch.cat(logps) * mask, torch.cat(values) * mask, ref

    @torch.no_grad()
    def _hf_generate(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """Plain ``model.generate`` rollouts (use_kvroll=False), cut after the first EOS."""
        args, pad = self.args, self.processing_class.pad_token_id
        ids, mask = left_pad(prompt_ids, pad, self.accelerator.device)
        settings = dict(max_new_tokens=args.max_completion_length, do_sample=True, temperature=args.temperature,
                        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                        repetition_penalty=args.repetition_penalty, pad_token_id=pad, eos_token_id=self.eos_token_ids)
        config = GenerationConfig(**{**settings, **(args.generation_kwargs or {})})  # the kwargs override
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped:
            out = unwrapped.policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        eos = set(self.eos_token_ids)
        return [cut_at_eos(row, eos) for row in out[:, ids.shape[1]:].tolist()]

    # ---- metrics and saving ------------------------------------------------------------------------------------
    def _log_means(self, stats: dict[str, torch.Tensor]) -> None:
        """Append the mean over ranks of each scalar (one gather for all of them)."""
        values = self.accelerator.gather(torch.stack([v.float() for v in stats.values()])[None]).mean(dim=0)
        for name, value in zip(stats, values.tolist()):
            self._metrics["train"][name].append(value)

    def _log_importance(self, trainer_logps, rollout_logps, weights, mask) -> None:
        stats = importance_stats(trainer_logps, rollout_logps, weights, mask)
        # kvroll/is_masked_fraction: the share of every rank's completion tokens (gathered counts, as GRPO's), not a
        # mean of the ranks' shares
        tokens = mask.sum().float()
        stats["kvroll/is_masked_fraction"] = stats["kvroll/is_masked_fraction"].float() * tokens
        gathered = self.accelerator.gather(torch.stack([*stats.values(), tokens])[None])  # [ranks, stats + 1]
        total = gathered[:, -1].sum()
        reduce = {"max": lambda x: x.max(), "min": lambda x: x.min(),
                  "is_masked_fraction": lambda x: x.sum() / total.clamp(min=1)}
        for (name, _), column in zip(stats.items(), gathered.T):
            self._metrics["train"][name].append(reduce.get(name.rsplit("/", 1)[-1], lambda x: x.mean())(column).item())

    def _log_rollout(self, per_func, scores, kl, mask, completion_ids) -> None:
        gather, metrics = self.accelerator.gather, self._metrics["train"]
        per_func, scores = gather(per_func), gather(scores)
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(torch.nanmean(per_func[:, i]).item())
            metrics[f"rewards/{name}/std"].append(_nanstd(per_func[:, i]).item())
        metrics["reward"].append(scores.mean().item())
        metrics["reward_std"].append(scores.std().item() if len(scores) > 1 else 0.0)
        lengths = gather(mask.sum(dim=1))
        metrics["completions/mean_length"].append(lengths.mean().item())
        metrics["completions/max_length"].append(lengths.max().item())
        eos = set(self.eos_token_ids)
        truncated = torch.tensor([float(ids[-1] not in eos) for ids in completion_ids], device=mask.device)
        metrics["completions/clipped_ratio"].append(gather(truncated).mean().item())
        if kl is not None:
            metrics["objective/kl"].append(gather(kl.sum(dim=1)).mean().item())
        metrics["objective/scores"].append(scores.mean().item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {key: sum(values) / len(values) for key, values in self._metrics[mode].items() if values}
        logs.update(metrics if mode == "train" else {f"eval_{k}": v for k, v in metrics.items()})
        super().log(logs, start_time)
        self._metrics[mode].clear()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The policy as a Hugging Face model in ``output_dir`` (loadable by ``from_pretrained`` and by kvroll),
        the value model's weights beside it in ``value_model.safetensors``."""
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        import safetensors.torch

        os.makedirs(output_dir, exist_ok=True)
        wrapper = self.accelerator.unwrap_model(self.model)
        state = state_dict if state_dict is not None else wrapper.state_dict()
        policy = {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
        value = {k: v.contiguous() for k, v in state.items() if not k.startswith("policy.")}
        wrapper.policy.save_pretrained(output_dir, state_dict=policy)
        safetensors.torch.save_file(value, os.path.join(output_dir, VALUE_WEIGHTS), metadata={"format": "pt"})
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Resume (without DeepSpeed, which loads its own checkpoint): the policy from the checkpoint's Hugging Face
        weights, the value model from ``value_model.safetensors``; every parameter must be found."""
        from safetensors.torch import load_file

        wrapper = self.accelerator.unwrap_model(model if model is not None else self.model)
        folder = Path(resume_from_checkpoint)
        policy_state = {k: v for f in sorted(folder.glob("model*.safetensors")) for k, v in load_file(f).items()}
        value_state = load_file(folder / VALUE_WEIGHTS)
        missing = set(wrapper.policy.load_state_dict(policy_state, strict=False).missing_keys)
        missing |= {k for k in wrapper.load_state_dict(value_state, strict=False).missing_keys
                    if not k.startswith("policy.")}
        params = dict(wrapper.policy.named_parameters(remove_duplicate=False))
        loaded = {params[k].data_ptr() for k in policy_state if k in params}
        missing = sorted(k for k in missing if k not in params or params[k].data_ptr() not in loaded)  # tied: fine
        if missing:
            raise ValueError(f"checkpoint {resume_from_checkpoint!r} lacks {missing[:5]}; is it a PPOTrainer "
                             "checkpoint of this model?")


class _PolicyView:
    """The trainer as kvroll's rollout adapter reads it, with ``model`` the policy alone (not policy + value)."""

    def __init__(self, trainer: PPOTrainer):
        self._trainer = trainer

    @property
    def model(self):
        return self._trainer.accelerator.unwrap_model(self._trainer.model).policy

    def __getattr__(self, name):
        return getattr(self._trainer, name)


class _SyncAfterUpdate(TrainerCallback):
    """Brings the engine's weights to the policy's once a rollout's last optimizer step is done (every rank)."""

    def __init__(self, trainer: PPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if self.trainer._step % self.trainer._period == 0:
            self.trainer.sync_rollout_weights()


def _shuffled_split(rollout: dict, parts: int) -> list[dict]:
    rows = len(rollout["completion_mask"])
    order = torch.randperm(rows, device=rollout["completion_mask"].device)
    chunks = order.chunk(parts)
    return [{k: v[idx] if torch.is_tensor(v) else v for k, v in rollout.items()} for idx in chunks]


def _eos_ids(model, tokenizer) -> list[int]:
    """TRL GRPO's EOS ids: the generation config's, with the tokenizer's first."""
    ids = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return ids if tokenizer.eos_token_id in ids else [tokenizer.eos_token_id, *ids]


def _disable_dropout(model: torch.nn.Module) -> None:
    """nn.Dropout modules (TRL's disable_dropout_in_model) and the float ``attention_dropout`` of HF attentions (the
    modules' attribute, which their forward reads; not the config, which the saved model would carry)."""
    disable_dropout_in_model(model)
    for module in model.modules():
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def _nanstd(x: torch.Tensor) -> torch.Tensor:
    x = x[~torch.isnan(x)]
    return x.std() if x.numel() > 1 else x.new_zeros(())
