"""The long tail's worst statistic shapes (issue 16 section 3: > 1.5x SDPA in session 13's check) under the split
pass's logit store and the finishing pass's knobs: from the defaults before session 18 ("prev": the late store,
discard), one knob changed at a time: ``logit_store`` "early" / "asm", no L2 hints, no discard, 8 warps, 1,024-token
finishing steps; the launcher's defaults beside them (session 18's run had no "prev": its defaults were
"prev"); CUDA-graph medians of 3 interleaved rounds, every call's argmin first checked against the fp32 reference.

    PYTHONPATH=. python benchmarks/tail_store_ab.py          # OUT=folder for tail_store_ab.json
    GRID=budget ...: slots 1-8 x 512-2,048 tokens (a compressed cache in the tail), the defaults against the
    late store with discard (the defaults before session 18)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from kernel_decode import Case, check, graph_time_ms, interleaved  # noqa: E402

SHAPES = [(1, 16, 8, 128, 8192), (1, 64, 8, 128, 8192), (1, 32, 8, 64, 8192), (1, 16, 8, 128, 2048),
          (1, 64, 8, 64, 2048), (8, 64, 8, 64, 8192), (4, 64, 8, 64, 32768), (8, 16, 8, 64, 2048),
          (8, 64, 8, 64, 2048), (4, 32, 8, 64, 8192)]
if os.environ.get("GRID") == "budget":  # a compressed cache's steady state in the tail (kernel_tail --mode budget)
    SHAPES = [(s, 8 * g, 8, d, c) for c in (512, 1024, 2048) for d, g in ((128, 2), (128, 8), (64, 4))
              for s in (1, 2, 4, 8)]
PREV = dict(logit_store="late", logit_discard=True)  # the defaults before session 18, each variant's base
VARIANTS = {"default": {}, "prev": PREV, "early": {**PREV, "logit_store": "early"},
            "asm": {**PREV, "logit_store": "asm"}, "no_hints": {**PREV, "cache_hints": False},
            "no_discard": {**PREV, "logit_discard": False}, "warps8": {**PREV, "num_warps": 8},
            "block_stat1024": {**PREV, "block_stat": 1024}}
if os.environ.get("GRID") == "budget":  # the defaults against session 13-17's store (late, discard)
    VARIANTS = {"default": {}, "prev": PREV}
rows = []
for shape in SHAPES:
    case = Case(shape)
    sdpa = graph_time_ms(case.sdpa)
    fns, errors = {}, {}
    for v, cfg in VARIANTS.items():  # checked before any timing; a variant that fails is reported, not timed
        fn = lambda cfg=cfg: case.fused(vnorm=True, dense=True, **cfg)  # noqa: E731
        try:
            ok = check(fn(), case.ref)
            assert ok["argmin_ok"] and ok["rel_err"] < 2e-2, ok
            fns[v] = fn
        except Exception as err:  # noqa: BLE001 - reported
            errors[v] = str(err)[:160]
    med = interleaved(fns, 3)
    rows.append({"dims": shape, "sdpa_ms": sdpa, "median_ms": med, "errors": errors})
    print(shape, f"sdpa {sdpa * 1e3:.1f} us", " ".join(f"{v} {m / sdpa:.2f}" for v, m in med.items()), errors or "",
          flush=True)
    del case
name = "tail_store_ab_budget.json" if os.environ.get("GRID") == "budget" else "tail_store_ab.json"
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), name), "w"), indent=1)
