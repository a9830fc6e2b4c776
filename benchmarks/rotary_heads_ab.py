"""The decode step's rotary + cache-write kernel: 1, 2, 4, 8 or 16 heads per program (``HEADS_PER_PROGRAM``; 1 is
sessions 10-19's split) and the default rule, optionally against an older copy of the module.

    PYTHONPATH=.:benchmarks python benchmarks/rotary_heads_ab.py --out OUT [--old path/to/rotary.py]

Per shape (rows, query heads, key heads, head_dim; Qwen3's q/k norms, a bf16 cache of 1,024 entries with
||v||_1, LongFlow's appending write): each variant's outputs are first checked against the default's (positions,
counts and write indices equal; q, the K/V cache and ||v||_1 within an ulp of the inputs: a GPU may sum a head's
squares in another order; the differing elements are counted), then timed by ``kernel_decode.interleaved`` (CUDA graphs of 10 calls, medians over rotated
rounds), in µs per call. Writes rotary_heads_ab.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch

from kvroll.bench.report import write_json
from kvroll.kernels import rotary as rot

try:
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.rotary_heads_ab
    from benchmarks.kernel_decode import interleaved

SHAPES = [(rows, hq, hk, d) for rows in (1, 8, 32, 64, 128, 192, 256, 384)
          for hq, hk, d in ((16, 8, 128), (32, 8, 128), (16, 2, 64), (14, 2, 64))]
CAPACITY = 1024


def case(rows, hq, hk, d, dev, gen):
    qkv = torch.randn(rows, 1, (hq + 2 * hk) * d, device=dev, generator=gen).bfloat16()
    q, k, v = (t.view(rows, 1, -1, d) for t in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    pos = torch.randint(0, 30000, (rows, 1), device=dev, generator=gen)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = pos[..., None].float() * torch.cat([inv, inv])
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    weights = [torch.rand(d, device=dev, generator=gen).bfloat16() + 0.5 for _ in range(2)]
    cache = dict(k_cache=torch.zeros(rows, hk, CAPACITY, d, device=dev, dtype=torch.bfloat16),
                 v_cache=torch.zeros(rows, hk, CAPACITY, d, device=dev, dtype=torch.bfloat16),
                 vnorm=torch.zeros(rows, hk, CAPACITY, device=dev),
                 pos=torch.zeros(rows, hk, CAPACITY, device=dev, dtype=torch.int32),
                 count=torch.full((rows, hk), 500, device=dev, dtype=torch.int64),
                 write_idx=torch.full((rows, hk), 500, device=dev, dtype=torch.int64),
                 cur_pos=pos[:, 0].clone())
    return (q, k, v, cos, sin), weights, cache


def call(module, inputs, weights, cache, heads=None):
    q, k, v, cos, sin = inputs
    write = module.CacheWrite(v, cache["k_cache"], cache["v_cache"], cache["vnorm"], cache["pos"], cache["count"],
                              cache["write_idx"], cache["cur_pos"], CAPACITY, True)
    saved = getattr(module, "HEADS_PER_PROGRAM", None)
    if heads is not None:
        module.HEADS_PER_PROGRAM = heads
    try:
        return module.rotary(q, k, cos, sin, q_norm=(weights[0], 1e-6), k_norm=(weights[1], 1e-6), write=write)[0]
    finally:
        if heads is not None:
            module.HEADS_PER_PROGRAM = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--old", default=None, help="an older rotary.py to time beside (one head per program)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("rotary_old", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    rows_out = []
    for rows, hq, hk, d in SHAPES:
        inputs, weights, cache = case(rows, hq, hk, d, dev, gen)
        variants = {"default": (rot, None)}
        for heads in (1, 2, 4, 8, 16):
            if heads <= max(hq, hk) and heads * rot.triton.next_power_of_2(d) <= 2048:
                variants[f"g{heads}"] = (rot, heads)
        if old is not None:
            variants["old_module"] = (old, None)
        want, differ = None, {}
        for label, (module, heads) in variants.items():  # the same outputs from the same state
            state = {name: t.clone() for name, t in cache.items()}
            got = {"q": call(module, inputs, weights, state, heads), **state}
            if want is None:
                want = got
                continue
            for name in ("pos", "count", "write_idx", "cur_pos"):
                assert torch.equal(got[name], want[name]), (label, name, rows, hq, hk, d)
            for name in ("q", "k_cache", "v_cache", "vnorm"):  # sums of squares / ||v||_1 in another order: an ulp
                ref = want[name].float()  # of a normalised input, a few of a rotated output near 0
                torch.testing.assert_close(got[name].float(), ref, rtol=1e-2 if name != "vnorm" else 1e-5,
                                           atol=1e-2 * float(ref.abs().max()) if name != "vnorm" else 0)
            differ[label] = sum(int((got[n] != want[n]).sum()) for n in ("q", "k_cache", "v_cache", "vnorm"))
        fns = {label: (lambda m=module, h=heads: call(m, inputs, weights, cache, h))
               for label, (module, heads) in variants.items()}
        times = interleaved(fns, args.rounds)
        row = {"rows": rows, "q_heads": hq, "k_heads": hk, "head_dim": d,
               "default_heads": rot._heads_per_program(rows, hq, hk, rot.triton.next_power_of_2(d), dev),
               "elements_differing_from_default": differ, **{f"{label}_us": 1e3 * t for label, t in times.items()}}
        print(row, flush=True)
        rows_out.append(row)
    write_json(os.path.join(args.out, "rotary_heads_ab.json"), rows_out)


if __name__ == "__main__":
    main()
