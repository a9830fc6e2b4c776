"""Benchmark: one periodic compression event as the engine runs it, by kernel (developer A/B tool).

    PYTHONPATH=. python benchmarks/event_profile.py --out /tmp/event_profile.json            # CUDA
    PYTHONPATH=old:. python benchmarks/event_profile.py --label old --out /tmp/old.json      # another kvroll

A synthetic cache (``periodic_work.build_cache``: Qwen3-1.7B's 8 KV / 16 query heads, head_dim 128, budget
1,024, ``--layers`` layers, full of random K/V) is brought to its steady state by ``--warmup`` events, with decode
appends between them. Then one event on every slot, as the engine's host schedule runs it (one contiguous span;
Hard-KV told that every slot is calibrated and LagKV each slot's compressed count, ``cache.event_counts``: its
graphed event is shaped by them), is timed from the same snapshot of the
cache ``--reps`` times (wall clock around ``compress_index``, a device sync on both sides, eager: launch gaps
included) and once under the profiler (the device time of its kernels, about what a graph replay of the event
costs, and the top kernels). A checksum of the cache after the event (live positions, live K) lets two runs
(``--label``) of different code show that they kept the same tokens. Per-event numbers scale with the layers: multiply by 28 / ``--layers``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import types

import torch

from benchmarks.periodic_work import append_tokens, build_cache, periodic_step, sync
from kvroll.bench.measure import _seconds as seconds
from kvroll.rollout.graphs import EventGraphs


def snapshot(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tensors = [cache.k, cache.v, cache.pos, cache.count, cache.write_idx, cache.cur_pos, *cache.state.values()]
    if cache.vnorm is not None:
        tensors.append(cache.vnorm)
    return [(t, t.clone()) for t in tensors if isinstance(t, torch.Tensor)]


def restore(saved) -> None:
    for t, copy in saved:
        t.copy_(copy)


class Event:
    """One event on every slot, run one of three ways: ``span`` (eager, the slots as one contiguous span: the
    policies read their rows as views), ``index`` (eager, the slots as a device index: what a graph captures,
    rows gathered) or ``graph`` (``EventGraphs``, the engine's path: captured on its second call, replayed)."""

    def __init__(self, cache, mode, sizes=None):
        self.cache, self.mode = cache, mode
        self.sizes = sizes  # the host schedule's per-slot sizes (``event_sizes``)
        self.slots = torch.arange(cache.slots, device=cache.k.device)
        self.graphs = EventGraphs(cache) if mode == "graph" else None

    def __call__(self) -> None:
        cache = self.cache
        cache.event_counts = self.sizes
        try:
            if self.mode == "graph":
                self.graphs.run(list(range(cache.slots)), self.sizes)
            else:
                cache.compress_index(self.slots, slice(0, cache.slots) if self.mode == "span" else None)
        finally:
            cache.event_counts = None


def event_sizes(cache, name):
    """The per-slot sizes the engine's host schedule hands an event (``cache.event_counts``), read from the cache
    as it stands: Hard-KV's (1: every slot calibrated), LagKV's (each slot's compressed count: its graphed event is
    shaped by them), None for the others."""
    if name == "hardkv":
        return [1] * cache.slots
    if name == "lagkv":
        return cache.state["compressed"][0].tolist()
    return None


def checksum(cache) -> dict:
    live = cache.pos >= 0
    return {"live_tokens": int(live.sum()), "pos_sum": int(cache.pos.clamp_min(0).long().sum()),
            "k_live_sum": float((cache.k.float() * live[..., None]).sum())}


def timed(fn, saved, device, reps) -> list[float]:
    """ms per call from the same snapshot: device events on CUDA (what the engine's EventClock reads), else the
    wall clock."""
    times = []
    for _ in range(reps):
        restore(saved)
        sync(device)
        times.append(1e3 * seconds(fn, device))
    return times


def run(name, slots, args) -> dict:
    ns = types.SimpleNamespace(layers=args.layers, slots=slots, kv_heads=8, q_heads=16, head_dim=128,
                               budget=args.budget)
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    cache = build_cache(ns, name, {}, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(args.warmup):
        steps = periodic_step(cache)
        append_tokens(cache, steps, gen)
    if name != "hardkv":  # bring every slot to full, as the host schedule would compress it
        room = int((cache.capacity - cache.count).amax())
        if room:
            append_tokens(cache, room, gen)
    saved = snapshot(cache)
    sizes = event_sizes(cache, name)
    out = {"policy": name, "slots": slots, "layers": args.layers}
    modes = ("span", "index", "graph") if cuda else ("span", "index")
    for mode in modes:
        fn = Event(cache, mode, sizes)
        for _ in range(2):  # warm: Triton compiles; a graph's eager first call and its capture
            restore(saved)
            fn()
        sync(device)
        times = timed(fn, saved, device, args.reps)
        out[f"{mode}_ms"], out[f"{mode}_ms_all"] = statistics.median(times), times
        out[f"{mode}_checksum"] = checksum(cache)
    restore(saved)
    sync(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        fn()  # the last mode: the graph on CUDA
        sync(device)
    kernels = {}
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", 0) if cuda else evt.self_cpu_time_total
        if us > 0:
            kernels[evt.key] = {"us": us, "calls": evt.count}
    total_us = sum(v["us"] for v in kernels.values())
    out.update(profiled=modes[-1], kernel_ms=total_us / 1e3, kernels=sum(v["calls"] for v in kernels.values()),
               per_28_layers={key: out[f"{key}_ms"] * 28 / args.layers for key in modes},
               top=dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:args.top]))
    out["per_28_layers"]["kernels"] = total_us / 1e3 * 28 / args.layers
    del cache, saved
    if cuda:
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="hardkv,rkv,snapkv")
    ap.add_argument("--slots", default="64,256")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--label", default="new")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: 8 slots, budget 64, 2 layers")
    args = ap.parse_args()
    if args.tiny:
        args.slots, args.budget, args.layers, args.reps = "8", 64, 2, 2
    results = []
    for name in args.policies.split(","):
        for slots in map(int, args.slots.split(",")):
            r = run(name, slots, args)
            r["label"] = args.label
            results.append(r)
            per28 = ", ".join(f"{k} {v:.1f}" for k, v in r["per_28_layers"].items())
            same = len({str(r[f"{m}_checksum"]) for m in r["per_28_layers"] if m != "kernels"}) == 1
            print(f"[{args.label}] {name} slots {slots}: ms per event x28/{args.layers} layers: {per28} "
                  f"({r['kernels']} launches profiled in {r['profiled']}); same tokens kept by every mode: {same}; "
                  f"checksum {r['span_checksum']}", flush=True)
            for key, v in r["top"].items():
                print(f"    {v['us'] / 1e3:7.3f} ms {v['calls']:4d}x  {key[:100]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
