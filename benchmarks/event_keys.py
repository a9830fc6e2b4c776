"""How many event graphs a ragged RL rollout makes: the keys ``EventGraphs`` would capture (CPU, tiny model).

    PYTHONPATH=. python benchmarks/event_keys.py --out /tmp/event_keys.json      # ~10 min on 2 cores

A GRPO-like rollout on a tiny random Qwen3 (2 layers, vocabulary 4,096, so that a stop token ends a completion
after ~4k tokens on average, geometrically spread): ``--prompts`` prompts of 64-512 tokens, ``--group``
completions each, ``--max-batch`` rows at a time (finished rows refilled), up to ``--max-new`` tokens. Each
periodic policy's host-scheduled events are recorded as the engine runs them (the due slots and their sizes),
then split and keyed as ``EventGraphs.run`` splits and keys them. The engine runs on the CPU, where there are no
graphs, so this counts what a GPU run of the same schedule would capture and replay: per policy the graph runs
(events, split), the distinct keys, the runs that would replay a graph (a key's second sight on, while under
``max_graphs``: a capture runs nothing, so the second sight replays at once), and the runs per key.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.graphs import EventGraphs
from kvroll.rollout.schedule import HostSchedule


def tiny_qwen3(vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=16384)
    model = Qwen3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


def run(policy: str, args, model) -> dict:
    engine = RolloutEngine(model, compression=CompressionConfig(policy, budget=args.budget),
                           max_batch=args.max_batch)
    keys: list = []
    original = HostSchedule.order  # the engine makes a schedule per generate: record through the class


    def recording(self, due):
        due, sizes = original(self, due)
        keys.extend(EventGraphs.key(part, part_sizes) for part, part_sizes in EventGraphs.parts(list(due), sizes))
        return due, sizes

    HostSchedule.order = recording
    rng = random.Random(0)
    prompts = [[rng.randrange(8, args.vocab) for _ in range(rng.randrange(64, 513))] for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, seed=1, stop_token_ids=(7,))
    start = time.perf_counter()
    try:
        results = engine.generate(prompts, params, n=args.group)
    finally:
        HostSchedule.order = original
    lengths = [len(r.token_ids) for r in results]
    seen, graphs, replays = Counter(), set(), 0
    for key in keys:  # EventGraphs.run's rule: eager, captured on the second sight, replayed after
        if key in graphs:
            replays += 1
        elif seen[key] >= 1 and len(graphs) < EventGraphs.max_graphs:
            graphs.add(key)
            replays += 1  # a capture runs nothing: the second sight replays at once
        seen[key] += 1
    counts = Counter(keys)
    return {"policy": policy, "events": len(keys), "keys": len(counts), "graphs": len(graphs),
            "replayed": replays, "replayed_share": replays / max(1, len(keys)),
            "span_keys": sum(1 for k in counts if isinstance(k, tuple) and k[0] == "span"),
            "events_per_key_top": [c for _, c in counts.most_common(5)],
            "completion_tokens_mean": sum(lengths) / len(lengths), "completion_tokens_max": max(lengths),
            "seconds": time.perf_counter() - start}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="hardkv,lagkv,rkv,snapkv")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = tiny_qwen3(args.vocab)
    out = []
    for policy in args.policies.split(","):
        row = run(policy, args, model)
        out.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
