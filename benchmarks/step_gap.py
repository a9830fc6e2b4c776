"""Where a graph-replayed decode step's time goes beyond its kernels' device time (LongFlow, H100).

    PYTHONPATH=.:benchmarks python benchmarks/step_gap.py --out OUT [--batches 64,256]

``kvroll bench`` reports a steady step (wall time between host syncs of a real run) and the device time of one
eager step's kernels; at batch 256 the first exceeds the second by ~0.75 ms (session 19). This separates the parts
on a full cache of junk (``kernel_count._fill``): (1) the eager step's kernels summed (``step_kernel_counts``);
(2) back-to-back replays of the captured step, timed with CUDA events (no host work between them); (3) the same
with the engine's three per-step copies into its token history; (4) a profiled window of replays: each replay's
first-kernel-start to last-kernel-end span against the sum of its kernels' durations (the idle time inside the
graph), and the kernels' durations inside the graph against the eager ones. Writes step_gap.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.bench.kernel_count import _fill, step_kernel_counts
from kvroll.bench.models import build_model


def replay_ms(runner, batch: int, steps: int, hist: torch.Tensor | None) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        runner.step(batch)
        if hist is not None:
            hist[0, i % hist.shape[1], :batch] = runner.tokens[:batch]
            hist[1, i % hist.shape[1], :batch] = runner.logprobs[:batch]
            hist[2, i % hist.shape[1], :batch] = runner.finite[:batch]
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def graph_profile(runner, batch: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.step(batch)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.elapsed_us() > 0), key=lambda e: e.time_range.start)
    if not kernels:
        return {"kernels": 0}
    per = len(kernels) // steps
    spans, busy = [], []
    for s in range(steps):
        chunk = kernels[s * per:(s + 1) * per]
        spans.append(chunk[-1].time_range.end - chunk[0].time_range.start)
        busy.append(sum(k.time_range.elapsed_us() for k in chunk))
    by_name: dict = {}
    for k in kernels:
        by_name[k.name] = by_name.get(k.name, 0.0) + k.time_range.elapsed_us() / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"kernels": len(kernels), "kernels_per_step": per, "span_us": sorted(spans)[steps // 2],
            "busy_us": sorted(busy)[steps // 2], "top": [[n[:60], round(us, 1)] for n, us in top]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    dev = torch.device("cuda")
    model = build_model(None, "qwen3-1.7b", torch.bfloat16, dev, seed=0)
    params = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True, seed=0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        engine = RolloutEngine(model, compression=CompressionConfig("longflow", 1024), max_batch=batch)
        runner = engine._decode_runner(params)
        cap = engine.cache.capacity
        eager = step_kernel_counts(engine, params, batch, live=cap)
        _fill(engine.cache, cap)
        hist = torch.empty(3, 16, batch, dtype=torch.float64, device=dev)
        replay_ms(runner, batch, 20, None)  # warm
        row = {"batch": batch, "eager_kernel_us": eager["kernel_us_per_step"],
               "eager_kernels": eager["kernels_per_step"]}
        for rnd in range(2):
            row[f"replay_ms_{rnd}"] = replay_ms(runner, batch, args.steps, None)
            row[f"replay_hist_ms_{rnd}"] = replay_ms(runner, batch, args.steps, hist)
        row["graph"] = graph_profile(runner, batch, 5)
        row["replay_after_ms"] = replay_ms(runner, batch, args.steps, None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        engine.close()
        del engine, runner
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "step_gap.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
