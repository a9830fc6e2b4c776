"""``GRPOConfig`` / ``GRPOTrainer``: TRL's, plus the ``use_kvroll`` switch.

    from kvroll.trainers import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir="out", use_kvroll=True, kvroll_policy="rkv", kvroll_budget=1024)
    trainer = GRPOTrainer(model="smollm2", reward_funcs=reward, args=args, train_dataset=dataset)
    trainer.train()

With ``use_kvroll=False`` (the default) both classes behave exactly as TRL's. ``kvroll_correction="sparse_rl"``
(with ``vllm_importance_sampling_mode="token_truncate"``) zeroes the importance ratio of the rollouts whose
rollout/trainer logprobs disagree beyond ``kvroll_rejection_threshold`` (``kvroll/trainers/correction.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvroll.trainers._trl import check_trl_version

check_trl_version()  # before importing TRL's trainers: kvroll relies on their private surfaces

import trl  # noqa: E402

from kvroll.trainers import switch  # noqa: E402
from kvroll.trainers.args import KVRollArguments, validate_kvroll_args  # noqa: E402
from kvroll.trainers.correction import args_rejection, record_rejection  # noqa: E402


@dataclass
class GRPOConfig(KVRollArguments, trl.GRPOConfig):
    """TRL's ``GRPOConfig`` with kvroll's fields (``use_kvroll``, ``kvroll_policy``, ``kvroll_budget``, ...)."""

    def __post_init__(self):
        validate_kvroll_args(self)  # before TRL's set-up, and long before any model loads
        super().__post_init__()


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's ``GRPOTrainer``; with ``args.use_kvroll`` its rollouts come from kvroll's compressed-KV engine."""

    def __init__(self, model, reward_funcs=None, args=None, *rest, **kwargs):  # TRL 1.16: reward_funcs optional
        model, compression = switch.prepare(model, args, kwargs)
        if compression is not None and kwargs.get("environment_factory") is None:  # an environment may own prompts
            switch.check_prompt_column(rest[0] if rest else kwargs.get("train_dataset"))
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.kvroll_generation = switch.attach(self, compression) if compression is not None else None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.kvroll_generation is not None and "importance_sampling_ratio" in output:
            if self.args.kvroll_correction == "sparse_rl":
                self._reject_mismatched(output)
            self._log_masked_fraction(output)
        return output

    def _reject_mismatched(self, output) -> None:
        """Sparse-RL's rejection: the rejected rows' (token_truncate) IS ratios become 0, so the loss drops them."""
        mask = output["completion_mask"] * output.get("tool_mask", 1)
        keep, stat = args_rejection(output["old_per_token_logps"], output["sampling_per_token_logps"], mask,
                                    self.args)
        output["importance_sampling_ratio"] = output["importance_sampling_ratio"] * keep
        mode = "train" if self.model.training else "eval"
        record_rejection(self._metrics[mode], self.accelerator, keep, stat)

    def _log_masked_fraction(self, output) -> None:
        """Share of every rank's loss tokens (completion tokens less tool results, as TRL's IS metrics count them)
        whose IS ratio is 0: zeroed by the *_mask modes or by the rejection (TRL logs min/mean/max only)."""
        ratio = output["importance_sampling_ratio"]
        mask = (output["completion_mask"] * output.get("tool_mask", 1)).bool()
        masked = (ratio == 0).expand_as(mask)[mask]
        counts = torch.stack([masked.sum(), torch.tensor(masked.numel(), device=mask.device)]).double()
        zeroed, tokens = self.accelerator.gather(counts[None]).sum(dim=0)  # token counts, not per-rank means
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["kvroll/is_masked_fraction"].append((zeroed / tokens.clamp(min=1)).item())
