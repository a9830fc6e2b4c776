"""Run by test_two_ranks.py under ``torch.distributed.run --nproc_per_node 2`` (gloo, CPU).

A 2-step GRPO run with the kvroll switch where one prompt group straddles the two ranks, then a routing check
with a deterministic stand-in engine. Prints ``RANK <r> OK`` when every check passed on that rank.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_exit import exit_rank  # noqa: E402
from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402

from kvroll.rollout.engine import Completion  # noqa: E402
from kvroll.trainers import GRPOConfig, GRPOTrainer  # noqa: E402
from kvroll.trainers.colocate import weights_checksum  # noqa: E402


class StandIn:
    """Deterministic engine: token ids encode (prompt, sample); counts prefills (one per prompt)."""

    def __init__(self):
        self.prefills = 0

    def generate(self, prompts, sampling, n=1):
        self.prefills += len(prompts)
        return [Completion(p, s, prompts[p], [1000 + sum(prompts[p]) % 1000, s], [-0.5, -0.25])
                for p in range(len(prompts)) for s in range(n)]

    def kv_cache_bytes(self):
        return 0


def total(value: int) -> int:
    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return int(tensor.item())


def main(out_dir: str) -> None:
    tok = tokenizer()
    args = GRPOConfig(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                      per_device_train_batch_size=6, num_generations=4, max_completion_length=8, max_steps=2,
                      logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no", seed=0,
                      learning_rate=1e-2)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
    assert world == 2 and dist.get_backend() == "gloo", (world, dist.get_backend())
    generation, calls = trainer.kvroll_generation, []
    real_generate = generation.generate

    def recording_generate(prompts, images=None, num_generations=1, profiler=None):
        out = real_generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        calls.append((list(map(list, prompts)), out))
        return out

    generation.generate = recording_generate
    trainer.train()
    assert len(calls) == 2
    for rows, (prompt_ids, completion_ids, logprobs, _) in calls:
        assert len(rows) == 6 and prompt_ids == rows and len(completion_ids) == len(logprobs) == 6
        assert all(1 <= len(ids) <= 8 and len(ids) == len(lp) for ids, lp in zip(completion_ids, logprobs))
    # 12 rows a call = 3 groups of 4; each group prefilled once across both ranks.
    assert total(generation.engine.stats["prefills"]) == 2 * 3, generation.engine.stats
    assert weights_checksum(generation.weights.engine_model) == weights_checksum(trainer.model)

    # Routing: rank 0 holds A A A A B B, rank 1 holds B B C C C C; group B straddles the ranks.
    a, b, c = [11, 12], [21, 22, 23], [31]
    mine = [a] * 4 + [b] * 2 if rank == 0 else [b] * 2 + [c] * 4
    generation.engine = StandIn()
    generation.calls = 0
    prompt_ids, completion_ids, logprobs, _ = generation.generate(prompts=mine, images=None, num_generations=4)
    code = {tuple(p): 1000 + sum(p) % 1000 for p in (a, b, c)}
    samples = [0, 1, 2, 3, 0, 1] if rank == 0 else [2, 3, 0, 1, 2, 3]
    assert prompt_ids == mine
    assert completion_ids == [[code[tuple(p)], s] for p, s in zip(mine, samples)], completion_ids
    assert logprobs == [[[-0.5], [-0.25]]] * 6
    assert total(generation.engine.prefills) == 3  # A, B, C once each, B on one rank only
    print(f"RANK {rank} OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])  # any failed check raises here, before the exit
    exit_rank()  # tear gloo down, then skip the interpreter's teardown (rank_exit.py)
