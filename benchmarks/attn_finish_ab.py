"""Attention alone (no statistic): the launcher's default and one split against the split count of the rule
before session 18 ("old_default", finished by the merge kernel) and against the last program to arrive finishing
the row (one kernel, no merge kernel) at that count ("last"; session 18's run, when that rule was the default,
timed "default" and "last" at it), 3 and 4 splits; CUDA-graph medians of 5 interleaved
rounds on the engine's batch shapes (kernel_decode.py's K3-K8 and a few more). Session 18 on an H100: the last
arrival no faster than the merge kernel, one split as fast or faster (docs/benchmarks/kernel_decode.md).

    PYTHONPATH=. python benchmarks/attn_finish_ab.py      # OUT=folder for attn_finish_ab.json
"""
import json, os, sys
import torch
sys.path.insert(0, os.path.dirname(__file__))
from kernel_decode import Case, SHAPES, graph_time_ms

shapes = dict(SHAPES)
shapes.update({"B64_1152": (64, 16, 8, 128, 1152), "B96": (96, 16, 8, 128, 1152), "B256_1152": (256, 16, 8, 128, 1152),
               "B16": (16, 16, 8, 128, 1152), "B64_h64": (64, 32, 8, 64, 1024)})
variants = {"default": {}, "split1": dict(num_splits=1), "last_s3": dict(finish="last", num_splits=3),
            "last_s4": dict(finish="last", num_splits=4)}


def old_splits(slots, capacity, sms=132):
    """The launcher's split count for attention alone before session 18 (no one-split shortcut)."""
    return max(1, min(max(1, round(16 * sms / (slots * 8))), capacity // 512))
rows = []
for name in ["K4", "K6", "K5", "K7", "B16", "B96", "B64_h64", "K8", "K3"]:
    case = Case(shapes[name])
    ref_out = case.ref[0]
    variants["old_default"] = dict(num_splits=old_splits(shapes[name][0], shapes[name][4]))
    variants["last"] = dict(finish="last", num_splits=old_splits(shapes[name][0], shapes[name][4]))
    times = {v: [] for v in variants}
    for r in range(5):
        for v, cfg in variants.items():
            fn = lambda cfg=cfg: case.attention(**cfg)
            out = fn()[0]
            err = float((out.float() - ref_out).norm() / ref_out.norm())
            assert err < 2e-2, (name, v, err)
            times[v].append(graph_time_ms(fn, reps=9))
    med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    sdpa = graph_time_ms(case.sdpa)
    rows.append({"shape": name, "dims": shapes[name], "sdpa_ms": sdpa, "median_ms": med})
    print(name, shapes[name], "sdpa %.1f us" % (sdpa * 1e3),
          " ".join(f"{v} {m * 1e3:.1f}" for v, m in med.items()), flush=True)
    del case
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "attn_finish_ab.json"), "w"), indent=1)
