"""The fused sampler's in-kernel draw: Gumbel-max (Philox noise per entry, sessions 19-33) against the inverse CDF at
one uniform per row (session 34).

    PYTHONPATH=.:benchmarks python benchmarks/sample_icdf_ab.py --out OUT [--rows 65,128,256,352,512]

Per batch of rows over Qwen3's 151,936-entry vocabulary (bf16 logits, N(0, 3^2)): both draws and greedy, each timed
by ``kernel_decode.interleaved`` (CUDA graphs of 10 calls, medians over rotated rounds), against the logits' floor
(read once), at T = 1 and T = 0.7. Checked first on the GPU: each token's fp64 CDF interval holds the kernel's own
uniform (``row_uniforms``) within 1e-6 of the total, at least 90% of rows are the fp64 reference's token
(``inverse_cdf_slack``), and each logprob is within 2e-5 of fp64 log_softmax at the token drawn.
Writes sample_icdf_ab.json.
"""
from __future__ import annotations

import argparse
import os

import torch

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels import sample as ks

try:
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.sample_icdf_ab
    from benchmarks.kernel_decode import interleaved

VOCAB = 151936


def check_draw(tokens, logits, temperature, u, what) -> None:
    """Each token's CDF interval (fp64) holds u * total within 1e-6 of the total (the fp32 rounding of the parts'
    sums moves the edges by about that much); most rows are exactly the fp64 reference's."""
    slack, exact = ks.inverse_cdf_slack(tokens, logits, temperature, u)
    assert slack <= 1e-6, (what, slack)
    assert exact >= 0.9, (what, exact)


def draw(logits, temperature, rng, icdf: bool):
    ks.INVERSE_CDF = icdf
    try:
        return ks.fused_sample(logits, None, temperature, rng=rng)
    finally:
        ks.INVERSE_CDF = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="65,128,256,352,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", default="", help="PART:UNROLL:WARPS:CHUNKS_PER_SM,...: the mass kernel's shapes "
                        "timed against each other (icdf only) after the A/B; the best by total time is printed")
    args = parser.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, VOCAB, device=dev, generator=gen) * 3).bfloat16()
        rng = ks.new_rng_state(dev, gen)
        for temperature in (1.0, 0.7):
            u = ks.row_uniforms(rows, rng)
            tokens, logprobs, finite = draw(logits, temperature, rng, True)
            # the logprob of the token drawn (at a CDF edge the reference's token may be its neighbour)
            want_lp = (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
            assert bool(finite.all()), rows
            check_draw(tokens, logits, temperature, u, (rows, temperature))
            assert (logprobs - want_lp).abs().max().item() < 2e-5, (rows, temperature)
            variants = {"gumbel": lambda: draw(logits, temperature, rng, False),
                        "icdf": lambda: draw(logits, temperature, rng, True),
                        "greedy": lambda: ks.fused_sample(logits, None, 1.0)}
            times = interleaved(variants, args.rounds)
            row = {"rows": rows, "vocab": VOCAB, "temperature": temperature,
                   "chunks": ks._chunking(rows, VOCAB, dev)[1], "floor_logits_ms": rows * VOCAB * 2 / bw * 1e3,
                   **{f"{name}_ms": ms for name, ms in times.items()}}
            out.append(row)
            print(f"rows {rows:4d} T {temperature}: gumbel {row['gumbel_ms'] * 1e3:7.1f} us  icdf "
                  f"{row['icdf_ms'] * 1e3:7.1f} us  greedy {row['greedy_ms'] * 1e3:7.1f} us  (logits' floor "
                  f"{row['floor_logits_ms'] * 1e3:6.1f} us)", flush=True)
    sweep = sweep_shapes(args, dev, gen) if args.sweep else []
    write_json(os.path.join(args.out, "sample_icdf_ab.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": out, "sweep": sweep})


def sweep_shapes(args, dev, gen) -> list[dict]:
    shapes = [tuple(int(v) for v in spec.split(":")) for spec in args.sweep.split(",")]
    default = (ks.ICDF_PART, ks.ICDF_UNROLL, ks.ICDF_WARPS, ks.ICDF_CHUNKS_PER_SM)
    totals = dict.fromkeys(shapes, 0.0)
    out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, VOCAB, device=dev, generator=gen) * 3).bfloat16()
        rng = ks.new_rng_state(dev, gen)
        variants = {}
        for shape in shapes:
            def run(shape=shape):
                ks.ICDF_PART, ks.ICDF_UNROLL, ks.ICDF_WARPS, ks.ICDF_CHUNKS_PER_SM = shape
                try:
                    return ks.fused_sample(logits, None, 1.0, rng=rng)
                finally:
                    ks.ICDF_PART, ks.ICDF_UNROLL, ks.ICDF_WARPS, ks.ICDF_CHUNKS_PER_SM = default
            u = ks.row_uniforms(rows, rng)
            check_draw(run()[0], logits, 1.0, u, (rows, shape))
            variants[":".join(map(str, shape))] = run
        times = interleaved(variants, args.rounds)
        for shape in shapes:
            ms = times[":".join(map(str, shape))]
            totals[shape] += ms
            out.append({"rows": rows, "shape": list(shape), "ms": ms})
        print(f"rows {rows:4d}: " + "  ".join(f"{k} {v * 1e3:6.1f}" for k, v in sorted(times.items(),
                                                                                  key=lambda kv: kv[1])), flush=True)
    best = min(totals, key=totals.get)
    print("best " + ":".join(map(str, best)) + f" total {totals[best] * 1e3:.1f} us; default "
          f"{totals.get(default, float('nan')) * 1e3:.1f} us", flush=True)
    return out


if __name__ == "__main__":
    main()
