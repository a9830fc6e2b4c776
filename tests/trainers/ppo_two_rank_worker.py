"""Run by test_ppo.py under ``torch.distributed.run --nproc_per_node 2`` (gloo, CPU): a 2-step PPO run with the
kvroll switch. Each rank rolls out its own prompts; after training both ranks hold the same policy and value
weights (DDP), and each engine holds its rank's policy. Prints ``PPO RANK <r> OK`` when every check passed."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_exit import exit_rank  # noqa: E402
from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402

from kvroll.trainers import PPOConfig, PPOTrainer  # noqa: E402
from kvroll.trainers.colocate import weights_checksum  # noqa: E402


def main(out_dir: str) -> None:
    tok = tokenizer()
    args = PPOConfig(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                     per_device_train_batch_size=2, rollout_batch_size=2, num_ppo_epochs=1, max_completion_length=8,
                     max_steps=2, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
                     seed=0, learning_rate=1e-2)
    trainer = PPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args, train_dataset=chat_dataset(),
                         processing_class=tok)
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    assert world == 2 and dist.get_backend() == "gloo", (world, dist.get_backend())
    generation, calls = trainer.kvroll_generation, []
    real_generate = generation.generate

    def recording_generate(prompts, images=None, num_generations=1, profiler=None):
        calls.append([list(p) for p in prompts])
        return real_generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)

    generation.generate = recording_generate
    trainer.train()
    assert len(calls) == 2 and all(len(rows) == 2 for rows in calls), calls
    everyone = [None, None]
    dist.all_gather_object(everyone, (calls, weights_checksum(trainer.model)))
    assert everyone[0][0] != everyone[1][0], "both ranks rolled out the same prompts"
    assert everyone[0][1] == everyone[1][1], "the ranks' policy + value weights differ after training"
    assert weights_checksum(generation.weights.engine_model) == weights_checksum(trainer.model.policy)
    losses = [h["loss/value"] for h in trainer.state.log_history if "loss/value" in h]
    assert len(losses) == 2, trainer.state.log_history
    print(f"PPO RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])  # any failed check raises here, before the exit
    exit_rank()  # tear gloo down, then skip the interpreter's teardown (rank_exit.py)
