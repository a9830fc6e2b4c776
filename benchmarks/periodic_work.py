"""Benchmark: the periodic policy work (``cache.compress_slots``: policy.compress + compact, every layer) that runs
between CUDA-graph replays, per compression event and as a share of the decode time over its interval.

A developer micro-benchmark on a synthetic cache (``kvroll bench`` reports the share measured inside real engine runs);
it adds the compress/compact split, fast-path checks, the R-KV kernel sweep and a profile.

    PYTHONPATH=. python benchmarks/periodic_work.py --step-ms 30 --out docs/benchmarks/periodic_work.json
    PYTHONPATH=. python benchmarks/periodic_work.py --tiny --out /tmp/periodic_tiny.json     # CPU smoke run

A synthetic ``CompressedKVCache`` (defaults: Qwen3-1.7B's 28 layers, 8 KV / 16 query heads, head_dim 128;
256 slots, budget 1024, bf16 on CUDA) starts full of random K/V at positions 0 .. capacity - 1 with random
policy state (query ring, votes). Each event: the engine's periodic step (due slots -> ``compress_slots`` ->
steps until the next event), timed with a device sync on both sides; then the cache is refilled as decode would
(random K/V appended at the next positions, votes accumulated, the query ring rewritten) for exactly those
steps. ``--warmup`` events first (the cache reaches its steady state: LagKV's compressed region, Hard-KV's
temperatures), then ``--events`` timed ones. Reported per policy: every event's ms (the first includes Hard-KV's
one-time calibration), the median of the timed ones, the interval (decode steps between events), the share of
decode time ``median / (interval x --step-ms)``, a compress/compact split (one extra event with a sync per
layer), and the peak memory above the cache (``torch.cuda.max_memory_allocated``). ``h2o`` has no periodic
work (it evicts inside the decode step) and is reported as such. ``--check`` compares the fast R-KV redundancy
and the bf16 window logits with their fp32 references on a few rows of the real cache; on CUDA, ``--sweep-rkv``
times the three redundancy kernels alone (the slot-ordered one that the engine's caches use, the full-matrix one and
the symmetric half-matrix one) over the same block configurations, checks their determinism and agreement, and
times the C x C reference on 32 rows (``--profile``: the top CUDA kernels of one event):

    PYTHONPATH=. python benchmarks/periodic_work.py --policies rkv --step-ms 30 --out /tmp/rkv_sweep.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvroll.policies.rkv as rkv_policy
from kvroll import CompressionConfig
from kvroll.bench.report import write_json
from kvroll.rollout.cache import CompressedKVCache

POLICIES = ("rkv", "lagkv", "hardkv", "snapkv", "h2o")
# --tiny: shapes and hyperparameters scaled down so every policy compresses on a CPU in seconds
TINY_KWARGS = {"rkv": {"buffer": 16, "window": 4}, "snapkv": {"buffer": 16, "window": 8},
               "lagkv": {"sink_tokens": 4, "lag": 8}, "hardkv": {"interval": 16, "window": 8, "sink_tokens": 2}}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_cache(args, name, kwargs, device, dtype) -> CompressedKVCache:
    """A full cache: every slot of every head live, positions 0 .. capacity - 1, random K/V and state."""
    policy = CompressionConfig(policy=name, budget=args.budget, **kwargs).build()
    policy.num_q_heads = args.q_heads
    capacity = policy.capacity(args.budget, 0)
    cache = CompressedKVCache(args.layers, args.slots, args.kv_heads, capacity, args.head_dim, dtype, device,
                              policy, args.budget, scale=args.head_dim ** -0.5)
    gen = torch.Generator(device=device).manual_seed(0)
    for layer in range(args.layers):  # one layer at a time: no full-size fp32 temporary
        cache.k[layer].copy_(torch.randn(cache.k.shape[1:], generator=gen, device=device))
        cache.v[layer].copy_(torch.randn(cache.v.shape[1:], generator=gen, device=device))
    cache.pos.copy_(torch.arange(capacity, device=device, dtype=torch.int32).expand_as(cache.pos))
    cache.count.fill_(capacity)
    cache.write_idx.fill_(capacity - 1)
    cache.cur_pos.fill_(capacity)
    refresh_state(cache, gen, steps=capacity)
    return cache


def refresh_state(cache, gen, steps: int) -> None:
    """What ``steps`` decode steps leave in the policy state: a rewritten query ring, accumulated votes."""
    state = cache.state
    if "queries" in state:
        for layer in range(cache.num_layers):
            state["queries"][layer].copy_(torch.randn(state["queries"].shape[1:], generator=gen,
                                                      device=cache.k.device))
    if "votes" in state:  # attention mass per step: each query's group spreads ~group units over the live tokens
        live = (cache.pos >= 0).float()
        state["votes"].add_(torch.rand(state["votes"].shape, generator=gen, device=cache.k.device)
                            .pow_(4).mul_(live).mul_(steps / live.sum(-1, keepdim=True).clamp_min(1)))


def append_tokens(cache, steps: int, gen) -> None:
    """Decode ``steps`` tokens into every slot: random K/V at each head's next free slots, next positions."""
    device, dim = cache.k.device, cache.head_dim
    offs = torch.arange(steps, device=device)
    for layer in range(cache.num_layers):
        idx = (cache.count[layer][..., None] + offs).clamp(max=cache.capacity - 1)  # [S, Hkv, steps]
        new_pos = (cache.cur_pos[:, None, None] + offs).to(torch.int32).expand_as(idx)
        cache.pos[layer].scatter_(2, idx, new_pos)
        idx_d = idx[..., None].expand(-1, -1, -1, dim)
        shape = (*idx.shape, dim)
        cache.k[layer].scatter_(2, idx_d, torch.randn(shape, generator=gen, device=device).to(cache.k.dtype))
        cache.v[layer].scatter_(2, idx_d, torch.randn(shape, generator=gen, device=device).to(cache.v.dtype))
    cache.count.add_(steps).clamp_(max=cache.capacity)
    cache.write_idx.copy_(cache.count.clamp(max=cache.capacity - 1))
    cache.cur_pos.add_(steps)
    refresh_state(cache, gen, steps)


