"""A 2-step PPO run with ``use_kvroll=True`` under DeepSpeed ZeRO-3, one process (world size 1).

    python tests/trainers/ppo_zero3_worker.py OUT_DIR [--device cuda|cpu]    # run by test_ppo.py (gpu)

Policy, value model and reference are partitioned (persistence threshold 0, so every parameter is gathered on use);
after each update the colocated engine's weights must equal the policy's gathered weights (sha256). Prints
``PPO ZERO3 OK`` and the losses when every check passed; raises otherwise.
"""
from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_common import build_trainer, run_worker, trainer_args  # noqa: E402  (sets the environment)


def main(out_dir: str, device: str) -> dict:
    from transformers import TrainerCallback

    from kvroll.trainers import PPOConfig, PPOTrainer
    from kvroll.trainers.colocate import weights_checksum

    args = PPOConfig(**trainer_args(out_dir, device), per_device_train_batch_size=4, rollout_batch_size=4,
                     num_ppo_epochs=1, max_completion_length=10)
    trainer = build_trainer(PPOTrainer, args)
    sums = []

    class Check(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            policy = trainer.accelerator.unwrap_model(trainer.model).policy
            sums.append((weights_checksum(policy), weights_checksum(trainer.kvroll_generation.weights.engine_model)))

    trainer.add_callback(Check())
    trainer.train()
    assert trainer.is_deepspeed_enabled and trainer.kvroll_generation.weights.zero3, "ZeRO-3 is not on"
    assert all(hasattr(p, "ds_id") for p in trainer.model.parameters()), "a parameter is not partitioned"
    assert len(sums) == 2 and all(ours == engine for ours, engine in sums), "engine weights differ after an update"
    assert sums[0][0] != sums[1][0], "the second update did not change the policy"
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses), losses
    report = {"device": device, "losses": losses, "sync": trainer.kvroll_generation.last_sync}
    print("PPO ZERO3 OK " + json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    run_worker(main, __doc__)
