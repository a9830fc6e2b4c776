"""Where the decode kernel's PDL launch gains or loses inside a chained layer: one LongFlow decode step replayed from
its CUDA graph under the profiler, its kernels' start and end times, with the decode kernel a PDL launch in every
chained layer and in none (each its own engine and capture; the replay's time beside them) (session 29,
developer probe; session 28 measured the PDL launch 3.6% slower on Qwen3-4B's step at batch 64 and 0.3% faster on
Qwen3-8B's, the same attention shape, and found no mechanism).

Per chained layer the kernels run ``add_rms_norm, qkv, rotary, decode, o, add_rms_norm, gate_up, down``. For every
layer the probe takes the rotary kernel's end, the decode kernel's start and end, and the o GEMM's start and end, and
prints the medians over the layers of: the decode kernel's start after the rotary's end (negative: launched early
and waiting), its end after the rotary's end (the attention's time on the critical path), the o GEMM's start and
end after the decode kernel's end, and the layer's time (from one layer's rotary end to the next's). Random weights,
every cache row filled to ``--live`` tokens (``kvroll.bench.kernel_count``'s fill), one untimed replay first. (An
eager step under the profiler is bound by its launches: ~40 ms a step, the GPU waiting for the host.)

    PYTHONPATH=.:benchmarks python benchmarks/pdl_timeline_probe.py --archs qwen3-4b,qwen3-8b --batch 64
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.bench.kernel_count import _fill
from kvroll.bench.models import build_model
from kvroll.kernels import pdl_gemm
from kvroll.rollout import cache as cache_module


def replay_ms(runner, batch: int, reps: int = 50) -> float:
    """The median time of one replay of the step's graph (CUDA events around each)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.step(batch)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels_of_one_step(runner, cache, batch: int, live: int, reps: int) -> list[list[tuple[str, float, float]]]:
    """``reps`` profiled graph replays: each a list of (kernel name, start us, end us) in start order."""
    from torch.profiler import ProfilerActivity, profile

    out = []
    with torch.no_grad():
        for rep in range(reps + 1):
            _fill(cache, live)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.step(batch)
                torch.cuda.synchronize()
            if rep == 0:  # compiles, first launches
                continue
            events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > 0]
            out.append(sorted(((e.name, e.time_range.start, e.time_range.end) for e in events), key=lambda t: t[1]))
    return out


def layer_gaps(kernels: list[tuple[str, float, float]]) -> dict:
    """The medians over the step's chained layers (module docstring), us."""
    rows = []
    rotary_ends = [end for name, _, end in kernels if "_rotary_kernel" in name]
    for i, (name, start, end) in enumerate(kernels):
        if "_decode_split_kernel" not in name:
            continue
        rot = next((k for k in reversed(kernels[:i]) if "_rotary_kernel" in k[0]), None)
        o = next((k for k in kernels[i + 1:] if "_gemm_kernel" in k[0]), None)
        if rot is None or o is None:
            continue
        rows.append({"decode_start": start - rot[2], "decode_end": end - rot[2], "decode_us": end - start,
                     "o_start": o[1] - end, "o_end": o[2] - end})
    layer = [b - a for a, b in zip(rotary_ends, rotary_ends[1:])]
    out = {key: round(statistics.median(r[key] for r in rows), 2) for key in rows[0]} if rows else {}
    out["layer_us"] = round(statistics.median(layer), 2) if layer else None
    out["layers"] = len(rows)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default="qwen3-4b,qwen3-8b,qwen3-1.7b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--live", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--rotary_late", action="store_true",
                    help="the rotary's late signal where session 30's rule takes it (rotary_signal_late); default: "
                         "off, the rotary signalling at once, as in session 29's runs")
    args = ap.parse_args()
    pdl_gemm.ROTARY_LATE = args.rotary_late
    results = []
    for arch in args.archs.split(","):
        model = build_model(None, arch, torch.bfloat16, torch.device("cuda"), 0)
        params = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True, seed=0)
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        rule = pdl_gemm.attention_pdl(args.batch, model.config.num_key_value_heads, group)
        for attn_pdl in (True, False):  # the decode kernel a PDL launch in every chained layer, or in none
            cache_module.attention_pdl = lambda slots, kv_heads, g, on=attn_pdl: on and pdl_gemm.chain_rows(slots)
            engine = RolloutEngine(model, compression=CompressionConfig("longflow", budget=args.live),
                                   max_batch=args.batch)  # captured with the launch above
            runner = engine._decode_runner(params)
            _fill(engine.cache, args.live)
            step_ms = replay_ms(runner, args.batch)
            steps = kernels_of_one_step(runner, engine.cache, args.batch, args.live, args.reps)
            gaps = [layer_gaps(k) for k in steps]
            row = {"arch": arch, "batch": args.batch, "attn_pdl": attn_pdl, "rule": rule,
                   "replay_ms": round(step_ms, 4),
                   "profiled_us": [round(k[-1][2] - k[0][1], 1) if k else None for k in steps],
                   "kernels": [len(k) for k in steps], "reps": gaps}
            print(json.dumps(row), flush=True)
            results.append(row)
            del engine, runner
            torch.cuda.empty_cache()
        cache_module.attention_pdl = pdl_gemm.attention_pdl
        del model
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
