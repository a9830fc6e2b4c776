"""The output head and the draw: cuBLAS's logits then the fused sampler (the engine's step today) against
``head_sample`` (the head's matmul tile by tile with the draw in its epilogue, no logits in memory).

    PYTHONPATH=.:benchmarks python benchmarks/head_sample_ab.py --out OUT [--rows 1,8,64,128,256] [--sweep]

Qwen3-1.7B's head by default: hidden 2,048, vocabulary 151,936, bf16 (random weights, std 0.02, and hidden states
of std 1 / sqrt-scaled, so the logits have a std of ~3), T = 1, the noise drawn in the kernels. Each variant is
timed by ``kernel_decode.interleaved`` (CUDA graphs of 7 calls, medians over rotated rounds) against the floor of
the head's weight bytes over the copy bandwidth measured in the run. Before timing, each config's draw is checked
against ``fused_sample`` of cuBLAS's logits with the same noise: the tokens may differ only where the two logits'
roundings differ, so the count of differing rows is written, with the largest logprob difference. ``--sweep`` times
every config of ``CONFIGS`` that fits the rows. Since session 34 the pair's sampler draws by the inverse CDF
(``cublas+sampler``); ``cublas+sampler_gumbel`` is its Gumbel arm, the draw ``head_sample`` makes. Writes
head_sample_ab.json.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels import sample as ks

try:
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.head_sample_ab
    from benchmarks.kernel_decode import interleaved

# (BN, BK, num_warps, num_stages); BM is swept over the row blocks that fit the rows
CONFIGS = [(128, 64, 4, 4), (128, 64, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (64, 64, 4, 5),
           (64, 64, 8, 4), (64, 128, 4, 4), (64, 128, 4, 3), (32, 128, 4, 4), (32, 64, 4, 5), (256, 128, 8, 3)]


def _bms(rows: int) -> list[int]:
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * rows) and (bm >= rows // 4 or bm == 128)]


def head_parser(rows: str, rounds: int) -> argparse.ArgumentParser:
    """The head benchmarks' common options (this one's and ``head_tile_draw_ab.py``'s)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser


def head_setup(args):
    """(device, copy bandwidth, generator, the head's random bf16 weight, its floor in ms)."""
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device=dev, generator=gen) * 0.02).bfloat16()
    return dev, bw, gen, weight, weight.numel() * 2 / bw * 1e3


def head_inputs(args, rows: int, dev, gen):
    """(hidden states [rows, hidden] bf16, scaled for logits of std ~3; a fresh rng state), drawn from ``gen``."""
    hidden = (torch.randn(rows, args.hidden, device=dev, generator=gen) * 150 / args.hidden ** 0.5).bfloat16()
    return hidden, ks.new_rng_state(dev, gen)


def main() -> None:
    parser = head_parser("1,8,64,128,256", rounds=3)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    dev, bw, gen, weight, floor_ms = head_setup(args)
    T = args.temperature
    out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        hidden, rng = head_inputs(args, rows, dev, gen)
        logits = F.linear(hidden, weight)
        noise = ks.exp_noise(rows, args.vocab, rng)
        want = ks.fused_sample(logits, noise, T)
        configs = [None] + ([(bm, *c) for bm in _bms(rows) for c in CONFIGS] if args.sweep else [])
        variants = {"cublas+sampler": lambda: ks.fused_sample(F.linear(hidden, weight), None, T, rng=rng),
                    "cublas+sampler_gumbel": lambda: gumbel(F.linear(hidden, weight), T, rng),
                    "cublas_head_only": lambda: F.linear(hidden, weight)}
        checks = {}
        for cfg in configs:
            ks.HEAD_CONFIG = None if cfg is None else {1: cfg}
            label = "head_default" if cfg is None else "head_" + "_".join(map(str, cfg))
            try:
                got = ks.head_sample(hidden, weight, T, rng=rng.clone())
            except Exception as exc:  # a config that does not compile (shared memory): recorded, not timed
                checks[label] = {"error": repr(exc)[:300]}
                continue
            diff = (got[0] != want[0]).sum().item()
            checks[label] = {"rows_differing": diff, "max_logprob_diff": (got[1] - want[1]).abs().max().item(),
                             "all_finite": bool(got[2].all())}
            variants[label] = (lambda c: (lambda: (ks.__dict__.__setitem__("HEAD_CONFIG", c),
                                                   ks.head_sample(hidden, weight, T, rng=rng))))(ks.HEAD_CONFIG)
        times = interleaved(variants, args.rounds)
        ks.HEAD_CONFIG = None
        row = {"rows": rows, "vocab": args.vocab, "hidden": args.hidden, "floor_ms": floor_ms, "times_ms": times,
               "checks": checks}
        out.append(row)
        best = min((k for k in times if k.startswith("head_")), key=times.get)
        print(f"rows {rows:4d}: cublas+sampler {times['cublas+sampler'] * 1e3:7.1f} us (Gumbel arm "
              f"{times['cublas+sampler_gumbel'] * 1e3:7.1f}, head alone "
              f"{times['cublas_head_only'] * 1e3:7.1f})  head_sample default "
              f"{times.get('head_default', float('nan')) * 1e3:7.1f}  best {best} {times[best] * 1e3:7.1f}  floor "
              f"{floor_ms * 1e3:6.1f} us; checks {checks.get(best)}", flush=True)
    write_json(os.path.join(args.out, "head_sample_ab.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "temperature": T, "rows": out})


def gumbel(logits, T, rng):
    """The sampler's Gumbel arm (``INVERSE_CDF = False``; sessions 19-33's draw above 64 rows)."""
    ks.INVERSE_CDF = False
    try:
        return ks.fused_sample(logits, None, T, rng=rng)
    finally:
        ks.INVERSE_CDF = True


if __name__ == "__main__":
    main()
