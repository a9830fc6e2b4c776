"""``RLOOConfig`` / ``RLOOTrainer``: TRL's, plus the ``use_kvroll`` switch.

    from kvroll.trainers import RLOOConfig, RLOOTrainer
    args = RLOOConfig(output_dir="out", use_kvroll=True, kvroll_policy="longflow", kvroll_budget=1024)
    trainer = RLOOTrainer(model="smollm2", reward_funcs=reward, args=args, train_dataset=dataset)

TRL 1.16's RLOO discards rollout logprobs on its vLLM path and has no importance-sampling correction, so kvroll's
rollouts feed it exactly as vLLM's do (``vllm_importance_sampling_*`` fields do not exist on ``RLOOConfig``).
``kvroll_correction="sparse_rl"`` adds Sparse-RL's rejection alone (RLOO's loss is per sequence, so there is no
per-token reweighting to add): a rollout whose rollout/trainer logprobs disagree beyond
``kvroll_rejection_threshold`` gets advantage 0, which zeroes its loss (``kvroll/trainers/correction.py``).
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

_PENDING = object()  # the next _get_per_token_logps_and_entropies result is the trainer's old logprobs


@dataclass
class RLOOConfig(KVRollArguments, trl.RLOOConfig):
    """TRL's ``RLOOConfig`` with kvroll's fields (``use_kvroll``, ``kvroll_policy``, ``kvroll_budget``, ...)."""

    def __post_init__(self):
        validate_kvroll_args(self)
        super().__post_init__()


class RLOOTrainer(trl.RLOOTrainer):
    """TRL's ``RLOOTrainer``; with ``args.use_kvroll`` its rollouts come from kvroll's compressed-KV engine."""

    def __init__(self, model, reward_funcs, args=None, *rest, **kwargs):
        model, compression = switch.prepare(model, args, kwargs)
        if compression is not None:  # switch off: TRL's behaviour, unchanged
            switch.check_prompt_column(rest[0] if rest else kwargs.get("train_dataset"))
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.kvroll_generation = switch.attach(self, compression) if compression is not None else None

    def _generate_and_score_completions(self, inputs):
        correcting = self.kvroll_generation is not None and self.args.kvroll_correction == "sparse_rl"
        self._kvroll_old_logps = _PENDING if correcting else None
        output = super()._generate_and_score_completions(inputs)
        if correcting:
            self._reject_mismatched(output, self._kvroll_old_logps)
        self._kvroll_old_logps = None
        return output

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if getattr(self, "_kvroll_old_logps", None) is _PENDING:  # TRL's first call there scores the rollout
            self._kvroll_old_logps = result[0]
        return result

    def _reject_mismatched(self, output, old_logps) -> None:
        """Sparse-RL's rejection: a rejected row's advantage becomes 0, so its (per-sequence) loss is 0."""
        mask = output["completion_mask"]
        if old_logps is _PENDING or not torch.allclose((old_logps * mask).sum(1), output["old_logps"], atol=1e-4):
            raise RuntimeError("kvroll_correction: RLOOTrainer no longer scores the rollout with its first "
                               "_get_per_token_logps_and_entropies call; this TRL version is not supported.")
        rollout = torch.full_like(old_logps, torch.nan)
        for i, row in enumerate(self.kvroll_generation.last_logprobs):
            rollout[i, :len(row)] = torch.tensor([lp[0] for lp in row], dtype=rollout.dtype)
        keep, stat = args_rejection(old_logps, rollout, mask, self.args)
        output["advantages"] = output["advantages"] * keep[:, 0].to(output["advantages"].dtype)
        mode = "train" if self.model.training else "eval"
        record_rejection(self._metrics[mode], self.accelerator, keep, stat)