def periodic_step(cache) -> int:
    """The engine's ``_periodic_work`` on every slot: compress the due ones, return the steps to the next event."""
    due = cache.due_for_compression()
    if bool(due.any()):
        cache.compress_slots(due.nonzero()[:, 0])
    return max(1, int(cache.steps_until_due().min()))


def split_event(cache) -> tuple[float, float]:
    """(compress ms, compact ms) of one event, summed over layers with a sync around each phase."""
    device, slots = cache.k.device, cache.due_for_compression().nonzero()[:, 0]
    compress = compact = 0.0
    for layer in range(cache.num_layers):
        sync(device)
        t0 = time.perf_counter()
        keep_idx, keep_count = cache.policy.compress(cache, layer, slots)
        sync(device)
        t1 = time.perf_counter()
        cache.compact(layer, slots, keep_idx, keep_count)
        sync(device)
        compress, compact = compress + t1 - t0, compact + time.perf_counter() - t1
    return 1e3 * compress, 1e3 * compact


def check_fast_paths(cache, rows: int = 2) -> dict:
    """Max abs error of the fast R-KV redundancy and the window logits against their references (layer 0)."""
    from kvroll.policies.rkv import rkv_redundancy, rkv_redundancy_fast
    from kvroll.policies.window import window_logits

    k, pos = cache.k[0, :rows], cache.pos[0, :rows]
    fast = rkv_redundancy_fast(k, pos >= 0, pos, 0.5, 1)
    ref = rkv_redundancy(k, pos >= 0, pos, 0.5, 1)
    out = {"redundancy_max_abs": float((fast - ref).abs().max()), "redundancy_ref_max": float(ref.abs().max())}
    if "queries" in cache.state:
        q = cache.state["queries"][0, :rows].transpose(1, 2)  # [rows, Hq, W, D]
        n, num_q_heads, window, dim = q.shape
        qg = q.float().view(n, cache.num_kv_heads, num_q_heads // cache.num_kv_heads, window, dim)
        want = torch.einsum("nhgwd,nhcd->nhgwc", qg, k.float())
        out["window_logits_max_abs"] = float((window_logits(q, k) - want).abs().max())
        out["window_logits_ref_max"] = float(want.abs().max())
    return out


# (block_u, block_v, warps, stages), timed for both kernels; the last two added for the symmetric one (square
# tiles waste less on the diagonal, 8 warps ease its register pressure)
RKV_CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3), (128, 64, 8, 2),
               (128, 128, 8, 2), (32, 32, 4, 2), (64, 64, 8, 2)]
# label (the keys' prefix) -> rkv_redundancy_triton keyword arguments
RKV_KERNELS = {"rows": dict(kernel="rows"), "symmetric": dict(kernel="symmetric"), "ordered": dict(kernel="ordered")}


