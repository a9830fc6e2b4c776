"""Hard-KV's decode kernel on the per-head live lengths of a real run: does the rows' spread of lengths cost time,
and does a launch order or configuration win back what it costs? (Session 30, developer probe.)

Hard-KV keeps a different number of tokens per (slot, KV head) row (top-p per head), and the decode kernel runs one
program per row (one split at the engine's batch 64): rows of unequal length leave a tail. The bench profiles the
kernel on every row filled to the mean (``kvroll.bench.kernel_count``), which hides that. This probe:

1. runs the engine (random Qwen3-1.7B-architecture weights, Hard-KV at budget 1,024, ``--batch`` rows, prompt 512,
   ``--new`` tokens) and takes the cache's live counts [layers, slots, KV heads] at the end of the run;
2. for a few layers, times Hard-KV's decode call (the mass added into its votes, dense, bf16: the engine's call) on
   random K / V with those counts, CUDA-graph medians of interleaved rounds, under:
   - ``real``: the rows in the engine's order; ``uniform``: every row at the mean count (the bench's profile);
   - ``desc`` / ``asc`` / ``shuffled``: the same rows relaid one KV head per slot (a [slots x Hkv, 1, C, D] cache,
     the same bytes and programs), longest first, shortest first, and at random; ``flat``: relaid in the engine's
     order (so ``desc`` is compared with ``flat``, the same layout);
   - launch knobs on the real rows (splits, stages, warps, the logits' store);
   - attention alone (no statistic) on the real rows;
   each variant's output checked equal to ``real``'s (the same values: the reordering moves rows, not math);
3. prints each variant's time against the bytes' floor (the live K and V bytes over the copy bandwidth).

    PYTHONPATH=.:benchmarks python benchmarks/hardkv_rows_probe.py --out OUT [--batch 64] [--new 1000]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

try:
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.hardkv_rows_probe
    from benchmarks.kernel_decode import interleaved

import kvroll.kernels.decode_attention as da
from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.models import build_model

DEVICE = "cuda"  # "cpu" runs layer_case / flat under TRITON_INTERPRET=1 (the engine and the timing need CUDA)


def engine_counts(batch: int, new: int, budget: int) -> tuple[torch.Tensor, int, int, int]:
    """The live counts [layers, slots, KV heads] at the end of a Hard-KV run (random weights, prompt 512), the
    cache's capacity, the model's query heads and head dim."""
    model = build_model(None, "qwen3-1.7b", torch.bfloat16, torch.device(DEVICE), seed=0)
    engine = RolloutEngine(model, compression=CompressionConfig("hardkv", budget=budget), max_batch=batch)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, 512), generator=gen).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=new, temperature=1.0, seed=0))
    counts, capacity = engine.cache.count.clone(), engine.cache.capacity
    num_q, head_dim = model.config.num_attention_heads, engine.cache.head_dim
    engine.close()
    del engine, model
    torch.cuda.empty_cache()
    return counts, capacity, num_q, head_dim


def live_positions(count: torch.Tensor, capacity: int) -> torch.Tensor:
    """[..., capacity] int32 positions: slot i holds position i below its row's count, -1 (dead) from it (dense)."""
    slots = torch.arange(capacity, device=count.device)
    return torch.where(slots < count[..., None], slots, -1).to(torch.int32)


