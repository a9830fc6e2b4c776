"""The fused sampler's noise: torch's ``exponential_`` tensor (sessions 11-18) against Philox inside the kernel.

    PYTHONPATH=.:benchmarks python benchmarks/sample_noise_ab.py --out OUT [--rows 1,8,64,128,256,512]

Per batch of rows over Qwen3's 151,936-entry vocabulary (bf16 logits, T = 1): the old step (an fp32 noise tensor
drawn by ``exponential_`` from torch's default CUDA generator, then ``fused_sample(logits, noise)``), the new one
(``fused_sample(logits, None, rng=state)``) and greedy, each timed by ``kernel_decode.interleaved`` (CUDA graphs
of 10 calls, medians over rotated rounds), against the bytes' floor (the logits read once; the old path also writes and
reads 4 bytes of noise per entry). The in-kernel path is first checked: its draw equals the draw with
``exp_noise``'s tensor, token for token. This measures the Gumbel arm (``INVERSE_CDF = False``, set here; since
session 34 the default in-kernel draw is the inverse CDF, ``benchmarks/sample_icdf_ab.py``). Writes
sample_noise_ab.json.
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
except ImportError:  # imported as benchmarks.sample_noise_ab
    from benchmarks.kernel_decode import interleaved

VOCAB = 151936


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="1,8,64,128,256,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks-per-sm", default=str(ks.CHUNKS_PER_SM), help="comma list: each timed")
    args = parser.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    ks.INVERSE_CDF = False  # the Gumbel arm: the noise this benchmark is about (exp_noise is its draw)
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, VOCAB, device=dev, generator=gen) * 3).bfloat16()
        rng = ks.new_rng_state(dev, gen)
        want = ks.fused_sample(logits, ks.exp_noise(rows, VOCAB, rng), 1.0)
        got = ks.fused_sample(logits, None, 1.0, rng=rng)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), rows

        def torch_noise():
            noise = torch.empty(rows, VOCAB, dtype=torch.float32, device=dev).exponential_(1.0)  # default generator
            return ks.fused_sample(logits, noise, 1.0)

        default = ks.CHUNKS_PER_SM
        for cps in [int(c) for c in args.chunks_per_sm.split(",")]:
            ks.CHUNKS_PER_SM = cps
            variants = {"torch_noise": torch_noise,
                        "kernel_noise": lambda: ks.fused_sample(logits, None, 1.0, rng=rng),
                        "greedy": lambda: ks.fused_sample(logits, None, 1.0)}
            times = interleaved(variants, args.rounds)
            row = {"rows": rows, "vocab": VOCAB, "chunks_per_sm": cps, "chunks": ks._chunking(rows, VOCAB, dev)[1],
                   "floor_logits_ms": rows * VOCAB * 2 / bw * 1e3,
                   "floor_with_noise_ms": rows * VOCAB * (2 + 8) / bw * 1e3,
                   **{f"{name}_ms": ms for name, ms in times.items()}}
            out.append(row)
            print(f"rows {rows:4d} chunks/SM {cps}: torch noise {row['torch_noise_ms'] * 1e3:7.1f} us  kernel noise "
                  f"{row['kernel_noise_ms'] * 1e3:7.1f} us  greedy {row['greedy_ms'] * 1e3:7.1f} us  (logits' "
                  f"floor {row['floor_logits_ms'] * 1e3:6.1f} us)", flush=True)
        ks.CHUNKS_PER_SM = default
    ks.INVERSE_CDF = True
    write_json(os.path.join(args.out, "sample_noise_ab.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": out})


if __name__ == "__main__":
    main()
