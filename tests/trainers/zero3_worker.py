"""A 2-step GRPO run with ``use_kvroll=True`` under DeepSpeed ZeRO-3, one process (world size 1).

    python tests/trainers/zero3_worker.py OUT_DIR [--device cuda|cpu]    # run by test_zero3.py

The trainer's parameters are partitioned (ZeRO-3, persistence threshold 0, so every parameter is gathered on use),
and the colocated engine must hold full copies: after every optimizer step, when TRL's sync has run, the engine's
weights must equal the trainer's gathered weights (sha256 over all parameters). Prints ``ZERO3 OK`` and the sync
statistics when every check passed; raises otherwise. The distributed environment is the one ``torchrun`` would
give a single process (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK), set here unless already present.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
    os.environ.setdefault(key, value)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import chat_dataset, length_reward, tiny_llama, tokenizer  # noqa: E402

MAX_COMPLETION = 16


def zero3_config() -> dict:
    """ZeRO-3 without offload; every parameter partitioned (threshold 0) so every sync must gather."""
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_gather_16bit_weights_on_model_save": False},
            "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


def main(out_dir: str, device: str) -> dict:
    import torch

    from kvroll.trainers import GRPOConfig, GRPOTrainer
    from kvroll.trainers.colocate import weights_checksum

    on_gpu = device == "cuda"
    tok = tokenizer()
    args = GRPOConfig(output_dir=out_dir, use_kvroll=True, kvroll_policy="longflow", kvroll_budget=16,
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=MAX_COMPLETION,
                      max_steps=2, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                      learning_rate=1e-2, beta=0.0, use_cpu=not on_gpu, bf16=on_gpu, deepspeed=zero3_config())
    trainer = GRPOTrainer(model=tiny_llama(tok), reward_funcs=length_reward, args=args,
                          train_dataset=chat_dataset(), processing_class=tok)
    generation, calls = trainer.kvroll_generation, []
    real_generate = generation.generate

    def checksums():
        engine = generation.weights.engine_model
        return weights_checksum(trainer.model), weights_checksum(engine)

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
    for (name, src), (_, dst) in zip(trainer.model.named_parameters(), weights.engine_model.named_parameters()):
        assert tuple(dst.shape) == tuple(src.ds_shape), (name, dst.shape, src.ds_shape)  # full, not a shard
    assert len(calls) == 2, f"expected 2 generate calls, got {len(calls)}"
    for index, call in enumerate(calls):
        trainer_sum, engine_sum = call["checksums"]
        assert trainer_sum == engine_sum, f"generate call {index}: engine weights differ from the trainer's"
        assert call["sync"]["copied"] > 0 and call["sync"]["shared"] == 0, call["sync"]
        assert call["rows"] == 8 and all(1 <= n <= MAX_COMPLETION for n in call["lengths"]), call
    assert calls[0]["checksums"][0] != calls[1]["checksums"][0], "the first optimizer step did not change the weights"
    final_trainer = weights_checksum(trainer.model)
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    opts = parser.parse_args()
    os.makedirs(opts.out_dir, exist_ok=True)
    main(opts.out_dir, opts.device)
