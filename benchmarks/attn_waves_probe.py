"""Where the decode kernel's time goes at the engine's batches (rows >= SMs, one split per row): its time against
the bytes it streams, as the rows grow by whole and partial waves, against two streaming probes over the same K/V
layout (a program per row, and a persistent grid of two programs per SM walking every row's tiles in one loop),
and a few launch configurations (stages, warps, tile). Diagnostic only; nothing in kvroll depends on it.

    PYTHONPATH=.:benchmarks python benchmarks/attn_waves_probe.py --out OUT
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from kvroll.bench.measure import copy_bandwidth

try:
    from kernel_decode import Case, check, graph_time_ms, interleaved
except ImportError:  # imported as benchmarks.attn_waves_probe
    from benchmarks.kernel_decode import Case, check, graph_time_ms, interleaved


@triton.jit
def _stream_rows(k_ptr, v_ptr, out_ptr, capacity, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (slot, head) row: read its K and V tiles, keep a running sum (the loads' floor)."""
    row = tl.program_id(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    base = row.to(tl.int64) * capacity * HEAD_DIM
    for n0 in range(0, capacity, BLOCK_N):
        ptrs = base + (n0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
        acc += tl.load(k_ptr + ptrs, eviction_policy="evict_first").to(tl.float32)
        acc += tl.load(v_ptr + ptrs, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + row, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _stream_persistent(k_ptr, v_ptr, out_ptr, rows, capacity, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """A persistent grid: program p reads rows p, p + P, ... as one flat loop over their tiles."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    tiles = capacity // BLOCK_N
    mine = (rows - pid + nprog - 1) // nprog
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for it in range(0, mine * tiles):
        row = pid + (it // tiles) * nprog
        n0 = (it % tiles) * BLOCK_N
        ptrs = row.to(tl.int64) * capacity * HEAD_DIM + (n0 + offs_n)[:, None] * HEAD_DIM + offs_d[None, :]
        acc += tl.load(k_ptr + ptrs, eviction_policy="evict_first").to(tl.float32)
        acc += tl.load(v_ptr + ptrs, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--slots", default="33,48,64,66,96,128,132,256")
    ap.add_argument("--caps", default="1024,1152")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows_out = []
    for cap in [int(c) for c in args.caps.split(",")]:
        for slots in [int(s) for s in args.slots.split(",")]:
            case = Case((slots, 16, 8, 128, cap))
            kv_bytes = 2 * case.k.numel() * case.k.element_size()
            rows = slots * 8
            sink = torch.empty(max(rows, 2 * sms), device=dev)
            fns = {
                "attn": lambda: case.attention(dense=True, num_warps=4, num_stages=3),  # session 21's launch
                "stat": lambda: case.fused(vnorm=True, dense=True),
                "stream_rows": lambda: _stream_rows[(rows,)](case.k, case.v, sink, cap, HEAD_DIM=128, BLOCK_N=64,
                                                              num_warps=4, num_stages=3),
                "stream_persist": lambda: _stream_persistent[(2 * sms,)](case.k, case.v, sink, rows, cap,
                                                                         HEAD_DIM=128, BLOCK_N=64, num_warps=4,
                                                                         num_stages=3),
            }
            if slots == 64:
                for st in (2, 4):
                    fns[f"attn_st{st}"] = lambda st=st: case.attention(dense=True, num_stages=st)
                    fns[f"stat_st{st}"] = lambda st=st: case.fused(vnorm=True, dense=True, num_stages=st)
                fns["attn_w8"] = lambda: case.attention(dense=True, num_warps=8, num_stages=3)
                fns["stat_w8"] = lambda: case.fused(vnorm=True, dense=True, num_warps=8, num_stages=3)
                fns["attn_b32"] = lambda: case.attention(dense=True, block_n=32, num_stages=4)
                fns["stat_b32"] = lambda: case.fused(vnorm=True, dense=True, block_n=32, num_stages=4)
                fns["stat_s2"] = lambda: case.fused(vnorm=True, dense=True, num_splits=2)
                fns["stat_merge"] = lambda: case.fused(vnorm=True, dense=True, finish="merge")
            for label, fn in fns.items():
                if label.startswith("stat"):
                    ok = check(fn(), case.ref)
                    assert ok["rel_err"] < 2e-2 and ok["argmin_ok"], (label, ok)
            med = interleaved(fns, 3)
            floor_ms = kv_bytes / bw * 1e3
            row = {"slots": slots, "capacity": cap, "rows": rows, "waves_at_2_per_sm": rows / (2 * sms),
                   "kv_floor_ms": floor_ms, "ms": med, "over_floor": {k: v / floor_ms for k, v in med.items()}}
            rows_out.append(row)
            print(cap, slots, f"waves {row['waves_at_2_per_sm']:.2f} floor {floor_ms*1e3:.1f} us",
                  " ".join(f"{k} {v*1e3:.1f} ({v/floor_ms:.3f})" for k, v in med.items()), flush=True)
            del case
            torch.cuda.empty_cache()
    with open(os.path.join(args.out, "attn_waves_probe.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