def time_ms(fn, device, reps: int = 5) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def sweep_rkv(cache, ref_rows: int = 32, reps: int = 10) -> dict:
    """The redundancy kernels alone on layer 0 (all rows): the full-matrix one (``rows_*``), the half-matrix one
    (``symmetric_*``) and the slot-ordered one (``ordered_*``) per (block_u, block_v, warps, stages), each one's
    best config and the speedups over "rows"; whether two symmetric calls are bitwise equal and how far each is
    from "rows"; and the C x C reference against all three on the first ``ref_rows`` rows (the reference cannot
    hold all of them)."""
    from kvroll.kernels.rkv_redundancy import rkv_redundancy_triton
    from kvroll.policies.rkv import rkv_redundancy

    device, k, pos = cache.k.device, cache.k[0], cache.pos[0]
    live = pos >= 0
    out = {}
    for kernel, kw in RKV_KERNELS.items():
        for bu, bv, warps, stages in RKV_CONFIGS:
            fn = lambda: rkv_redundancy_triton(k, live, pos, 0.5, 1, bu, bv, num_warps=warps,  # noqa: E731
                                               num_stages=stages, **kw)
            out[f"{kernel}_all_rows_bu{bu}_bv{bv}_w{warps}_s{stages}_ms"] = time_ms(fn, device, reps)
        best = min((key for key in out if key.startswith(f"{kernel}_all_rows_")), key=out.get)
        out[f"{kernel}_best"], out[f"{kernel}_best_ms"] = best, out[best]
        out[f"{kernel}_default_cfg_ms"] = time_ms(lambda: rkv_redundancy_triton(k, live, pos, 0.5, 1, **kw),
                                                  device, reps)
        out[f"{kernel}_speedup_best_vs_rows_best"] = out["rows_best_ms"] / out[f"{kernel}_best_ms"]
    base = rkv_redundancy_triton(k, live, pos, 0.5, 1, kernel="rows")
    for kernel, kw in RKV_KERNELS.items():
        got = rkv_redundancy_triton(k, live, pos, 0.5, 1, **kw)
        out[f"{kernel}_bitwise_deterministic"] = bool(torch.equal(got, rkv_redundancy_triton(k, live, pos, 0.5, 1,
                                                                                            **kw)))
        out[f"{kernel}_vs_rows_max_abs"] = float((got - base).abs().max())
    rows = min(ref_rows, k.shape[0])
    k, live, pos = k[:rows], live[:rows], pos[:rows]
    for kernel, kw in RKV_KERNELS.items():
        fn = lambda: rkv_redundancy_triton(k, live, pos, 0.5, 1, **kw)  # noqa: E731
        out[f"{kernel}_{rows}_rows_ms"] = time_ms(fn, device, reps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ref = rkv_redundancy(k, live, pos, 0.5, 1)
    out[f"reference_{rows}_rows_ms"] = time_ms(lambda: rkv_redundancy(k, live, pos, 0.5, 1), device, reps=2)
    if device.type == "cuda":
        out[f"reference_{rows}_rows_extra_gib"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    for kernel, kw in RKV_KERNELS.items():
        got = rkv_redundancy_triton(k, live, pos, 0.5, 1, **kw)
        out[f"{kernel}_{rows}_rows_max_abs_vs_reference"] = float((got - ref).abs().max())
    out[f"reference_{rows}_rows_max"] = float(ref.abs().max())
    return out


def profile_event(cache, top: int = 15) -> dict:
    """torch.profiler over one event on every slot (no state refresh after it): the top CUDA kernels,
    {name: {"ms": per event, "calls": launches}}."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    slots = torch.arange(cache.slots, device=cache.k.device)
    sync(cache.k.device)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        cache.compress_slots(slots)
        sync(cache.k.device)
    rows = []
    for evt in prof.key_averages():
        us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        if us > 0:
            rows.append((evt.key, {"ms": us / 1e3, "calls": evt.count}))
    return dict(sorted(rows, key=lambda kv: -kv[1]["ms"])[:top])


def step_ms_for(step_ms: dict, name: str) -> float | None:
    return step_ms.get(name, step_ms.get("*"))


def run_policy(args, name, device, dtype, step_ms) -> dict:
    kwargs = dict(TINY_KWARGS.get(name, {}) if args.tiny else {}, **args.policy_kwargs.get(name, {}))
    if not CompressionConfig(policy=name, budget=args.budget, **kwargs).build().periodic:
        return {"periodic": False, "note": "no periodic work: evicts one token per decode step inside the step"}
    cache = build_cache(args, name, kwargs, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    result = {"periodic": True, "kwargs": kwargs, "capacity": cache.capacity,
              "cache_gib": (cache.kv_bytes() + cache.metadata_bytes()) / 2**30}
    if args.check and name in ("rkv", "hardkv", "snapkv"):
        result["check"] = check_fast_paths(cache)
    if args.sweep_rkv and name == "rkv" and device.type == "cuda":
        result["rkv_redundancy_sweep"] = sweep = sweep_rkv(cache)
        for kernel in RKV_KERNELS:
            print(f"rkv redundancy kernel {kernel}, layer 0: {sweep[f'{kernel}_best_ms']:.2f} ms "
                  f"({sweep[f'{kernel}_best']}; default cfg {sweep[f'{kernel}_default_cfg_ms']:.2f} ms), "
                  f"{sweep[f'{kernel}_speedup_best_vs_rows_best']:.2f}x rows; deterministic "
                  f"{sweep[f'{kernel}_bitwise_deterministic']}, max |{kernel} - rows| "
                  f"{sweep[f'{kernel}_vs_rows_max_abs']:.1e}", flush=True)
    events, intervals, extra = [], [], []
    for _ in range(args.warmup + args.events):
        sync(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        steps = periodic_step(cache)
        sync(device)
        events.append(1e3 * (time.perf_counter() - start))
        if device.type == "cuda":
            extra.append((torch.cuda.max_memory_allocated(device) - base) / 2**30)
        intervals.append(steps)
        append_tokens(cache, steps, gen)
    timed = events[args.warmup:]
    median, interval = statistics.median(timed), statistics.median(intervals[args.warmup:])
    compress_ms, compact_ms = split_event(cache)
    if args.profile and device.type == "cuda":
        result["profile"] = profile_event(cache)
        print(f"{name} profile, ms per event: " + ", ".join(f"{k[:60]} {v['ms']:.1f} ({v['calls']})"
                                                            for k, v in result["profile"].items()), flush=True)
    per_step = step_ms_for(step_ms, name)
    result.update(events_ms=events, first_ms=events[0], median_ms=median, interval_steps=interval, intervals=intervals,
                  ms_per_interval_step=median / interval, compress_ms=compress_ms, compact_ms=compact_ms,
                  pct_of_decode=None if per_step is None else 100 * median / (interval * per_step),
                  step_ms=per_step, peak_extra_gib=max(extra) if extra else None,
                  peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    del cache
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def parse_step_ms(text: str | None) -> dict:
    """'30' (every policy) or 'rkv=31,lagkv=28' (per policy) -> {name or '*': ms}."""
    if not text:
        return {}
    if "=" not in text:
        return {"*": float(text)}
    return {key.strip(): float(value) for key, value in (item.split("=") for item in text.split(","))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policy names")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--slots", type=int, default=256, help="batch rows compressed per event")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--dtype", default=None, help="bfloat16 (CUDA default) or float32 (CPU default)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--warmup", type=int, default=2, help="untimed events first (steady state)")
    ap.add_argument("--events", type=int, default=3, help="timed events")
    ap.add_argument("--step-ms", default=None,
                    help="decode step time in ms, one value or per policy ('rkv=31,lagkv=28'), for the share")
    ap.add_argument("--policy-kwargs", default="{}", help='JSON {policy: {hyperparameter: value}}')
    ap.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="compare the fast R-KV redundancy and window logits with their fp32 references")
    ap.add_argument("--sweep-rkv", action=argparse.BooleanOptionalAction, default=True,
                    help="on CUDA: time the R-KV redundancy kernels (ordered, rows, symmetric) alone over block "
                         "configs, and the C x C reference on 32 rows")
    ap.add_argument("--rkv-kernel", default="auto", choices=("auto", "ordered", "rows", "symmetric"),
                    help="the redundancy kernel of R-KV's events (kvroll.policies.rkv.RKV_KERNEL; the engine's "
                         "is auto)")
    ap.add_argument("--profile", action="store_true",
                    help="on CUDA: torch.profiler over one more event, the top kernels in ms per event")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and hyperparameters (CPU smoke test)")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    args.policy_kwargs = json.loads(args.policy_kwargs)
    if args.tiny:
        args.layers, args.slots, args.kv_heads, args.q_heads, args.head_dim, args.budget = 2, 3, 2, 4, 16, 64
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    step_ms = parse_step_ms(args.step_ms)
    rkv_policy.RKV_KERNEL = args.rkv_kernel  # read by rkv_redundancy_fast at call time
    shape = {k: getattr(args, k) for k in ("layers", "slots", "kv_heads", "q_heads", "head_dim", "budget")}
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": str(dtype), "shape": shape, "rkv_kernel": args.rkv_kernel, "torch": torch.__version__,
              "results": {}}
    for name in args.policies.split(","):
        result = report["results"][name] = run_policy(args, name, device, dtype, step_ms)
        if result["periodic"]:
            pct = result["pct_of_decode"]
            print(f"{name:8s} {result['median_ms']:9.2f} ms/event  interval {result['interval_steps']:5.0f} steps  "
                  f"{'' if pct is None else f'{pct:5.1f}% of decode  '}compress {result['compress_ms']:.1f} ms  "
                  f"compact {result['compact_ms']:.1f} ms  extra mem {result['peak_extra_gib'] or 0:.2f} GiB  "
                  f"events {[round(t, 1) for t in result['events_ms']]}", flush=True)
        else:
            print(f"{name:8s} {result['note']}", flush=True)
    if args.out:
        write_json(args.out, report)


if __name__ == "__main__":
    main()
