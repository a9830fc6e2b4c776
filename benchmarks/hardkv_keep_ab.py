"""Hard-KV's keep kernel (``kvroll/kernels/hardkv_keep.py``, session 35) by the warps of a program (``WARPS``), on one
layer of an engine-sized event.

    PYTHONPATH=.:benchmarks python benchmarks/hardkv_keep_ab.py --out OUT [--slots 256,64] [--warps 4,8,16,2]

A layer's rows as the engine holds them at an event (Qwen3-1.7B: 8 KV heads; budget 1,024 + interval 128 = 1,152
slots, each head live on a prefix of 700-800, heavy-tailed votes, calibrated temperatures 0.5-2), Hard-KV's defaults
(p = 0.9, window 32, 4 sinks, min_keep 8), hole-filling order. Each variant's output must equal the first variant's
(the same search, other reductions: a difference is a rounding at the edge of p, counted), and the first's keep sets
are checked against the torch path's (``keep_kernel = False``) on the same rows. Times: CUDA graphs of 10 calls,
medians over rotated rounds (``kernel_decode.interleaved``), µs per layer. Writes hardkv_keep_ab.json.
"""
from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import torch

from kvroll.bench.report import write_json
from kvroll.kernels import hardkv_keep as hk
from kvroll.policies.hardkv import HardKVParams, HardKVPolicy

try:
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.hardkv_keep_ab
    from benchmarks.kernel_decode import interleaved

HEADS = 8


def event_cache(slots: int, budget: int, seed: int, device: str) -> SimpleNamespace:
    """Hard-KV's defaults at ``budget`` (capacity budget + 128), each head live on a prefix of 68-78% of it."""
    cap = budget + 128
    gen = torch.Generator().manual_seed(seed)
    live = torch.randint(cap * 68 // 100, cap * 78 // 100 + 1, (1, slots, HEADS), generator=gen)
    pos = torch.arange(cap, dtype=torch.int32).expand(1, slots, HEADS, cap).clone()
    pos = pos.masked_fill(torch.arange(cap) >= live[..., None], -1)
    votes = (torch.randn(1, slots, HEADS, cap, generator=gen) * 2).exp() * (pos >= 0)
    cache = SimpleNamespace(num_layers=1, slots=slots, num_kv_heads=HEADS, capacity=cap, budget=budget,
                            k=torch.zeros(1, slots, HEADS, cap, 1), pos=pos, time_ordered=True, kernel_on_cpu=False,
                            cur_pos=live.amax(-1)[0] + 1)
    policy = HardKVPolicy(HardKVParams())
    cache.state = policy.init_state(cache)
    cache.state["votes"].copy_(votes)
    cache.state["temp"].copy_(0.5 + 1.5 * torch.rand(1, slots, HEADS, generator=gen))
    for key, value in list(vars(cache).items()):
        if isinstance(value, torch.Tensor):
            setattr(cache, key, value.to(device))
    cache.state = {key: value.to(device) for key, value in cache.state.items()}
    cache.event_counts = [1] * slots
    return cache


def sets(idx, count):
    idx, count = idx.long().cpu(), count.cpu()
    return [[frozenset(idx[r, h, : int(count[r, h])].tolist()) for h in range(idx.shape[1])]
            for r in range(idx.shape[0])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--slots", default="256,64")
    ap.add_argument("--warps", default="4,8,16,2")
    ap.add_argument("--budgets", default="1024", help="Hard-KV budgets (capacity: + 128)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    variants = [int(w) for w in args.warps.split(",")]
    rows = []
    shapes = [(int(s), int(b)) for b in args.budgets.split(",") for s in args.slots.split(",")]
    for slots, budget in shapes:
        cache = event_cache(slots, budget, seed=slots, device="cuda")
        policy = HardKVPolicy(HardKVParams())
        slot_ids = torch.arange(slots, device="cuda")
        policy.keep_kernel = False
        want = sets(*policy.compress(cache, 0, slot_ids))
        torch_us = interleaved({"torch": lambda: policy.compress(cache, 0, slot_ids)}, args.rounds)["torch"] * 1e3
        policy.keep_kernel = True
        calls, outs = {}, {}
        for warps in variants:
            hk.WARPS = warps
            outs[warps] = sets(*policy.compress(cache, 0, slot_ids))

            def call(warps=warps):
                hk.WARPS = warps  # read at launch: the graph captures this variant's kernel
                policy.compress(cache, 0, slot_ids)
            calls[str(warps)] = call
        first = outs[variants[0]]
        torch_diff = sum(a != b for ra, rb in zip(first, want) for a, b in zip(ra, rb))
        times = interleaved(calls, args.rounds)
        for warps, got in outs.items():
            diff = sum(a != b for ra, rb in zip(got, first) for a, b in zip(ra, rb))
            rows.append({"slots": slots, "budget": budget, "warps": warps, "us": times[str(warps)] * 1e3,
                         "torch_us": torch_us, "rows_differing_from_first": diff,
                         "first_rows_differing_from_torch": torch_diff})
            print(f"slots {slots} budget {budget} warps {warps:2d}: {times[str(warps)] * 1e3:8.1f} us a layer (the "
                  f"call with its index ops; torch path {torch_us:8.1f}); rows != first {diff}; first != torch "
                  f"{torch_diff} of {slots * HEADS}")
        hk.WARPS = variants[0]
    write_json(os.path.join(args.out, "hardkv_keep_ab.json"), rows)


if __name__ == "__main__":
    main()
