"""``RLOOConfig`` / ``RLOOTrainer``: TRL's, plus the ``use_kvroll`` switch.

    from kvroll.trainers import RLOOConfig, RLOOTrainer
    args = RLOOConfig(output_dir="out", use_kvroll=True, kvroll_policy="longflow", kvroll_budget=1024)
    trainer = RLOOTrainer(model="smollm2", reward_funcs=reward, args=args, train_dataset=dataset)

TRL 1.16's RLOO discards rollout logprobs on its vLLM path and has no importance-sampling correction, so kvroll's
rollouts feed it exactly as vLLM's do (``vllm_importance_sampling_*`` fields do not exist on ``RLOOConfig``).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvroll.trainers._trl import check_trl_version

check_trl_version()  # before importing TRL's trainers: kvroll relies on their private surfaces

import trl  # noqa: E402

from kvroll.trainers import switch  # noqa: E402
from kvroll.trainers.args import KVRollArguments, validate_kvroll_args  # noqa: E402


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
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        self.kvroll_generation = switch.attach(self, compression) if compression is not None else None
