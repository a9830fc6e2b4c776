"""Benchmark: the steady-state decode step of an evicting policy against its roofline floor, and where it goes.

A developer tool (the user-facing step-vs-floor table is ``kvroll bench``'s, from real runs): it jumps straight to the
steady state at several batches and profiles the step's kernels; model, bandwidth and byte counts come from
``kvroll.bench``.

    PYTHONPATH=. python benchmarks/decode_roofline.py --policy longflow --budget 3200 --batches 64,128,256,352 \
        --out $OUT/roofline.json

Qwen3-1.7B architecture, random weights, bf16, on CUDA. For each batch the engine's cache is put straight into the
steady state the real run reaches after ``budget`` tokens (every slot of every head live, random K/V, positions
0 .. capacity - 1, the decoded position far past them, so every non-sink slot outside the recent window may be
evicted): no multi-minute fill. Then ``--steps`` decode steps replay the captured CUDA graph (tokens are sampled,
each step evicts and writes, as in generation) and the median step time is compared with the floor
(weight bytes + live KV bytes read) / copy bandwidth measured in the same run. The K/V values are random, so the
evicted slot differs from a real run's; the bytes and the work per step are the same.

``--profile`` also records one batch's steps with ``torch.profiler`` (eager, and the graph replay when CUPTI
traces graph kernels) and groups kernel time into attention, GEMM, cache writes, norms / rotary / elementwise and
sampling, so the gap to the floor has names.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.bench.measure import copy_bandwidth, free_memory
from kvroll.bench.models import build_model, kv_bytes_per_token, weight_bytes
from kvroll.bench.report import write_json
from kvroll.kernels.cache_write import value_norm

GROUPS = (  # kernel-name fragment -> group (first match wins)
    ("_decode_split_kernel", "attention kernel"), ("_decode_merge_kernel", "attention kernel"),
    ("gemm", "GEMM"), ("gemv", "GEMM"), ("cutlass", "GEMM"), ("sm90_xmma", "GEMM"), ("nvjet", "GEMM"),
    ("scatter", "cache writes"), ("index", "cache writes / gathers"),
    ("softmax", "sampling"), ("exponential", "sampling"), ("argmax", "sampling"), ("log_softmax", "sampling"),
    ("distribution", "sampling"), ("reduce", "reductions (norms, sampling)"), ("elementwise", "elementwise"),
    ("vectorized", "elementwise"), ("copy", "copies / casts"), ("cat", "copies / casts"),
)


def steady_state(engine: RolloutEngine, far: int) -> None:
    """Every slot live with random K/V at positions 0 .. capacity - 1; decoding position ``far``."""
    cache = engine.cache
    cache.k.normal_()
    cache.v.normal_()
    if cache.vnorm is not None:
        for layer in range(cache.num_layers):  # per layer: an fp32 copy of all of V would not fit
            cache.vnorm[layer].copy_(value_norm(cache.v[layer]))
    cache.pos.copy_(torch.arange(cache.capacity, device=cache.pos.device, dtype=torch.int32))
    cache.count.fill_(cache.capacity)
    cache.write_idx.fill_(0)
    cache.cur_pos.fill_(far)


def time_steps(runner, batch: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        runner.step(batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for frag, g in GROUPS if frag in low), "other")


def profile(runner, batch: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    out = {}
    for mode in ("eager", "graph"):
        graph = runner.graphs.pop(batch) if mode == "eager" else None
        try:
            runner.step(batch)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    runner.step(batch)
                torch.cuda.synchronize()
        finally:
            if graph is not None:
                runner.graphs[batch] = graph
        kernels, groups = {}, {}
        for evt in prof.key_averages():
            us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            if us <= 0:
                continue
            kernels[evt.key] = {"ms_per_step": us / 1e3 / steps, "calls_per_step": evt.count / steps}
            g = group_of(evt.key)
            groups.setdefault(g, {"ms_per_step": 0.0, "calls_per_step": 0.0})
            groups[g]["ms_per_step"] += us / 1e3 / steps
            groups[g]["calls_per_step"] += evt.count / steps
        top = sorted(kernels.items(), key=lambda kv: -kv[1]["ms_per_step"])[:25]
        out[mode] = {"groups": groups, "top_kernels": dict(top),
                     "kernel_ms_per_step": sum(v["ms_per_step"] for v in kernels.values()),
                     "kernels_per_step": sum(v["calls_per_step"] for v in kernels.values())}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="longflow")
    ap.add_argument("--budget", type=int, default=3200)
    ap.add_argument("--batches", default="64,128,256,352")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", type=int, default=352, help="batch to profile (0: none)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.time()
    model = build_model(None, "qwen3-1.7b", torch.bfloat16, torch.device("cuda"), seed=0)
    weights = weight_bytes(model)
    bandwidth = copy_bandwidth("cuda")
    per_token = kv_bytes_per_token(model)
    result = {"gpu": torch.cuda.get_device_name(), "policy": args.policy, "budget": args.budget,
              "bandwidth": bandwidth, "weight_bytes": weights, "rows": []}
    print(f"{result['gpu']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s, weights {weights / 1e9:.2f} GB",
          flush=True)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True, seed=0)
    for batch in [int(b) for b in args.batches.split(",")]:
        engine = RolloutEngine(model, compression=CompressionConfig(args.policy, budget=args.budget),
                               max_batch=batch)
        runner = engine._decode_runner(params)
        steady_state(engine, far=8 * engine.cache.capacity)
        runner.tokens.random_(1, model.config.vocab_size)
        time_steps(runner, batch, 3)
        steps = time_steps(runner, batch, args.steps)
        live = float(engine.cache.count.float().mean())
        floor_ms = (weights + batch * live * per_token) / bandwidth * 1e3
        kv_ms = batch * live * per_token / bandwidth * 1e3
        row = {"batch": batch, "capacity": engine.cache.capacity, "live": live, "step_ms": statistics.median(steps),
               "step_ms_all": steps, "floor_ms": floor_ms, "kv_floor_ms": kv_ms}
        row["over_floor"] = row["step_ms"] / floor_ms
        row["tok_s"] = batch / row["step_ms"] * 1e3
        assert int(engine.cache.count.min()) == engine.cache.capacity  # still the steady state
        if batch == args.profile:
            row["profile"] = profile(runner, batch, 5)
            for mode, prof in row["profile"].items():
                print(f"  profile ({mode}): {prof['kernel_ms_per_step']:.2f} ms of kernels per step, "
                      f"{prof['kernels_per_step']:.0f} kernels", flush=True)
                for g, v in sorted(prof["groups"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
                    print(f"    {g:32s} {v['ms_per_step']:8.3f} ms  {v['calls_per_step']:6.0f} calls", flush=True)
        result["rows"].append(row)
        print(f"batch {batch}: step {row['step_ms']:.2f} ms, floor {floor_ms:.2f} ms (KV {kv_ms:.2f}), "
              f"{row['over_floor']:.3f}x floor, {row['tok_s']:.0f} tok/s", flush=True)
        del engine, runner
        free_memory()
    result["seconds"] = time.time() - t0
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
