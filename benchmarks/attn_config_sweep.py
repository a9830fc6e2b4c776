"""The decode kernel's pipeline stages and warps at the engine's batches (rows >= SMs), attention alone and with
LongFlow's statistic (cached norms, dense, argmin), against the launcher's defaults of the same run: CUDA-graph
medians of 3 interleaved rounds, each variant first checked against the fp32 reference. Each variant is a call
of ``decode_attention`` with that ``num_stages`` / ``num_warps`` (its split count follows from them, as the
launcher's would). Session 22 (H100) fitted ``decode_launch.launch_config`` to it.

    PYTHONPATH=.:benchmarks SWEEP_S=400 python benchmarks/attn_config_sweep.py --out OUT
    SLOTS=, CAPS=, DIMS=128,64: the grid; VARIANTS=attn,stat: the modes
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

try:
    from kernel_decode import Case, check, graph_time_ms, interleaved
    from kernel_tail import attention_ok
except ImportError:  # imported as benchmarks.attn_config_sweep
    from benchmarks.kernel_decode import Case, check, graph_time_ms, interleaved
    from benchmarks.kernel_tail import attention_ok

from kvroll.bench.measure import copy_bandwidth

ATTN = {"st3_w4": dict(num_stages=3, num_warps=4), "st2_w4": dict(num_stages=2, num_warps=4),
        "st4_w4": dict(num_stages=4, num_warps=4), "st2_w8": dict(num_stages=2, num_warps=8)}
STAT = {"st3_w4": dict(num_stages=3, num_warps=4), "st3_w8": dict(num_stages=3, num_warps=8),
        "st4_w4": dict(num_stages=4, num_warps=4), "st4_w8": dict(num_stages=4, num_warps=8),
        "st2_w8": dict(num_stages=2, num_warps=8)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    budget, t0 = float(os.environ.get("SWEEP_S", "400")), time.time()
    slots_grid = [int(x) for x in os.environ.get("SLOTS", "17,33,48,64,96,128,256").split(",")]
    caps = [int(x) for x in os.environ.get("CAPS", "1024,1152,2048,4096").split(",")]
    dims = [int(x) for x in os.environ.get("DIMS", "128,64").split(",")]
    modes = os.environ.get("VARIANTS", "attn,stat").split(",")
    rows = []
    path = os.path.join(args.out, "attn_config_sweep.json")
    for hd in dims:
        for cap in caps:
            for slots in slots_grid:
                if time.time() - t0 > budget:
                    break
                shape = (slots, 16 if hd == 128 else 32, 8, hd, cap)
                case = Case(shape)
                kv_ms = 2 * case.k.numel() * case.k.element_size() / bw * 1e3
                row = {"dims": shape, "kv_floor_ms": kv_ms}
                for mode in modes:
                    table = ATTN if mode == "attn" else STAT
                    if mode == "attn":
                        fns = {"default": lambda: case.attention(dense=True),
                               **{v: (lambda c=c: case.attention(dense=True, **c)) for v, c in table.items()}}
                    else:
                        fns = {"default": lambda: case.fused(vnorm=True, dense=True),
                               **{v: (lambda c=c: case.fused(vnorm=True, dense=True, **c)) for v, c in table.items()}}
                    for v, fn in fns.items():
                        ok = check(fn(), case.ref) if mode == "stat" else attention_ok(case, fn)
                        assert ok["rel_err"] < 2e-2 and ok.get("argmin_ok", True), (shape, mode, v, ok)
                    med = interleaved(fns, 3)
                    row[mode] = med
                    base = med["st3_w4"]
                    print(mode, shape, f"floor {kv_ms*1e3:.1f}",
                          " ".join(f"{v} {m*1e3:.1f} ({m/base:.3f})" for v, m in med.items()), flush=True)
                row["sdpa_ms"] = graph_time_ms(case.sdpa)
                rows.append(row)
                with open(path, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": rows}, f,
                              indent=1)
                del case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
