"""A 2-step PPO run with ``use_kvroll=True`` under DeepSpeed ZeRO-3, one process (world size 1).

    python tests/trainers/ppo_zero3_worker.py OUT_DIR [--device cuda|cpu]    # run by test_ppo.py (gpu)

Policy, value model and reference are partitioned (persistence threshold 0, so every parameter is gathered on use);
after each update the colocated engine's weights must equal the policy's gathered weights (sha256). Prints
``PPO ZERO3 OK`` and the losses when every check passed; raises otherwise.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero3_worker  # noqa: E402,F401  (sets the single-process distributed environment)
from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402


def main(out_dir: str, device: str) -> dict:
    from transformers import TrainerCallback

    from kvroll.trainers import PPOConfig, PPOTrainer
    from kvroll.trainers.colocate import weights_checksum

    on_gpu = device == "cuda"
    tok = tokenizer()
    args = PPOConfig(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                     per_device_train_batch_size=4, rollout_batch_size=4, num_ppo_epochs=1, max_completion_length=10,
                     max_steps=2, logging_steps=1, report_to="none", save_strategy="no", seed=0, learning_rate=1e-2,
                     use_cpu=not on_gpu, bf16=on_gpu, deepspeed=zero3_worker.zero3_config())
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    opts = parser.parse_args()
    os.makedirs(opts.out_dir, exist_ok=True)
    main(opts.out_dir, opts.device)
