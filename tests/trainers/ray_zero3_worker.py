"""Run by test_ray_mode.py under ``torch.distributed.run --nproc_per_node 2`` (gloo, CPU): GRPO with
``kvroll_mode='ray'`` under DeepSpeed ZeRO-3 on two ranks, one CPU Ray worker.

Every rank takes part in each bucket's gather and rank 0 alone sends, gathering bucket k+1 while bucket k is on
the wire (``send_buckets``). Before each generation (after TRL's sync) and after a last sync, the worker's
per-bucket checksums equal the trainer's gathered weights packed the same way. Then, with every rank syncing: a
bucket damaged on the worker is detected and resent alone (the other rank gathers just that one); and (without
``--lora``) a worker killed before a sync is replaced and the sync repeated from the start. Whether rank 0 learns
of the death before its first gather or from a broadcast that times out mid-attempt (gloo waits
``kvroll_worker_timeout_s``), the other rank must not be left inside a gather rank 0 never enters. With ``--lora``
the trainer has a LoRA ``peft_config``: the gathers include A and B, the worker gets the merged weights under base
names, and the plan's merged view equals TRL's gathered ``merge_adapter`` read-out on every rank. Prints
``RANK <r> OK`` when every check passed on that rank.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rank_exit import exit_rank  # noqa: E402
from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402
from zero3_common import zero3_config  # noqa: E402

from kvroll.rollout.weights import BucketPlan  # noqa: E402
from kvroll.trainers import GRPOConfig, GRPOTrainer  # noqa: E402


def main(out_dir: str, lora: bool) -> None:
    tok = tokenizer()
    args = GRPOConfig(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                      kvroll_mode="ray", kvroll_num_workers=1, kvroll_gpus_per_worker=0, kvroll_sync_bucket_mb=1,
                      kvroll_worker_timeout_s=30, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=2, logging_steps=1, report_to="none", use_cpu=True,
                      bf16=False, save_strategy="no", seed=0, learning_rate=1e-2, beta=0.0,
                      deepspeed=zero3_config())
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok, peft_config=peft_config)
    rank = trainer.accelerator.process_index
    generation, seen = trainer.kvroll_generation, []
    real_generate = generation.generate

    def check_workers():
        rollouts = generation.ray
        assert rollouts.zero3, "the parameters are not ZeRO-3 partitioned"
        plan = BucketPlan.for_model(rollouts.model, rollouts._dtype(), args.kvroll_sync_bucket_mb << 20)
        expected = plan.checksums(rollouts.model)  # a gather per bucket: every rank computes it
        if lora:
            check_merged_view(rollouts.model, plan)
        if rank == 0:
            assert len(plan) > 1, "the test needs several buckets"
            assert rollouts.pool.checksums() == [expected], "the worker's weights differ from the trainer's"
        seen.append(expected)

    def checked_generate(prompts, images=None, num_generations=1, profiler=None):
        check_workers()
        return real_generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)

    generation.generate = checked_generate
    trainer.train()
    generation.sync_weights()  # the sync TRL would run before a third generation
    check_workers()
    assert len(seen) == 3 and seen[0] != seen[1] != seen[2], "the weights did not change between syncs"
    if rank == 0:
        assert generation.ray.pool.version == 3 and generation.ray.pool.versions() == [3]
    check_faults(generation, check_workers, rank, kill=not lora)
    if rank == 0:
        generation.ray.pool.close()
    print(f"RANK {rank} OK", flush=True)


def check_faults(generation, check_workers, rank: int, kill: bool) -> None:
    """Syncs 4 and 5, on every rank: a damaged middle bucket is resent; a dead worker is replaced, the sync redone."""
    import ray

    pool = generation.ray.pool if rank == 0 else None
    if rank == 0:
        ray.get(pool.slots[0].actor.inject_fault.remote("corrupt", index=1, times=1))
    generation.sync_weights()
    check_workers()
    if rank == 0:
        stats = generation.last_sync
        assert (stats["version"], stats["attempts"], stats["resent_buckets"]) == (4, 2, 1), stats
        assert stats["buckets"] == len(pool.plan) + 1 and stats["gather_seconds"] > 0, stats  # the resend: one
    if not kill:
        return
    if rank == 0:
        ray.kill(pool.slots[0].actor, no_restart=True)
    generation.sync_weights()  # the other rank must not be left inside a gather rank 0 never enters
    check_workers()
    if rank == 0:
        stats = generation.last_sync
        assert stats["version"] == 5 and stats["regroups"] >= 1 and pool.slots[0].restarts == 1, stats
        assert pool.versions() == [5]


def check_merged_view(model, plan) -> None:
    """The plan's tensors (merged LoRA weights) against TRL's own read-out, gathered on every rank."""
    import torch
    from zero3_lora_worker import trl_merged

    reference = trl_merged(model)
    fetch = plan.fetcher(model)
    for index in range(len(plan)):
        with fetch(index) as tensors:
            for name in tensors:
                if name in reference:
                    assert torch.equal(tensors[name], reference[name]), f"{name} is not the merged weight"
                    reference.pop(name)
    assert not reference, f"the plan lacks {sorted(reference)}"
    assert not any("lora_" in n or "base_layer" in n for n in plan.names())
    assert not any(getattr(m, "merged", False) for m in model.modules()), "the trainer's model was left merged"


if __name__ == "__main__":
    main(sys.argv[1], "--lora" in sys.argv[2:])  # any failed check raises here, before the exit
    exit_rank()  # tear gloo down, then skip the interpreter's teardown (rank_exit.py)
