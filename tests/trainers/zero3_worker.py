"""A 2-step GRPO run with ``use_kvroll=True`` under DeepSpeed ZeRO-3, one process (world size 1).

    python tests/trainers/zero3_worker.py OUT_DIR [--device cuda|cpu]    # run by test_zero3.py

The trainer's parameters are partitioned (ZeRO-3, persistence threshold 0, so every parameter is gathered on use),
and the colocated engine must hold full copies: after every optimizer step, when TRL's sync has run, the engine's
weights must equal the trainer's weights gathered by DeepSpeed (sha256 over all parameters; kvroll itself reads each
whole partition without a gather, `held_whole`). Prints ``ZERO3 OK`` and the sync
statistics when every check passed; raises otherwise. The distributed environment is the one ``torchrun`` would
give a single process (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), set by ``zero3_common`` unless
already present.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_common import MAX_COMPLETION, build_trainer, grpo_config, run_worker  # noqa: E402  (sets the environment)


def main(out_dir: str, device: str) -> dict:
    import deepspeed
    import torch

    from kvroll.rollout.sources import held_whole
    from kvroll.trainers import GRPOTrainer
    from kvroll.trainers.colocate import weights_checksum

    on_gpu = device == "cuda"
    trainer = build_trainer(GRPOTrainer, grpo_config(out_dir, device))
    generation, calls = trainer.kvroll_generation, []
    real_generate = generation.generate

    def gathered_checksum():  # the trainer's weights through DeepSpeed's own gather (kvroll reads the partitions)
        with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
            return weights_checksum(trainer.model)

    def checksums():
        return gathered_checksum(), weights_checksum(generation.weights.engine_model)

    def recording_generate(prompts, images=None, num_generations=1, profiler=None):
        out = real_generate(prompts=prompts, images=images, num_generations=num_generations, profiler=profiler)
        calls.append({"rows": len(prompts), "checksums": checksums(), "sync": dict(generation.last_sync),
                      "lengths": [len(c) for c in out[1]]})
        return out

    generation.generate = recording_generate
    trainer.train()

    assert trainer.is_deepspeed_enabled, "DeepSpeed is not enabled"
    weights = generation.weights
    params = list(trainer.model.parameters())
    assert weights.zero3 and all(hasattr(p, "ds_id") for p in params), "the trainer's parameters are not ZeRO-3"
    assert any(p.numel() == 0 or p.numel() < p.ds_numel for p in params), "no parameter is partitioned"
    assert all(held_whole(p) for p in params), "one process: every partition is whole, read without a gather"
    for (name, src), (_, dst) in zip(trainer.model.named_parameters(), weights.engine_model.named_parameters()):
        assert tuple(dst.shape) == tuple(src.ds_shape), (name, dst.shape, src.ds_shape)  # full, not a shard
    assert len(calls) == 2, f"expected 2 generate calls, got {len(calls)}"
    for index, call in enumerate(calls):
        trainer_sum, engine_sum = call["checksums"]
        assert trainer_sum == engine_sum, f"generate call {index}: engine weights differ from the trainer's"
        assert call["sync"]["copied"] > 0 and call["sync"]["shared"] == 0, call["sync"]
        assert call["rows"] == 8 and all(1 <= n <= MAX_COMPLETION for n in call["lengths"]), call
    assert calls[0]["checksums"][0] != calls[1]["checksums"][0], "the first optimizer step did not change the weights"
    final_trainer = gathered_checksum()
    assert final_trainer != calls[1]["checksums"][0], "the second optimizer step did not change the weights"
    generation.sync_weights()  # what TRL runs before a third generation
    trainer_sum, engine_sum = checksums()
    assert trainer_sum == engine_sum == final_trainer, "after the last step's sync the engine differs"
    engine_dtype = next(weights.engine_model.parameters()).dtype
    report = {"device": device, "gpu": torch.cuda.get_device_name() if on_gpu else None,
              "engine_dtype": str(engine_dtype), "parameters": len(params),
              "sync_seconds": [c["sync"]["seconds"] for c in calls] + [generation.last_sync["seconds"]],
              "copied_tensors": generation.last_sync["copied"], "checksums_after_steps": [
                  calls[1]["checksums"][0], final_trainer]}
    with open(os.path.join(out_dir, "zero3_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("ZERO3 OK " + json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    run_worker(main, __doc__)
