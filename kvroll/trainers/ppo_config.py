"""``PPOConfig``: transformers' ``TrainingArguments`` + kvroll's switch + PPO's fields, in TRL's conventions.

    args = PPOConfig(output_dir="out", use_kvroll=True, kvroll_policy="rkv", kvroll_budget=1024,
                     per_device_train_batch_size=4, gradient_accumulation_steps=2, rollout_batch_size=16,
                     num_ppo_epochs=2, gamma=1.0, lam=0.95)

Batches, per device: ``rollout_batch_size`` prompts are rolled out at once (one completion each); each PPO epoch
goes over them in minibatches of ``per_device_train_batch_size * gradient_accumulation_steps`` rows, one optimizer
step per minibatch, so a rollout feeds ``num_ppo_epochs * rollout_batch_size / minibatch`` optimizer steps
(``max_steps`` counts optimizer steps, as in TRL's GRPO). Field names follow TRL's old ``PPOConfig`` (``cliprange``,
``vf_coef``, ``kl_coef``, ``lam`` ...) and GRPO's importance-sampling fields (``vllm_importance_sampling_*``, which
apply to kvroll's rollouts as they do in kvroll's GRPO).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from kvroll.checks import as_int
from kvroll.rollout.model import EMBEDDED
from kvroll.rollout.sampling import MIN_TEMPERATURE, finite_number
from kvroll.trainers.args import (KVRollArguments, _as_dict, positive, sampling_refusal, sampling_temperature,
                                  validate_kvroll_args)
from kvroll.trainers.ppo_math import IS_MODES, KL_ESTIMATORS

KL_PENALTIES = ("reward", "loss")


def _help(text: str, **kwargs) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass
class PPOConfig(KVRollArguments, TrainingArguments):
    """Actor-critic PPO for language models; every field is a flat YAML key and a ``--flag`` (see module doc)."""

    _VALID_DICT_FIELDS = TrainingArguments._VALID_DICT_FIELDS + ["model_init_kwargs", "generation_kwargs",
                                                                 "chat_template_kwargs"]

    # Defaults that differ from TrainingArguments' (TRL's old PPO used these).
    learning_rate: float = _help("Initial learning rate (AdamW), for the policy and the value model.", default=3e-6)
    logging_steps: float = _help("Log every X optimizer steps (a float < 1: a ratio of the total).", default=10)
    remove_unused_columns: bool = _help("Keep False: dataset columns besides 'prompt' go to the reward functions.",
                                        default=False)

    # Models
    model_init_kwargs: dict | str | None = _help(
        "Keyword arguments for `from_pretrained` when the policy (and value / reference models) are given as "
        "paths.", default=None)
    trust_remote_code: bool = _help("Allow model code shipped in a model's directory (as TRL's configs).",
                                    default=False)
    value_model_name_or_path: str | None = _help(
        "Model the value model's backbone is initialised from (a local directory or 'smollm2'); default: the "
        "policy's own weights. Its hidden size and vocabulary must match the policy's.", default=None)
    shared_value_head: bool = _help(
        "Put the value head on the policy's last hidden state (one backbone for both, about half the memory) "
        "instead of a separate value model.", default=False)

    # Rollouts
    rollout_batch_size: int | None = _help(
        "Prompts rolled out at once per device (one completion each). Must be a multiple of the minibatch, "
        "per_device_train_batch_size * gradient_accumulation_steps, which is also the default.", default=None)
    max_completion_length: int = _help("Maximum tokens generated per completion.", default=256)
    temperature: float = _help("Sampling temperature (also divides the logits the losses use).", default=1.0)
    top_p: float = _help("Nucleus sampling: cumulative probability kept, in (0, 1].", default=1.0)
    top_k: int = _help("Top-k sampling; 0 disables it.", default=0)
    min_p: float | None = _help("Minimum token probability relative to the most likely token.", default=None)
    repetition_penalty: float = _help("Penalty for tokens already in the prompt or completion (1.0: none).",
                                      default=1.0)
    generation_kwargs: dict | str | None = _help(
        "Extra sampling settings (a dict, or JSON on the command line), overriding the fields above.", default=None)
    chat_template_kwargs: dict | str | None = _help("Extra keyword arguments for `apply_chat_template`.",
                                                    default=None)
    reward_weights: list[float] | None = _help(
        "Weight of each reward function in the score (default: all 1).", default=None)

    # PPO
    num_ppo_epochs: int = _help("Passes over each rollout batch.", default=4)
    gamma: float = _help("GAE discount factor, in [0, 1].", default=1.0)
    lam: float = _help("GAE lambda, in [0, 1].", default=0.95)
    cliprange: float = _help("Clip range of the policy ratio (> 0).", default=0.2)
    cliprange_value: float = _help("Clip range of the value prediction around the rollout's value (> 0).",
                                   default=0.2)
    vf_coef: float = _help("Weight of the value loss in the total loss.", default=0.1)
    kl_coef: float = _help("Weight of the KL penalty to the frozen reference model; 0 skips the reference model.",
                           default=0.05)
    kl_estimator: str | None = _help(
        "KL estimator: 'k1' (log-ratio, unbiased) or 'k3' (lower variance, >= 0). Default: 'k1' with "
        "kl_penalty='reward' (TRL's old PPO), 'k3' with kl_penalty='loss' (verl's low_var_kl); k1 in the loss has a "
        "zero expected gradient and is refused.", default=None)
    kl_penalty: str = _help(
        "Where the KL penalty goes: 'reward' (-kl_coef * KL on each token's reward, as TRL's old PPO and "
        "OpenRLHF) or 'loss' (kl_coef * mean KL added to the policy loss, verl's use_kl_loss).", default="reward")
    whiten_rewards: bool = _help("Whiten the per-token rewards over the rollout batch (the mean kept).",
                                 default=False)
    whiten_advantages: bool = _help("Whiten the advantages over the rollout batch.", default=True)

    # Rollout/trainer mismatch (kvroll rollouts only): the names and defaults of TRL GRPO's fields.
    vllm_importance_sampling_correction: bool = _help(
        "Weight each token's policy loss by the rollout/trainer importance ratio exp(logp_trainer - logp_rollout) "
        "(kvroll's compressed-KV rollouts are slightly off-policy).", default=True)
    vllm_importance_sampling_mode: str = _help(
        "token_truncate | token_mask | sequence_truncate | sequence_mask: per token or per sequence; clamp the ratio "
        "to [clip_min, clip_max] or zero it outside.", default="sequence_mask")
    vllm_importance_sampling_clip_max: float | None = _help("Upper bound C_max of the importance ratio.",
                                                            default=3.0)
    vllm_importance_sampling_clip_min: float | None = _help("Lower bound C_min of the importance ratio.",
                                                            default=None)

    def __post_init__(self):
        self._check_generation_kwargs()
        validate_kvroll_args(self)  # before anything loads
        if isinstance(self.generation_kwargs, str):  # use_kvroll=False: validate_kvroll_args left it a string
            self.generation_kwargs = _as_dict("generation_kwargs", self.generation_kwargs)
        if not self.use_kvroll:
            self._check_hf_generation()
        self._check_ppo_fields()
        super().__post_init__()
        # kvroll's adapter sizes its engine as per_device_train_batch_size * steps_per_generation (GRPO's meaning:
        # micro-batches per generation).
        self.steps_per_generation = self.rollout_batch_size // self.per_device_train_batch_size

    def _check_generation_kwargs(self) -> None:
        """PPO's losses and importance weights use the ``temperature`` field and the rollouts
        ``max_completion_length``: ``generation_kwargs`` may restate them, not change them. Checked before
        ``validate_kvroll_args`` so that this, PPO's reason, is the one given."""
        fields = {"temperature": self.temperature, "do_sample": True, "max_new_tokens": self.max_completion_length,
                  "max_tokens": self.max_completion_length}  # restating the fields (TRL configs often do) is harmless

        def differs(key, value):
            want = fields[key]
            return value is not want if isinstance(want, bool) or isinstance(value, bool) else value != want

        kwargs = _as_dict("generation_kwargs", self.generation_kwargs)
        overridden = sorted(key for key, value in kwargs.items() if key in fields and differs(key, value))
        if overridden:
            raise ValueError(f"generation_kwargs keys {overridden} are not allowed in PPO: the losses and the "
                             "importance weights use the `temperature` field and the rollouts `max_completion_length`;"
                             " set those fields instead.")

    def _check_hf_generation(self) -> None:
        """use_kvroll=False: the rollouts are HF's ``generate`` with a GenerationConfig of the sampling fields and
        ``generation_kwargs``. Keys only kvroll's sampler reads are refused (the GenerationConfig would ignore
        them), and the sampling values are checked as kvroll checks them, before any model loads (HF's generate
        checked them only once the models had loaded)."""
        kwargs = self.generation_kwargs or {}
        kvroll_only = sorted(key for key in kwargs if key in ("stop_token_ids", "ignore_eos", "seed"))
        if kvroll_only:
            raise ValueError(f"generation_kwargs keys {kvroll_only} are read by kvroll's sampler only; with "
                             "use_kvroll=False the rollouts are HF's generate, whose GenerationConfig would ignore "
                             "them. Use HF's keys (e.g. eos_token_id for stop ids), or set use_kvroll=True.")
        for name in ("top_p", "top_k", "min_p", "repetition_penalty"):  # temperature: PPO's own check (> 0)
            source = f"generation_kwargs['{name}']" if name in kwargs else name
            value = kwargs.get(name, getattr(self, name))
            reason = None if value is None else sampling_refusal(name, value)  # None: HF's default
            if reason is not None:
                raise ValueError(f"{source}={value!r} is invalid: {reason}")

    def _check_ppo_fields(self) -> None:
        number = finite_number
        for name in ("whiten_rewards", "whiten_advantages", "shared_value_head"):  # "no" would read as True
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use true or false.")
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not (number(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"{name}={value!r} is invalid: it must lie in [0, 1] (TRL's defaults: gamma=1.0, "
                                 "lam=0.95).")
        for name in ("cliprange", "cliprange_value"):
            value = getattr(self, name)
            if not (number(value) and value > 0):
                raise ValueError(f"{name}={value!r} is invalid: a clip range must be a finite number > 0 (e.g. 0.2).")
        for name in ("vf_coef", "kl_coef"):
            if not (number(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use a finite weight >= 0.")
        weights = self.reward_weights
        if weights is not None and not (isinstance(weights, (list, tuple)) and weights
                                        and all(number(w) for w in weights)):
            raise ValueError(f"reward_weights={weights!r} is invalid: use a list of finite numbers, one per reward "
                             "function (or leave it unset: 1 each).")
        if str(getattr(self.eval_strategy, "value", self.eval_strategy)) != "no":
            raise ValueError(f"eval_strategy={self.eval_strategy!r} is invalid for PPO: kvroll's PPOTrainer has no "
                             "evaluation loop (no eval_dataset); leave eval_strategy 'no'.")
        if not (as_int(self.num_ppo_epochs) is not None and self.num_ppo_epochs >= 1):
            raise ValueError(f"num_ppo_epochs={self.num_ppo_epochs!r} is invalid: use an integer >= 1.")
        self.num_ppo_epochs = as_int(self.num_ppo_epochs)
        self._check_choice("kl_penalty", KL_PENALTIES)
        if self.kl_estimator is not None:  # None: kl_estimator_of's default, resolved where it is used
            self._check_choice("kl_estimator", KL_ESTIMATORS)
        if self.kl_penalty == "loss" and self.kl_estimator == "k1" and self.kl_coef > 0:
            raise ValueError("kl_penalty='loss' with kl_estimator='k1' is invalid: the gradient of the mean of "
                             "log(pi/ref) over tokens sampled from pi is 0 in expectation, so the KL term would not "
                             "regularise anything. Use kl_estimator='k3' (verl's low_var_kl) or kl_penalty='reward'.")
        self._check_choice("vllm_importance_sampling_mode", IS_MODES)
        if self.shared_value_head and self.value_model_name_or_path is not None:
            raise ValueError(f"shared_value_head=True and value_model_name_or_path="
                             f"{self.value_model_name_or_path!r} are exclusive: a shared head sits on the policy. "
                             "Drop one of them.")
        value = self.value_model_name_or_path
        if value is not None and value != EMBEDDED and not (isinstance(value, str) and value.strip()
                                                             and Path(value).is_dir()):  # Path("") is "."
            raise ValueError(f"value_model_name_or_path={value!r} is not a directory: pass a local Hugging Face "
                             "model directory or 'smollm2' (no model hub is reachable), or leave it unset to start "
                             "the value model from the policy.")
        temperature = self.temperature
        if not sampling_temperature(temperature):
            raise ValueError(f"temperature={temperature!r} is invalid for PPO: use a finite sampling temperature "
                             f">= {MIN_TEMPERATURE} (e.g. 1.0); the losses divide the logits by it, and greedy "
                             "rollouts have no policy gradient.")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        for name, bound in (("vllm_importance_sampling_clip_min", low), ("vllm_importance_sampling_clip_max", high)):
            if bound is not None and not (number(bound) and bound >= 0):
                raise ValueError(f"{name}={bound!r} is invalid: an importance-ratio bound is a finite number >= 0 "
                                 "or null.")
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min={low} must be < vllm_importance_sampling_clip_max="
                             f"{high} (as TRL's GRPOConfig requires); otherwise every weight is clamped or zeroed.")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("truncate")
                and low is None and high is None):
            raise ValueError(f"vllm_importance_sampling_mode={self.vllm_importance_sampling_mode!r} needs "
                             "vllm_importance_sampling_clip_max (e.g. 3.0) or vllm_importance_sampling_clip_min; "
                             "both are null.")
        length = self.max_completion_length  # both rollout paths generate max_new_tokens=max_completion_length
        if not positive(length, True):
            raise ValueError(f"max_completion_length={length!r} is invalid: use an integer >= 1, the tokens "
                             "generated per completion (e.g. 256).")
        self._check_batches()

    def _check_batches(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not (as_int(value) is not None and value >= 1):
                raise ValueError(f"{name}={value!r} is invalid: use an integer >= 1.")
            setattr(self, name, as_int(value))
        minibatch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if self.rollout_batch_size is None:
            self.rollout_batch_size = minibatch
        if not (as_int(self.rollout_batch_size) is not None and self.rollout_batch_size >= 1):
            raise ValueError(f"rollout_batch_size={self.rollout_batch_size!r} is invalid: use an integer >= 1.")
        self.rollout_batch_size = as_int(self.rollout_batch_size)
        if self.rollout_batch_size % minibatch:
            raise ValueError(
                f"rollout_batch_size={self.rollout_batch_size} is not a multiple of the minibatch, "
                f"per_device_train_batch_size * gradient_accumulation_steps = {self.per_device_train_batch_size} * "
                f"{self.gradient_accumulation_steps} = {minibatch}: set rollout_batch_size to a multiple of "
                f"{minibatch} (e.g. {minibatch * max(1, round(self.rollout_batch_size / minibatch))}) or change "
                "the minibatch.")

    def _check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        if getattr(self, name) not in choices:
            raise ValueError(f"{name}={getattr(self, name)!r} is invalid; choose one of {list(choices)}.")


def kl_estimator_of(args) -> str:
    """The KL estimator a PPOConfig uses: its ``kl_estimator``, else k1 in the reward (TRL's old PPO) and k3 in the
    loss (verl's low_var_kl). Resolved at use, so that a config copied with another ``kl_penalty`` follows it."""
    return args.kl_estimator or ("k3" if args.kl_penalty == "loss" else "k1")
