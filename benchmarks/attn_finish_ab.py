"""Attention alone (no statistic): the launcher's default and one split against the split count of the rule
before session 18 ("old_default", finished by the merge kernel) and against the last program to arrive finishing
the row (one kernel, no merge kernel) at that count ("last"; session 18's run, when that rule was the default,
timed "default" and "last" at it), 3 and 4 splits; CUDA-graph medians of 5 interleaved
rounds on the engine's batch shapes (kernel_decode.py's K3-K8 and a few more). Session 18 on an H100: the last
arrival no faster than the merge kernel, one split as fast or faster (docs/benchmarks/kernel_decode.md).

    PYTHONPATH=. python benchmarks/attn_finish_ab.py      # OUT=folder for attn_finish_ab.json
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from kernel_decode import SHAPES, Case, base_splits_before_s18, graph_time_ms, interleaved  # noqa: E402
from kernel_tail import attention_ok  # noqa: E402
from kvroll.kernels import decode_launch as dl  # noqa: E402

shapes = {**SHAPES, "B64_1152": (64, 16, 8, 128, 1152), "B96": (96, 16, 8, 128, 1152),
          "B256_1152": (256, 16, 8, 128, 1152), "B16": (16, 16, 8, 128, 1152), "B64_h64": (64, 32, 8, 64, 1024)}
rows = []
for name in ["K4", "K6", "K5", "K7", "B16", "B96", "B64_h64", "K8", "K3"]:
    case = Case(shapes[name])
    slots, _, kv_heads, _, capacity = shapes[name]
    old = base_splits_before_s18(slots * kv_heads, capacity, 64, dl.sm_count(torch.device("cuda")), False)
    variants = {"default": {}, "split1": dict(num_splits=1), "last_s3": dict(finish="last", num_splits=3),
                "last_s4": dict(finish="last", num_splits=4), "old_default": dict(num_splits=old),
                "last": dict(finish="last", num_splits=old)}
    fns = {v: (lambda cfg=cfg: case.attention(**cfg)) for v, cfg in variants.items()}
    for v, fn in fns.items():
        err = attention_ok(case, fn)["rel_err"]
        assert err < 2e-2, (name, v, err)
    med = interleaved(fns, 5)
    sdpa = graph_time_ms(case.sdpa)
    rows.append({"shape": name, "dims": shapes[name], "sdpa_ms": sdpa, "median_ms": med})
    print(name, shapes[name], "sdpa %.1f us" % (sdpa * 1e3),
          " ".join(f"{v} {m * 1e3:.1f}" for v, m in med.items()), flush=True)
    del case
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "attn_finish_ab.json"), "w"), indent=1)
