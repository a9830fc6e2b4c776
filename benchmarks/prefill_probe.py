"""What a rollout of many distinct prompts pays for its prefills (session 43: PPO's 64 prompts x 1 took 4.5-5.4 s
of rollout against GRPO's 8 x 8 at 2.7-2.9 s for the same 65,536 tokens on an H200).

    PYTHONPATH=. python benchmarks/prefill_probe.py --out OUT [--size tiny --device cpu]

Qwen3-1.7B architecture, random bf16 weights, rkv at budget 512, EOS ignored. For 64 rows as P prompts x (64 / P)
samples (P = 64, 8), ``max_new_tokens`` 1 (the prefills and first draws alone) and 1,024: wall seconds of
``generate`` (median of 3 after a warm-up), the engine's prefill count, and one prefill's time alone (``_prefill``
of a 128-token prompt, median of 20, CUDA-synchronised) with its host time (the same without the sync at the end).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_rollout_speed import build_model  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="qwen3-1.7b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-length", type=int, default=128)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--lengths", default="1,1024")
    p.add_argument("--out", required=True)
    opts = p.parse_args(argv)
    from kvroll import CompressionConfig, RolloutEngine, SamplingParams

    dtype = torch.bfloat16 if opts.device == "cuda" else torch.float32
    model = build_model(opts.size, dtype, opts.device, seed=0)
    engine = RolloutEngine(model, compression=CompressionConfig("rkv", 512), max_batch=opts.rows)
    torch.manual_seed(1)
    pool = [torch.randint(3, 40000, (opts.prompt_length,)).tolist() for _ in range(opts.rows)]
    rows = []
    for length in [int(x) for x in opts.lengths.split(",")]:
        sampling = SamplingParams(max_new_tokens=length, temperature=1.0, ignore_eos=True, seed=3)
        for prompts in (opts.rows, 8):
            args = (pool[:prompts], sampling)
            engine.generate(*args, n=opts.rows // prompts)  # warm-up (graphs, kernel variants)
            times = []
            for _ in range(3):
                before = engine.stats["prefills"]
                sync(opts.device)
                start = time.perf_counter()
                out = engine.generate(*args, n=opts.rows // prompts)
                sync(opts.device)
                times.append(time.perf_counter() - start)
                prefills = engine.stats["prefills"] - before
            assert len(out) == opts.rows
            rows.append({"max_new_tokens": length, "prompts": prompts, "n": opts.rows // prompts,
                         "seconds": times, "median_s": statistics.median(times), "prefills": prefills})
            print(rows[-1], flush=True)
    one, host = [], []
    for _ in range(20):
        sync(opts.device)
        start = time.perf_counter()
        engine._prefill(pool[0])
        host.append(time.perf_counter() - start)
        sync(opts.device)
        one.append(time.perf_counter() - start)
    result = {"rows": rows, "one_prefill_ms": statistics.median(one) * 1e3,
              "one_prefill_host_ms": statistics.median(host) * 1e3,
              "gpu": torch.cuda.get_device_name(0) if opts.device == "cuda" else "cpu"}
    print({k: v for k, v in result.items() if k != "rows"}, flush=True)
    if opts.device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine._prefill(pool[0])
            sync(opts.device)
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
        result["kernels"] = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
        Path(opts.out, "prefill_profile.txt").write_text(table)
    Path(opts.out).mkdir(parents=True, exist_ok=True)
    Path(opts.out, "prefill_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
