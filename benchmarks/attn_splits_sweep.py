"""Attention alone (no statistic) over split counts 1-8 at the engine's batches (rows >= the SMs: the launcher's
base rule, not the long tail's), against the launcher's default and SDPA: 17-128 slots x 8 KV heads x 1,024-8,192
tokens x head_dim 128 / 64, CUDA-graph medians of 3 interleaved rounds, each variant first checked against the fp32
reference. Session 18 (H100) fitted ``decode_launch._one_split`` to it (docs/benchmarks/kernel_decode.md).

    PYTHONPATH=. SWEEP_S=190 python benchmarks/attn_splits_sweep.py     # OUT=folder for attn_splits_sweep.json
    STAT=1 ...: the statistic and its argmin as LongFlow asks them (cached norms, dense); SLOTS=, CAPS=: the grid
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernel_decode import Case, check, graph_time_ms, interleaved  # noqa: E402
from kernel_tail import attention_ok  # noqa: E402
from kvroll.kernels import decode_launch as dl  # noqa: E402

rows = []
t0 = time.time()
budget = float(os.environ.get("SWEEP_S", "200"))
STAT = os.environ.get("STAT") == "1"  # the statistic as the engine asks it (LongFlow: cached norms, dense, argmin)
SLOTS = [int(x) for x in os.environ.get("SLOTS", "17,24,32,48,64,128").split(",")]
CAPS = [int(x) for x in os.environ.get("CAPS", "1024,2048,4096,8192").split(",")]
for hd, hq in ((128, 16), (64, 32)):
    for cap in CAPS:
        for slots in SLOTS:
            if time.time() - t0 > budget:
                break
            shape = (slots, hq, 8, hd, cap)
            case = Case(shape)
            dflt = dl.default_splits(slots, 8, cap, 64, torch.device("cuda"), stat=STAT, head_dim=hd)
            variants = {"default": {}, **{f"s{n}": dict(num_splits=n) for n in (1, 2, 3, 4, 6, 8)}}
            if STAT:
                fns = {v: (lambda cfg=cfg: case.fused(vnorm=True, dense=True, **cfg)) for v, cfg in variants.items()}
            else:
                fns = {v: (lambda cfg=cfg: case.attention(**cfg)) for v, cfg in variants.items()}
            for v, fn in fns.items():  # every variant checked against the fp32 reference before any timing
                ok = check(fn(), case.ref) if STAT else attention_ok(case, fn)
                assert ok["rel_err"] < 2e-2 and ok.get("argmin_ok", True), (shape, v, ok)
            med = interleaved(fns, 3)
            sdpa = graph_time_ms(case.sdpa)
            best = min((m, v) for v, m in med.items() if v != "default")
            rows.append({"dims": shape, "default_splits": dflt, "sdpa_ms": sdpa, "median_ms": med})
            print(shape, f"default({dflt}) {med['default']*1e3:.1f} sdpa {sdpa*1e3:.1f}",
                  " ".join(f"{v} {m*1e3:.1f}" for v, m in med.items() if v != "default"),
                  f"best {best[1]} {med['default']/best[0]:.3f}x", flush=True)
            del case
            torch.cuda.empty_cache()
name = "attn_splits_sweep_stat.json" if STAT else "attn_splits_sweep.json"
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), name), "w"), indent=1)
