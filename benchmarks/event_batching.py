"""Benchmark: layer-batched compression events (``CompressedKVCache.layer_batch_rows``) against layer-by-layer ones.

An R-KV / SnapKV event on few slots runs the same handful of small kernels once per layer (28 times for Qwen3-1.7B),
each over 1-2 rows; batched, ``layer_batch_rows // n`` layers share each call. This times one event as the engine
replays it (``EventGraphs``: a CUDA graph over a static slot index, no event span), per slot count n, with
``layer_batch_rows`` 0 (per layer) and the given values ("auto": the default, rows from ``layer_batch_elems``),
and checks on the real shape that the batched event leaves
the cache bit for bit as the per-layer one does (bf16 on CUDA).

    PYTHONPATH=. python benchmarks/event_batching.py --out /tmp/event_batching.json
    PYTHONPATH=. python benchmarks/event_batching.py --tiny --out /tmp/event_batching_tiny.json   # CPU smoke run
    PYTHONPATH=. python benchmarks/event_batching.py --policies rkv --layers 30 --kv-heads 3 --q-heads 9 \
        --head-dim 64 --budget 46 --policy-kwargs '{"rkv": {"buffer": 8}}' --rows auto,64   # the fidelity study's

Each timed point: the graph replayed ``--iters`` times between two CUDA events after ``--warmup`` replays; the same
slots are compressed over and over (an event's kernels and shapes do not depend on what the slots hold). On CPU (no
graphs) the event runs eagerly.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from periodic_work import TINY_KWARGS, build_cache  # noqa: E402

from kvroll.bench.report import write_json  # noqa: E402
from kvroll.kernels import snapkv_scores as snapkv_kernel  # noqa: E402

FIELDS = ("k", "v", "pos", "count", "write_idx")


def event_fn(cache, slots):
    """A callable running one event over ``slots`` as the engine does: a CUDA graph on CUDA, eager on CPU."""
    if slots.device.type != "cuda":
        return lambda: cache.compress_index(slots)
    cache.compress_index(slots)  # compile / warm the kernels of this count
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        try:
            cache.compress_index(slots)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph.replay


def time_ms(fn, warmup: int, iters: int, device) -> float:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def check_equal(args, name, kwargs, device, dtype, rows: int, count: int) -> bool:
    """One event on ``count`` scattered slots, batched vs per layer, from the same random full cache."""
    caches = []
    for batch_rows in (0, rows):
        cache = build_cache(args, name, kwargs, device, dtype)
        cache.layer_batch_rows = batch_rows
        gen = torch.Generator().manual_seed(count)
        slots = torch.randperm(args.slots, generator=gen)[:count].to(device)
        cache.compress_index(slots)
        caches.append(cache)
    return all(torch.equal(getattr(caches[0], f), getattr(caches[1], f)) for f in FIELDS)


def key(batch_rows) -> str:
    return "rows_auto" if batch_rows is None else f"rows{batch_rows}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="rkv,snapkv")
    ap.add_argument("--counts", default="1,2,4,8,16,32,64", help="slots per event")
    ap.add_argument("--rows", default="auto", help="layer_batch_rows values compared with 0 (per layer); auto: "
                    "the default (from layer_batch_elems)")
    ap.add_argument("--policy-kwargs", default="{}", help='JSON {policy: {hyperparameter: value}}')
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--slots", type=int, default=64, help="cache slots (an event takes up to this many)")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--snapkv-kernel", action=argparse.BooleanOptionalAction, default=True,
                    help="SnapKV's window scores in one Triton kernel (kvroll/kernels/snapkv_scores.py; "
                    "--no-snapkv-kernel: the torch path)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tiny:
        args.layers, args.slots, args.kv_heads, args.q_heads, args.head_dim, args.budget = 4, 8, 2, 4, 16, 48
        args.counts, args.warmup, args.iters = "1,2,4", 1, 2
    snapkv_kernel.enabled = args.snapkv_kernel
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    counts = [int(c) for c in args.counts.split(",")]
    rows_list = [None if r == "auto" else int(r) for r in args.rows.split(",")]
    results = []
    for name in args.policies.split(","):
        kwargs = TINY_KWARGS.get(name, {}) if args.tiny else json.loads(args.policy_kwargs).get(name, {})
        cache = build_cache(args, name, kwargs, device, dtype)
        for count in counts:
            slots = torch.randperm(args.slots, generator=torch.Generator().manual_seed(count))[:count].to(device)
            row = {"policy": name, "slots": count}
            for batch_rows in [0] + rows_list:
                cache.layer_batch_rows = batch_rows
                row[f"ms_{key(batch_rows)}"] = round(time_ms(event_fn(cache, slots), args.warmup, args.iters,
                                                             device), 4)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the graph's pool, before the next capture or the check's caches
            for batch_rows in rows_list:
                row[f"speedup_{key(batch_rows)}"] = round(row["ms_rows0"] / row[f"ms_{key(batch_rows)}"], 3)
                row[f"equal_{key(batch_rows)}"] = check_equal(args, name, kwargs, device, dtype, batch_rows, count)
            results.append(row)
            print(json.dumps(row), flush=True)
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = {"device": device_name, "torch": torch.__version__, "args": vars(args), "results": results}
    if args.out:
        write_json(args.out, out)


if __name__ == "__main__":
    main()
