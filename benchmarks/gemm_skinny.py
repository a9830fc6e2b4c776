"""The decode step's projections at small batches: cuBLAS's F.linear against the weight bytes' floor (bf16).

    PYTHONPATH=. python benchmarks/gemm_skinny.py --out OUT

Qwen3-1.7B's four per-layer projections with the fused joins (qkv [4096, 2048], o [2048, 2048], gate_up
[12288, 2048], down [2048, 6144]) and the LM head [151936, 2048], at M = 1, 8, 64, 128, 256 rows: each call timed
as the median of CUDA-graph replays (10 calls per graph), against (weight + input + output bytes) / the copy
bandwidth measured in the same run. Writes gemm_skinny.json and prints one line per shape.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
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
