"""Where the statistic's finishing pass costs time: the decode kernel with LongFlow's statistic (cached norms, dense,
argmin only, as the engine calls it) under the finishing pass's knobs and split counts, against attention alone on
the same shape (CUDA-graph medians of 3 interleaved rounds, each variant checked against the fp32 reference first),
with the compiled split kernel's registers and spills per variant. Session 23 (developer probe).

    PYTHONPATH=.:benchmarks python benchmarks/stat_epilogue_probe.py --out OUT [--shapes 64x16x8x128x1024,...]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

try:
    from kernel_decode import Case, check, graph_time_ms, interleaved
except ImportError:  # imported as benchmarks.stat_epilogue_probe
    from benchmarks.kernel_decode import Case, check, graph_time_ms, interleaved

import kvroll.kernels.decode_attention as da
from kvroll.bench.measure import copy_bandwidth

SHAPES = "64x16x8x128x1024,128x16x8x128x1024,256x16x8x128x1024,1x16x8x128x8192,1x16x8x128x2048,8x16x8x128x2048," \
         "8x32x8x64x2048,1x32x8x64x8192"
VARIANTS = {"default": {}, "bs1024": dict(block_stat=1024), "bs512": dict(block_stat=512),
            "st2": dict(num_stages=2), "st2_bs512": dict(num_stages=2, block_stat=512),
            "late_discard": dict(logit_store="late", logit_discard=True), "asm": dict(logit_store="asm"),
            "merge": dict(finish="merge"), "sp2": dict(num_splits=2), "sp3": dict(num_splits=3),
            "sp4": dict(num_splits=4), "sp6": dict(num_splits=6), "sp2_st2": dict(num_splits=2, num_stages=2),
            "sp2_w8": dict(num_splits=2, num_warps=8),
            "st2_asm": dict(num_stages=2, logit_store="asm"), "nohints": dict(cache_hints=False),
            "st2_asm_nohints": dict(num_stages=2, logit_store="asm", cache_hints=False),
            "st2_nohints": dict(num_stages=2, cache_hints=False),
            "old3": dict(num_stages=3, logit_store="late"),  # before session 23's stat_two_stages
            "sp8": dict(num_splits=8), "sp16": dict(num_splits=16),
            "m_sp8_c512": dict(num_splits=8, finish="merge", finish_chunk=512),
            "m_sp16_c256": dict(num_splits=16, finish="merge", finish_chunk=256),
            "m_sp4_c512": dict(num_splits=4, finish="merge", finish_chunk=512)}


def _compiled():
    """{key: compiled kernel} of the split kernel, over Triton's per-device caches."""
    found = {}
    for entry in getattr(da._decode_split_kernel, "device_caches", {}).values():
        for part in (entry if isinstance(entry, tuple) else (entry,)):
            if isinstance(part, dict):
                found.update(part)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default=os.environ.get("SHAPES", SHAPES))
    ap.add_argument("--variants", default=os.environ.get("VARIANTS", ",".join(VARIANTS)))
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = []
    for spec in args.shapes.split(","):
        shape = tuple(int(x) for x in spec.split("x"))
        case = Case(shape)
        kv_ms = 2 * case.k.numel() * case.k.element_size() / bw * 1e3
        fns, regs = {"attn": lambda: case.attention(dense=True)}, {}
        if os.environ.get("ATTN_VARIANTS"):  # attention alone at the statistic's launch (3 stages, L2 hints)
            fns["attn_st3"] = lambda: case.attention(dense=True, num_stages=3, num_warps=4)
            fns["attn_st3_hints"] = lambda: case.attention(dense=True, num_stages=3, num_warps=4, cache_hints=True)
            fns["attn_st2"] = lambda: case.attention(dense=True, num_stages=2, num_warps=4)
        for name in filter(None, args.variants.split(",")):
            cfg = VARIANTS[name]
            fn = (lambda c=cfg: case.fused(vnorm=True, dense=True, **c))
            before = set(_compiled())
            try:
                ok = check(fn(), case.ref)
            except Exception as err:  # a knob this shape cannot take
                print(spec, name, "error", str(err).splitlines()[0][:100], flush=True)
                continue
            torch.cuda.synchronize()
            if not os.environ.get("NOCHECK"):  # NOCHECK=1: timing an ablated kernel (raw/s23/epilogue_ablation.sh)
                assert ok["rel_err"] < 2e-2 and ok["argmin_ok"], (spec, name, ok)
            new = [k for key, k in _compiled().items() if key not in before]
            regs[name] = [(getattr(k, "n_regs", None), getattr(k, "n_spills", None)) for k in new]
            fns[name] = fn
        med = interleaved(fns, 3)
        row = {"shape": spec, "kv_floor_ms": kv_ms, "ms": med, "regs_spills": regs, "sdpa_ms": graph_time_ms(case.sdpa)}
        rows.append(row)
        base = med.get("default", med["attn"])
        print(spec, f"floor {kv_ms * 1e3:.1f} us, sdpa {row['sdpa_ms'] * 1e3:.1f}",
              " ".join(f"{v} {m * 1e3:.1f} ({m / base:.3f})" for v, m in med.items()), regs, flush=True)
        with open(os.path.join(args.out, "stat_epilogue_probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": rows}, f, indent=1)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
