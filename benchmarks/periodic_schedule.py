"""Benchmark: periodic compression planned on the host (inside decode windows) against the read-the-device path.

Issue 16 §2. R-KV and SnapKV compress a slot when its cache is full; rows of different prompt lengths (every RL
batch) fill up out of phase, so the read-the-device path ends a decode window (a host sync) at every slot's
compression, and R-KV's kernel choice read the device once per layer per event. The host schedule
(``kvroll/rollout/schedule.py``) runs each window through them, and replays each event from a CUDA graph
(``EventGraphs``: an event is tens of kernel launches per layer; since session 14 an event on few slots batches
the layers, ``--paths per-layer`` times it without). The paths are timed in one run on the same
prompts, with ``longflow`` (no periodic work) and ``full`` as the references the periodic policies should approach:

* ``qwen3``: Qwen3-1.7B architecture, random bf16 weights, 64 prompts of 256-1024 random tokens, batch 64,
  2,048 new tokens (EOS ignored), budget 1024 (R-KV / SnapKV buffer 128); LagKV and Hard-KV too (on the host
  schedule since session 16; their ``reads`` path is the one before). ``--runs`` picks run labels.
* ``fidelity``: the fidelity study's rollout shape (``docs/benchmarks/learning_fidelity_seeds.md``): the embedded
  model's architecture (SmolLM2-135M, random weights), 8 prompts of 25-35 tokens x 8 samples, 384 new tokens,
  budget 46, R-KV buffer 8.

    PYTHONPATH=. python benchmarks/periodic_schedule.py --out $OUT/periodic_schedule.json
    PYTHONPATH=. python benchmarks/periodic_schedule.py --cases tiny --out /tmp/ps.json      # CPU smoke run

Per run: wall seconds of ``generate`` (graphs captured before), generated tokens per second, host reads
(``decode_windows``), compression events and their summed time (CUDA events on a GPU).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.bench.models import build_model, resolve_dtype
from kvroll.rollout import scheduler as scheduler_module
from kvroll.rollout import graphs as graphs_module
from kvroll.rollout.cache import CompressedKVCache

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)

CASES = {  # model spec, prompts (count, low, high), n, new tokens, runs: (label, policy, kwargs)
    "qwen3": ("qwen3-1.7b", (64, 256, 1024), 1, 2048, [
        ("full", "full", {}), ("longflow", "longflow", dict(budget=1024)),
        ("rkv", "rkv", dict(budget=1024)), ("snapkv", "snapkv", dict(budget=1024)),
        ("lagkv", "lagkv", dict(budget=1024)), ("hardkv", "hardkv", dict(budget=1024))]),
    "fidelity": (SMOLLM2, (8, 25, 35), 8, 384, [
        ("full", "full", {}), ("longflow", "longflow", dict(budget=46)),
        ("rkv", "rkv", dict(budget=46, buffer=8))]),
    # a GRPO-like batch that starts in phase and ends ragged: 32 prompts x 8 samples, each completion ended by any
    # of STOP_TOKENS (random weights: ~1 in 3,800 per step, so lengths spread geometrically up to the 4,096)
    "ragged": ("qwen3-1.7b", (32, 64, 512), 8, 4096, [
        ("longflow", "longflow", dict(budget=1024)), ("hardkv", "hardkv", dict(budget=1024)),
        ("rkv", "rkv", dict(budget=1024))]),
    "tiny": (TINY, (4, 5, 30), 2, 48, [
        ("longflow", "longflow", dict(budget=24)), ("rkv", "rkv", dict(budget=24, buffer=8, window=4))]),
}


STOP_TOKENS = {"ragged": tuple(range(1000, 1040))}
PATHS = {"graphs": "host schedule, event graphs", "unsplit": "event graphs, events not split (before session 17)",
         "rows64": "event graphs, 64 rows a call",
         "per-layer": "event graphs, layer by layer",
         "eager": "host schedule, eager events", "reads": "device reads"}


def timed(model, compression, prompts, n, tokens, path: str, repeats: int, stop: tuple = ()) -> dict:
    """One engine's ``generate`` timed on ``path``: "graphs" (the engine's default), "per-layer" (the graphed
    events without layer batching: ``CompressedKVCache.layer_batch_rows = 0``, the path before session 14), "rows64"
    (64 rows a call whatever the cache's shape, session 14's first rule), "eager"
    (events launched op by op) or "reads" (the read-the-device path: a window ends at each compression)."""
    originals = scheduler_module.HostSchedule.for_cache, graphs_module.EventGraphs.run, CompressedKVCache.layer_batch_rows
    parts = graphs_module.EventGraphs.parts
    if path == "unsplit":
        graphs_module.EventGraphs.parts = classmethod(lambda cls, due, sizes: [(due, sizes)])
    if path in ("per-layer", "rows64"):
        CompressedKVCache.layer_batch_rows = 0 if path == "per-layer" else 64
    if path == "reads":
        scheduler_module.HostSchedule.for_cache = classmethod(lambda cls, cache, slots: None)
    if path == "eager":
        graphs_module.EventGraphs.run = lambda self, due, sizes=None: self.cache.compress_slots(due)
    engine = RolloutEngine(model, compression=compression, max_batch=len(prompts) * n)
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0, stop_token_ids=stop)
    try:
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # capture, compile
        walls = []
        for _ in range(repeats):
            before = {k: engine.stats[k] for k in ("decode_windows", "decode_steps", "policy_seconds")}
            events = len(engine.stats["policy_events"])
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            results = engine.generate(prompts, sampling, n=n)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    finally:
        (scheduler_module.HostSchedule.for_cache, graphs_module.EventGraphs.run,
         CompressedKVCache.layer_batch_rows) = originals
        graphs_module.EventGraphs.parts = parts
    generated = sum(len(r.token_ids) for r in results)
    event_ms = sorted(1e3 * sec for _, sec in list(engine.stats["policy_events"])[events:])
    wall = min(walls)
    return {"wall_s": wall, "walls_s": walls, "tok_s": generated / wall, "generated": generated,
            "decode_windows": engine.stats["decode_windows"] - before["decode_windows"],
            "decode_steps": engine.stats["decode_steps"] - before["decode_steps"],
            "events": len(engine.stats["policy_events"]) - events,
            "policy_s": engine.stats["policy_seconds"] - before["policy_seconds"],
            "event_ms_median": statistics.median(event_ms) if event_ms else None,
            "event_ms_p90": event_ms[int(0.9 * (len(event_ms) - 1))] if event_ms else None,
            "event_ms_max": event_ms[-1] if event_ms else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="fidelity,qwen3", help=f"comma list of {sorted(CASES)}")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"R-KV / SnapKV / LagKV / Hard-KV paths timed: comma list of "
                        f"{list(PATHS)}")
    parser.add_argument("--runs", default=None, help="comma list of run labels to time (default: every run of a "
                        "case)")
    parser.add_argument("--repeats", type=int, default=1, help="timed generate calls per run (the fastest counts)")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cases": {}}
    for case in opts.cases.split(","):
        spec, (count, low, high), n, tokens, runs = CASES[case]
        model = build_model(None, spec, resolve_dtype("auto", device), device, seed=0)
        rng = random.Random(0)
        vocab = model.config.vocab_size
        prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]
        rows = {}
        for label, policy, kwargs in runs:
            if opts.runs and label not in opts.runs.split(","):
                continue
            paths = opts.paths.split(",") if policy in ("rkv", "snapkv", "lagkv", "hardkv") else ["graphs"]
            for path in paths:
                name = label if len(paths) == 1 else f"{label} ({PATHS[path]})"
                row = timed(model, CompressionConfig(policy, **kwargs), prompts, n, tokens, path, opts.repeats,
                            STOP_TOKENS.get(case, ()))
                row["path"] = path
                rows[name] = row
                print(f"{case:9s} {name:42s} {row['wall_s']:8.2f} s {row['tok_s']:10.0f} tok/s "
                      f"windows {row['decode_windows']:5d} steps {row['decode_steps']:6d} events {row['events']:5d} "
                      f"policy {row['policy_s']:.2f} s (event ms median {row['event_ms_median'] or 0:.2f}, p90 "
                      f"{row['event_ms_p90'] or 0:.2f}, max {row['event_ms_max'] or 0:.2f})", flush=True)
        report["cases"][case] = {"prompts": [count, low, high], "n": n, "new_tokens": tokens, "runs": rows}
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None
        with open(opts.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
