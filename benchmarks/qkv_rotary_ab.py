"""The attention prologue of a decode step: cuBLAS's QKV matmul then ``rotary(..., write=)`` (the engine's path
today) against ``qkv_rotary_experiment.qkv_rotary`` (one split-K Triton kernel with the norms, rotary and cache write
in its epilogue). Session 21, H100: the experiment was 1.03-1.26x the two kernels' time at every row count and
config; not adopted.

    PYTHONPATH=.:benchmarks python benchmarks/qkv_rotary_ab.py --out OUT [--rows 1,8,16,32,64] [--sweep]

Layouts: Qwen3-1.7B (hidden 2,048, 16 / 8 heads of 128, q/k norms) and Qwen2-0.5B (896, 14 / 2 heads of 64, biases),
bf16, a cache of 1,024 slots per head. Each variant is timed by ``kernel_decode.interleaved`` (CUDA graphs of 10
calls, each call on the next of 10 weight copies so that no weight is read from L2; medians over rotated rounds)
and first checked against the two-kernel path on the same inputs: q, the cache rows written and the metadata, to a
rounding of the matmul's output. ``--sweep`` times each config of ``SWEEP`` too. Writes qkv_rotary_ab.json.
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels.rotary import CacheWrite, rotary

try:
    import qkv_rotary_experiment as qr
    from kernel_decode import interleaved
except ImportError:  # imported as benchmarks.qkv_rotary_ab
    from benchmarks import qkv_rotary_experiment as qr
    from benchmarks.kernel_decode import interleaved

LAYOUTS = {"qwen3-1.7b": dict(hidden=2048, n_q=16, n_k=8, head_dim=128, norm=True, bias=False),
           "qwen2-0.5b": dict(hidden=896, n_q=14, n_k=2, head_dim=64, norm=False, bias=True)}
COPIES = 10
CAPACITY = 1024
# (block_k, split_k, num_warps, num_stages); block_m is the rule's
SWEEP = [(128, s, 4, st) for s in (1, 2, 3, 4, 6, 8) for st in (3, 4)] + [(64, 4, 4, 5), (64, 8, 4, 5),
                                                                         (128, 4, 8, 3), (256, 2, 4, 3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="1,8,16,32,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for name, lay in LAYOUTS.items():
        hid, nq, nk, d = lay["hidden"], lay["n_q"], lay["n_k"], lay["head_dim"]
        width = (nq + 2 * nk) * d
        weights = [(torch.randn(width, hid, device=dev, generator=gen) / hid ** 0.5).bfloat16() for _ in range(COPIES)]
        bias = (torch.randn(width, device=dev, generator=gen) * 0.1).bfloat16() if lay["bias"] else None
        norms = dict(q_norm=((torch.rand(d, device=dev, generator=gen) + 0.5).bfloat16(), 1e-6),
                     k_norm=((torch.rand(d, device=dev, generator=gen) + 0.5).bfloat16(), 1e-6)) if lay["norm"] else {}
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, hid, device=dev, generator=gen).bfloat16()
            ang = torch.rand(rows, d // 2, device=dev, generator=gen) * 100
            cos, sin = torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16()

            def cache():
                z = torch.zeros(rows, nk, CAPACITY, d, dtype=torch.bfloat16, device=dev)
                return [z, z.clone(), torch.zeros(rows, nk, CAPACITY, device=dev),
                        torch.zeros(rows, nk, CAPACITY, dtype=torch.int32, device=dev),
                        torch.full((rows, nk), 5, dtype=torch.int64, device=dev),
                        torch.randint(0, CAPACITY, (rows, nk), device=dev, generator=gen),
                        torch.full((rows,), 700, dtype=torch.int64, device=dev)]

            ref_c, new_c = cache(), None
            new_c = [t.clone() for t in ref_c]

            def write(c, v):
                return CacheWrite(v, c[0], c[1], c[2], c[3], c[4], c[5], c[6], CAPACITY, False)

            counter = itertools.count()

            def two_kernels(c=ref_c):
                y = F.linear(x, weights[next(counter) % COPIES], bias)
                q, k, v = (t.view(rows, -1, d) for t in y.split([nq * d, nk * d, nk * d], -1))
                return rotary(q, k, cos, sin, write=write(c, v), **norms)[0]

            v_dummy = torch.empty(rows, nk, d, dtype=torch.bfloat16, device=dev)  # the kernel writes its own v

            def fused(c=new_c):
                return qr.qkv_rotary(x, weights[next(counter) % COPIES], bias, cos, sin, nq, nk, write(c, v_dummy),
                                     **norms)

            configs = [None] + ([(bk, s, w, st) for bk, s, w, st in SWEEP] if args.sweep else [])
            variants, checks = {"cublas+rotary": two_kernels}, {}
            for cfg in configs:
                block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
                qr.CONFIG = None if cfg is None else {1: (block_m, *cfg)}
                label = "fused_default" if cfg is None else "fused_" + "_".join(map(str, cfg))
                for c_ref, c_new in zip(ref_c, new_c):
                    c_new.copy_(c_ref)
                counter = itertools.count()  # both on weight copy 0
                want = two_kernels()
                counter = itertools.count()
                try:
                    got = fused()
                except Exception as exc:  # a config that does not compile: recorded, not timed
                    checks[label] = {"error": repr(exc)[:300]}
                    continue
                diffs = [(got.float() - want.float()).abs().max().item()] + \
                    [(a.float() - b.float()).abs().max().item() for a, b in zip(new_c, ref_c)]
                checks[label] = {"max_abs_diff_q_k_v_vn_pos_count_idx_cur": diffs}
                assert diffs[0] < 0.1 and all(dd == 0 for dd in diffs[4:]), (name, rows, label, diffs)
                variants[label] = (lambda c: (lambda: (qr.__dict__.__setitem__("CONFIG", c), fused())))(qr.CONFIG)
            times = interleaved(variants, args.rounds)
            qr.CONFIG = None
            floor = width * hid * 2 / bw * 1e3
            row = {"layout": name, "rows": rows, "floor_ms": floor, "times_ms": times, "checks": checks}
            out.append(row)
            best = min((k for k in times if k.startswith("fused")), key=times.get)
            print(f"{name} rows {rows:3d}: cublas+rotary {times['cublas+rotary'] * 1e3:6.1f} us  fused default "
                  f"{times.get('fused_default', float('nan')) * 1e3:6.1f}  best {best} {times[best] * 1e3:6.1f}  "
                  f"(weight floor {floor * 1e3:5.1f})", flush=True)
        del weights
    write_json(os.path.join(args.out, "qkv_rotary_ab.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": out})


if __name__ == "__main__":
    main()
