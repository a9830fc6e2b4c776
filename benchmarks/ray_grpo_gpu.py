"""GRPO (or PPO) with kvroll_mode='ray' on two GPUs: trainer under DeepSpeed ZeRO-3 on one, a Ray rollout worker on
the other.

    CUDA_VISIBLE_DEVICES=1 ray start --head --num-gpus 1 --num-cpus 8 --disable-usage-stats
    accelerate launch --config_file configs/accelerate_zero3.yaml benchmarks/ray_grpo_gpu.py --out OUT \
        --tokenizer .devtok
    python benchmarks/ray_grpo_gpu.py --size tiny --device cpu --steps 2 --rows 16 --max-completion-length 32 \
        --out /tmp/r    # a CPU smoke run (gloo), no DeepSpeed
    ... --trainer ppo   # kvroll's PPOTrainer instead: --rows prompts a rollout (one completion each), one PPO epoch
                        # (an optimizer step, then a sync, per rollout), a value model from the policy, no reference

Measures, in one run (Qwen3-1.7B architecture, random weights, EOS ignored so every row is full length):
(a) each step's weight sync (seconds, bytes, GB/s) next to raw broadcasts of 1 GB over the same process group;
(b) after every sync, every worker's per-bucket checksums against the trainer's gathered weights;
(c) the worker's rollout throughput against a colocated engine (the same weights, on the trainer's GPU) on the
    same rollout, interleaved, and (d) each step's timeline: rollout, sync, the rest (scoring + training).
Writes ray_grpo_gpu.json and ray_grpo_gpu.md to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_rollout_speed import build_dataset, build_model, build_tokenizer, reward_length  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", default="grpo", choices=["grpo", "ppo"])
    p.add_argument("--size", default="qwen3-1.7b", choices=["qwen3-1.7b", "tiny"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=64, help="rows per step (prompts x generations)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=1024)
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--policy", default="rkv")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--bucket-mb", type=int, default=1024)
    p.add_argument("--throughput-rounds", type=int, default=2)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--ray-address", default="auto")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    import torch

    opts = parse_args(argv)
    on_gpu = opts.device == "cuda"
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(opts.tokenizer)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = build_model(opts.size, dtype, opts.device, seed=0)
    prompts = opts.rows // (opts.generations if opts.trainer == "grpo" else 1)
    dataset = build_dataset(tok, prompts * (opts.steps + 1), opts.prompt_length)
    common = dict(
        output_dir=str(out / "run"), use_kvroll=True, kvroll_mode="ray", kvroll_num_workers=1,
        kvroll_gpus_per_worker=1 if on_gpu else 0, kvroll_ray_address=opts.ray_address if on_gpu else None,
        kvroll_policy=opts.policy, kvroll_budget=opts.budget, kvroll_sync_bucket_mb=opts.bucket_mb,
        per_device_train_batch_size=opts.micro_batch, gradient_accumulation_steps=opts.rows // opts.micro_batch,
        max_completion_length=opts.max_completion_length, generation_kwargs={"ignore_eos": True},
        max_steps=opts.steps, logging_steps=1, report_to="none", save_strategy="no", seed=0, learning_rate=1e-5,
        bf16=on_gpu, use_cpu=not on_gpu, gradient_checkpointing=on_gpu,
        # A random model's compressed rollouts are so far off-policy that TRL's sequence mask zeroes every
        # gradient; without the correction the weights move each step, so each sync carries new bytes.
        vllm_importance_sampling_correction=False)
    if opts.trainer == "grpo":
        from kvroll.trainers import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**common, kvroll_max_batch=opts.rows, num_generations=opts.generations, beta=0.0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_length, args=args, train_dataset=dataset,
                              processing_class=tok)
    else:  # one rollout of --rows prompts feeds one optimizer step (one PPO epoch), then the sync
        from kvroll.trainers import PPOConfig, PPOTrainer

        args = PPOConfig(**common, rollout_batch_size=opts.rows, num_ppo_epochs=1, kl_coef=0.0)
        trainer = PPOTrainer(model=model, reward_funcs=reward_length, args=args, train_dataset=dataset,
                             processing_class=tok)
    timeline = Timeline(trainer)
    trainer.add_callback(timeline)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    rollouts = trainer.kvroll_generation.ray
    pool = rollouts.pool
    result = {"env": environment(opts), "steps": timeline.rows, "train_seconds": train_seconds,
              "plan": {"buckets": len(pool.plan), "bytes": pool.plan.total_bytes}, "zero3": rollouts.zero3}
    result["probe"] = pool.probe_bandwidth(min(1 << 30, pool.plan.total_bytes), repeats=5)
    result["throughput"], engine_model = compare_throughput(trainer, pool, opts, tok)
    result["sync_variants"] = sync_variants(pool, rollouts.model, engine_model)
    (out / "ray_grpo_gpu.json").write_text(json.dumps(result, indent=1))
    (out / "ray_grpo_gpu.md").write_text(markdown(result))
    print(markdown(result), flush=True)
    pool.close()
    return result


class Timeline(TrainerCallback):
    """Per optimizer step: wall time, rollout and sync seconds (the adapter's metrics), checksum verdict."""

    def __init__(self, trainer):
        self.trainer, self.rows, self.start = trainer, [], None
        generation = trainer.kvroll_generation
        real_sync = generation.sync_weights

        def sync_and_verify():
            real_sync()
            pool = generation.ray.pool
            expected = pool.plan.checksums(generation.ray.model)  # gathered under ZeRO-3, outside the timed sync
            self.verified = pool.checksums() == [expected] * pool.num_workers
            self.sync = dict(generation.last_sync)  # the pool's figures and rank 0's send phases
            self.digest = hash(tuple(expected))

        generation.sync_weights = sync_and_verify
        self.verified, self.sync, self.digest = None, {}, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        metrics = self.trainer._metrics["train"]
        rollout = metrics["kvroll/rollout_seconds"][-1] if metrics.get("kvroll/rollout_seconds") else float("nan")
        tokens = metrics["kvroll/rollout_tokens_per_second"][-1] if metrics.get(
            "kvroll/rollout_tokens_per_second") else float("nan")
        self.rows.append({"step": state.global_step, "seconds": now - self.start, "rollout_s": rollout,
                          "rollout_tokens_per_s": tokens, "sync": self.sync, "checksums_equal": self.verified,
                          "weights_changed": bool(self.rows) and self.digest != self.rows[-1]["digest"],
                          "digest": self.digest})
        self.start = now


def compare_throughput(trainer, pool, opts, tok) -> dict:
    """The same rollout on the Ray worker and on a colocated engine (trainer's GPU), interleaved rounds."""
    import torch

    from kvroll import CompressionConfig, RolloutEngine, SamplingParams
    from kvroll.trainers.colocate import ColocatedWeights

    model = trainer.accelerator.unwrap_model(trainer.model)
    model = getattr(model, "policy", model)  # PPO trains policy + value; the engine takes the policy
    weights = ColocatedWeights(model, dtype=pool.dtype, device=trainer.accelerator.device)
    engine = RolloutEngine(weights.engine_model, compression=CompressionConfig(opts.policy, opts.budget),
                           max_batch=opts.rows)
    torch.manual_seed(1)
    prompts = [torch.randint(1, 40000, (opts.prompt_length,)).tolist() for _ in range(opts.rows // opts.generations)]
    sampling = SamplingParams(max_new_tokens=opts.max_completion_length, temperature=1.0, ignore_eos=True, seed=3)
    rows = {"ray": [], "colocated": []}
    # Each side once on the timed prompts' shape first: capture graphs, compile the kernels' variants for this
    # prompt length (session 43's first Ray round, without it, took 1.2-1.5x the second's).
    warm = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.generate(prompts[:1], warm, n=2)
    pool.generate(prompts[:1], warm, n=2)
    for _ in range(opts.throughput_rounds):
        for name, run in (("ray", lambda: pool.generate(prompts, sampling, n=opts.generations)),
                          ("colocated", lambda: engine.generate(prompts, sampling, n=opts.generations))):
            start = time.perf_counter()
            completions = run()
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for c in completions)
            rows[name].append({"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds})
    ray_rate = statistics.median(r["tokens_per_s"] for r in rows["ray"])
    local_rate = statistics.median(r["tokens_per_s"] for r in rows["colocated"])
    return {"rounds": rows, "ray_tokens_per_s": ray_rate, "colocated_tokens_per_s": local_rate,
            "ray_cost": 1 - ray_rate / local_rate, "worker_metrics": pool.metrics()}, weights.engine_model


def sync_variants(pool, zero3_model, plain_model, repeats: int = 3) -> list[dict]:
    """Sync seconds from the ZeRO-3 trainer and from a plain (unpartitioned) copy, at two bucket sizes."""
    rows = []

    for bucket_mb in (1024, 256):
        pool.bucket_bytes, pool.plan = bucket_mb << 20, None  # re-planned (and sent to the workers) on next sync
        for name, model in (("zero3", zero3_model), ("plain", plain_model)):
            pool.update_weights(model)  # warm-up at this bucket size
            pool.take_send_times()  # rank 0's send phases from here on (weight_sync.SendTimes)
            times, phases = [], []
            for _ in range(repeats):
                times.append(pool.update_weights(model)["seconds"])
                phases.append(pool.take_send_times())
            equal = pool.checksums() == [pool.plan.checksums(model)] * pool.num_workers
            median = statistics.median(times)
            rows.append({"source": name, "bucket_mb": bucket_mb, "buckets": len(pool.plan), "seconds": times,
                         "median_s": median, "gb_per_s": pool.plan.total_bytes / median / 1e9,
                         "checksums_equal": equal, "phases": phases})
    return rows


def environment(opts) -> dict:
    import torch
    import transformers
    import trl

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), "args": vars(opts),
           "torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def markdown(r: dict) -> str:
    gb = r["plan"]["bytes"] / 1e9
    probe = r["probe"]
    lines = [f"# Ray rollouts on two GPUs, {r['env']['args']['trainer'].upper()} ({r['env'].get('gpu', 'cpu')}, {r['env']['date']})", "",
             f"`{r['env']['command']}`", "",
             f"Weights: {gb:.2f} GB in {r['plan']['buckets']} bucket(s). Raw broadcast over the sync group: "
             f"{probe['gb_per_s_median']:.1f} GB/s median ({probe['gb_per_s_best']:.1f} best) for "
             f"{probe['bytes'] / 1e9:.2f} GB.", "",
             "| step | step s | rollout s | rollout tok/s | sync ms | sync GB/s | share of raw | resent | checksums "
             "| weights changed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["steps"]:
        sync = row["sync"] or {}
        rate = sync.get("gb_per_s", float("nan"))
        lines.append(f"| {row['step']} | {row['seconds']:.2f} | {row['rollout_s']:.2f} | "
                     f"{row['rollout_tokens_per_s']:.0f} | {1000 * sync.get('seconds', float('nan')):.1f} | "
                     f"{rate:.1f} | {rate / probe['gb_per_s_median']:.0%} | {sync.get('resent_buckets')} | "
                     f"{'equal' if row['checksums_equal'] else 'DIFFER'} | "
                     f"{'yes' if row.get('weights_changed') else 'no' if row['step'] > 1 else '-'} |")
    t = r["throughput"]
    lines += ["", f"Rollout throughput, same rollout, interleaved: Ray worker {t['ray_tokens_per_s']:.0f} tok/s, "
              f"colocated engine {t['colocated_tokens_per_s']:.0f} tok/s: Ray costs {t['ray_cost']:.1%}.", "",
              "| sync source | bucket MB | buckets | median ms | GB/s | share of raw | checksums |",
              "|---|---|---|---|---|---|---|"]
    for v in r.get("sync_variants", []):
        lines.append(f"| {v['source']} | {v['bucket_mb']} | {v['buckets']} | {1000 * v['median_s']:.1f} | "
                     f"{v['gb_per_s']:.1f} | {v['gb_per_s'] / probe['gb_per_s_median']:.0%} | "
                     f"{'equal' if v['checksums_equal'] else 'DIFFER'} |")
    from kvroll.rollout.weight_sync import SYNC_PHASES

    lines += ["", "Rank 0's send phases per sync, ms (weight_sync.SendTimes; docs/ray.md, \"Reading the sync phases\"):", "",
              "| sync | " + " | ".join(SYNC_PHASES) + " |", "|---|" + "---|" * len(SYNC_PHASES)]
    named = [(f"step {row['step']}", row["sync"] or {}) for row in r["steps"]]
    named += [(f"{v['source']} {v['bucket_mb']} MB #{i + 1}", ph) for v in r.get("sync_variants", [])
              for i, ph in enumerate(v.get("phases", []))]
    for name, ph in named:
        lines.append(f"| {name} | " + " | ".join(f"{1000 * ph[k]:.1f}" if isinstance(ph.get(k), float) else
                                                 str(ph.get(k, "-")) for k in SYNC_PHASES) + " |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