def layer_case(count: torch.Tensor, capacity: int, num_q: int, head_dim: int):
    """Random q / K / V for one layer's rows and their positions, every slot below its count live (dense), as the
    cache holds them."""
    slots, num_kv = count.shape
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn(slots, num_q, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(slots, num_kv, capacity, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(slots, num_kv, capacity, head_dim, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    return q, k, v, live_positions(count, capacity)


def flat(q, k, v, pos, count, order):
    """The rows relaid one KV head per slot ([S x Hkv, group, D] queries, [S x Hkv, 1, C, D] cache) in ``order``."""
    slots, num_kv = count.shape
    group = q.shape[1] // num_kv
    rows = lambda t: t.reshape(slots * num_kv, 1, *t.shape[2:])[order].contiguous()  # noqa: E731
    qf = q.view(slots, num_kv, group, q.shape[-1]).reshape(slots * num_kv, group, q.shape[-1])[order].contiguous()
    return qf, rows(k), rows(v), rows(pos), count.reshape(-1, 1)[order].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--layers", default="0,7,14,27")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    counts, capacity, num_q, head_dim = engine_counts(args.batch, args.new, args.budget)
    bandwidth = copy_bandwidth("cuda")
    result = {"batch": args.batch, "new": args.new, "copy_bw_tb_s": bandwidth / 1e12,
              "counts": {"mean": counts.float().mean().item(), "min": counts.min().item(), "max": counts.max().item(),
                         "per_layer_mean": counts.float().mean(dim=(1, 2)).tolist(),
                         "per_layer_std": counts.float().std(dim=(1, 2)).tolist(),
                         "quantiles": torch.quantile(counts.float().flatten(),
                                                     torch.tensor([0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99],
                                                                  device=counts.device)).tolist()},
              "layers": {}}
    print(json.dumps(result["counts"]), flush=True)
    scale = head_dim ** -0.5
    for layer in [int(x) for x in args.layers.split(",")]:
        count = counts[layer].contiguous()
        q, k, v, pos = layer_case(count, capacity, num_q, head_dim)
        mean = int(round(count.float().mean().item()))
        uni = torch.full_like(count, mean)
        pos_uni = live_positions(uni, capacity)
        n = count.numel()
        orders = {"flat": torch.arange(n, device=DEVICE),
                  "desc": count.flatten().argsort(descending=True, stable=True),
                  "asc": count.flatten().argsort(stable=True),
                  "shuffled": torch.randperm(n, device=DEVICE,
                                             generator=torch.Generator(device=DEVICE).manual_seed(2))}
        bufs = {}

        def call(tag, q_, k_, v_, pos_, cnt, stat="mass", **cfg):
            buf = bufs.setdefault(tag, torch.zeros(pos_.shape, device=DEVICE))
            cur = torch.full((q_.shape[0],), capacity + 8, dtype=torch.int64, device=DEVICE)  # past every position
            return lambda: da.decode_attention(q_, k_, v_, pos_, cur, scale, stat=stat, length=cnt, dense=True,
                                               stat_into=buf if stat else None, **cfg)

        fns = {"real": call("real", q, k, v, pos, count), "uniform": call("uniform", q, k, v, pos_uni, uni)}
        flats = {}
        for name, order in orders.items():
            flats[name] = flat(q, k, v, pos, count, order)
            fns[name] = call(name, *flats[name])
        for name, cfg in {"sp2": dict(num_splits=2), "st3": dict(num_stages=3), "st3_late": dict(num_stages=3,
                          logit_store="late"), "w8": dict(num_warps=8), "sp2_st3": dict(num_splits=2, num_stages=3)
                          }.items():
            fns[name] = call(name, q, k, v, pos, count, **cfg)
        fns["attn_alone"] = call("attn", q, k, v, pos, count, stat=None)
        # the same values whatever the order or knobs: outputs checked against the engine order's
        ref = fns["real"]()[0].float()
        checks = {}
        for name, order in orders.items():
            out = fns[name]()[0].float()  # [S x Hkv, group, D] in ``order``
            back = torch.empty_like(out)
            back[order] = out
            checks[name] = float((back.view_as(ref) - ref).abs().max())
        for name in ("sp2", "st3", "st3_late", "w8", "sp2_st3", "attn_alone"):
            checks[name] = float((fns[name]()[0].float() - ref).abs().max())
        times = interleaved(fns, args.rounds)
        live_bytes = 2 * count.sum().item() * head_dim * 2
        floor_us = live_bytes / bandwidth * 1e6
        row = {"mean_count": mean, "std": count.float().std().item(), "floor_us": floor_us,
               "us": {name: t * 1e3 for name, t in times.items()},
               "over_floor": {name: t * 1e3 / floor_us for name, t in times.items()}, "max_abs_diff": checks}
        result["layers"][layer] = row
        print(layer, mean, round(row["std"], 1), f"floor {floor_us:.1f} us",
              " ".join(f"{k_} {v_:.1f}" for k_, v_ in row["us"].items()), flush=True)
        print("  checks", checks, flush=True)
        bufs.clear()
        del fns, flats, q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "hardkv_rows_probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
