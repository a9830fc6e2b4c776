"""The decode step's projections at small batches: cuBLAS's F.linear against the weight bytes' floor (bf16).

    PYTHONPATH=. python benchmarks/gemm_skinny.py --out OUT

Qwen3-1.7B's four per-layer projections with the fused joins (qkv [4096, 2048], o [2048, 2048], gate_up
[12288, 2048], down [2048, 6144]) and the LM head [151936, 2048], at M = 1, 8, 64, 128, 256 rows: each call timed
as the median of CUDA-graph replays (10 calls per graph), against (weight + input + output bytes) / the copy
bandwidth measured in the same run. Writes gemm_skinny.json and prints one line per shape. ``--skinny [--tune]``:
``skinny_linear_experiment.py``'s kernel against cuBLAS at M = 1-16 on the four projections, weights rotated past the L2
(gemm_skinny_kernel.json).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json

PROJECTIONS = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144),
               "lm_head": (151936, 2048)}
ROWS = (1, 8, 64, 128, 256)
SKINNY_ROWS = (1, 2, 4, 8, 16)
SKINNY_CONFIGS = [dict(split_k=sk, block_n=bn, block_k=bk, num_stages=st) for sk in (1, 2, 4, 8) for bn in (16, 32)
                  for bk in (128, 256) for st in (3, 4)]


def graph_ms(fn, calls: int = 10, replays: int = 30) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def skinny(bandwidth, out, tune):
    """``--skinny``: the experiment's kernel (``skinny_linear_experiment.py``) against cuBLAS at M = 1-16, each
    call on one of several weight copies in turn (together over 256 MB, so that no weight is read from L2, as in a
    step, where every layer's weights differ); with ``--tune`` a search over the split-K version's splits, tile and
    stages first."""
    from skinny_linear_experiment import _config, skinny_linear, skinny_linear_splitk

    rows = []
    for name, (n, k) in PROJECTIONS.items():
        if name == "lm_head":
            continue
        copies = max(2, -(-256 * 2 ** 20 // (2 * n * k)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in SKINNY_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            state = {"i": 0}

            def rotate(fn):
                def call():
                    w = weights[state["i"] % copies]
                    state["i"] += 1
                    return fn(x, w)
                return call
            floor = 2 * (n * k + m * k + m * n) / bandwidth * 1e3
            row = {"projection": name, "n": n, "k": k, "m": m, "floor_ms": floor,
                   "cublas_ms": graph_ms(rotate(F.linear), calls=copies * 2),
                   "default_config": list(_config(n, k)),
                   "skinny_ms": graph_ms(rotate(skinny_linear), calls=copies * 2)}
            if tune and m in (1, 8, 16):
                row["search"] = {}
                for cfg in SKINNY_CONFIGS:
                    label = "sk{split_k}/bn{block_n}/bk{block_k}/s{num_stages}".format(**cfg)
                    try:
                        row["search"][label] = graph_ms(
                            rotate(lambda a, b, cfg=cfg: skinny_linear_splitk(a, b, **cfg)), calls=copies * 2)
                    except Exception as err:  # a config the compiler rejects (shared memory)
                        row["search"][label] = None
                        row.setdefault("errors", {})[label] = str(err).splitlines()[0][:120] if str(err) else ""
                ok = {key: v for key, v in row["search"].items() if v}
                row["best"] = min(ok, key=ok.get)
            rows.append(row)
            best = f" | best {row['best']} {row['search'][row['best']] * 1e3:.1f} us" if "best" in row else ""
            print(f"{name:8s} M={m:3d}: cuBLAS {row['cublas_ms'] * 1e3:6.1f} us ({floor / row['cublas_ms']:5.1%}), "
                  f"skinny {row['skinny_ms'] * 1e3:6.1f} us ({floor / row['skinny_ms']:5.1%}), floor "
                  f"{floor * 1e3:5.1f} us{best}", flush=True)
        del weights
    write_json(os.path.join(out, "gemm_skinny_kernel.json"),
               {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skinny", action="store_true", help="the skinny kernel against cuBLAS at M = 1-16")
    parser.add_argument("--tune", action="store_true", help="with --skinny: search its configuration first")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    if args.skinny:
        return skinny(bandwidth, args.out, args.tune)
    rows = []
    for name, (n, k) in PROJECTIONS.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = graph_ms(lambda: F.linear(x, weight))
            floor = 2 * (n * k + m * k + m * n) / bandwidth * 1e3
            rows.append({"projection": name, "n": n, "k": k, "m": m, "ms": ms, "floor_ms": floor,
                         "of_bandwidth": floor / ms})
            print(f"{name:8s} M={m:4d}: {ms * 1e3:8.1f} us, floor {floor * 1e3:8.1f} us, {floor / ms:6.1%} of the copy bandwidth",
                  flush=True)
    write_json(os.path.join(args.out, "gemm_skinny.json"),
               {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
