"""``head_sample``'s draw per vocabulary tile (``TILE_DRAW``, session 38) against its Gumbel arm (Philox and two logs
per entry), and both against cuBLAS's head with the sampler's inverse CDF (the engine's path above 64 rows).

    PYTHONPATH=.:benchmarks python benchmarks/head_tile_draw_ab.py --out OUT [--rows 1,8,16,32,48,64,80,96,128]

Qwen3-1.7B's head by default (hidden 2,048, vocabulary 151,936, bf16, random weights of std 0.02, hidden states
scaled so the logits have a std of ~3), T = 1, the draws from a device state. Times: ``kernel_decode.interleaved``
(CUDA graphs of 7 calls, medians over rotated rounds), against the floor of the head's weight bytes over the copy
bandwidth measured in the run. Before timing, each tile draw is checked against ``head_tile_draw_ref`` of the
fp64 logits rounded to bf16 at the same uniforms (``tile_uniforms``): the share of rows equal to it is written
(differences only at a rounding from an edge). From ``--config_rows`` rows (65) ``--configs`` lists the tiles
timed besides ``head_tiles``' own. Writes head_tile_draw_ab.json.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kvroll.bench.report import write_json
from kvroll.kernels import sample as ks

try:
    from head_sample_ab import head_inputs, head_parser, head_setup
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.head_tile_draw_ab
    from benchmarks.head_sample_ab import head_inputs, head_parser, head_setup
    from benchmarks.kernel_decode import interleaved


def _head(hidden, weight, T, rng, tile_draw, config):
    ks.TILE_DRAW, ks.HEAD_CONFIG = tile_draw, config
    try:
        return ks.head_sample(hidden, weight, T, rng=rng)
    finally:
        ks.TILE_DRAW, ks.HEAD_CONFIG = True, None


def main() -> None:
    parser = head_parser("1,8,16,32,48,64,80,96,128", rounds=5)
    parser.add_argument("--configs", default="64,64,64,4,4;64,128,64,4,4;64,128,64,8,3;128,128,64,8,3",
                        help="BM,BN,BK,warps,stages tiles timed from --config_rows rows, ';'-separated")
    parser.add_argument("--config_rows", type=int, default=65, help="the fewest rows timed at --configs' tiles")
    args = parser.parse_args()
    dev, bw, gen, weight, floor_ms = head_setup(args)
    T = args.temperature
    extra = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";") if c]
    out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        hidden, rng = head_inputs(args, rows, dev, gen)
        logits = (hidden.double() @ weight.double().T).bfloat16()
        configs = {"rule": None} | ({"_".join(map(str, c)): {1: c} for c in extra} if rows >= args.config_rows else {})
        checks, variants = {}, {
            "cublas+sampler": lambda: ks.fused_sample(F.linear(hidden, weight), None, T, rng=rng),
            "cublas_head_only": lambda: F.linear(hidden, weight)}
        for name, config in configs.items():
            ks.HEAD_CONFIG = config
            bn = ks.head_tiles(rows, hidden.dtype, dev)[1]
            ks.HEAD_CONFIG = None
            try:
                uv = ks.tile_uniforms(rows, -(-args.vocab // bn), rng)
                tokens, _, finite = _head(hidden, weight, T, rng.clone(), True, config)
            except Exception as exc:  # a config that does not compile (shared memory): recorded, not timed
                checks[name] = {"error": repr(exc)[:300]}
                continue
            if ks.tile_draw(bn):
                ref = ks.head_tile_draw_ref(logits, T, uv, bn)[0]
            else:  # head_sample draws Gumbel-max on these tiles (tile_draw): the entries' noise
                ref = ks.fused_sample_ref(logits, ks.exp_noise(rows, args.vocab, rng), T)[0]
            checks[name] = {"bn": bn, "tile_draw": ks.tile_draw(bn),
                            "rows_equal_ref": (tokens == ref).float().mean().item(), "all_finite": bool(finite.all())}
            for tile_draw in (True, False):
                variants[f"head_{'tile' if tile_draw else 'gumbel'}_{name}"] = (
                    lambda c, t: (lambda: _head(hidden, weight, T, rng, t, c)))(config, tile_draw)
        times = interleaved(variants, args.rounds)
        out.append({"rows": rows, "floor_ms": floor_ms, "times_ms": times, "checks": checks})
        line = "  ".join(f"{k} {v * 1e3:6.1f}" for k, v in times.items())
        print(f"rows {rows:4d} (floor {floor_ms * 1e3:.1f} us): {line}; checks {checks}", flush=True)
    write_json(os.path.join(args.out, "head_tile_draw_ab.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "temperature": T,
                "vocab": args.vocab, "hidden": args.hidden, "rows": out})


if __name__ == "__main__":
    main()
