"""The split kernel's finish with every load at once (``FINISH_EARLY``), and the long tail's shorter splits with a
statistic (``TAIL_SHORT_SPLITS``): each against main's arm, interleaved (session 36, issue 16 §3 / §4).

    PYTHONPATH=.:benchmarks python benchmarks/finish_early_ab.py --out OUT [--rounds 5] [--budget-s 300]
        [--part early,split]

``early``: LongFlow's call (cached norms, argmin) and Hard-KV's (the mass added into the votes, ``stat_into``)
at the engine's batches (64-352 slots x 16 query heads x 8 KV heads x head_dim 128 x 1,024 tokens: one split, the
program finishes its row) and in the long tail where the last program to arrive finishes (4-8 slots x 2,048
tokens), with ``FINISH_EARLY`` on ("new") and off ("old"); attention alone beside them.
``split``: one to three slots at 1,536-3,000 tokens (the merge kernel finishes), ``tail_stat_split``'s rule ("new")
against splits of 256 tokens at least ("old"); ``--part check2`` the rule's two-slot shapes.
Every arm is checked against the fp32 reference first (output, argmin tie) and timed in its own CUDA graph
(``kernel_decode.graph_time_ms``), rounds in a rotated order, medians. Writes finish_early_ab.json.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from kernel_decode import Case, graph_time_ms
from kernel_tail import KV_HEADS, measure
from kvroll.bench.report import write_json
from kvroll.kernels import decode_attention as da
from kvroll.kernels import decode_launch as dl

EARLY = [(64, 128, 2, 1024), (128, 128, 2, 1024), (256, 128, 2, 1024), (352, 128, 2, 1024), (48, 128, 2, 1024),
         (64, 64, 4, 1024), (8, 64, 8, 2048), (4, 64, 8, 2048), (8, 64, 4, 2048), (8, 128, 8, 2048),
         (8, 128, 2, 1024), (1, 128, 2, 1024)]
SPLIT = [(1, 64, 8, 2048), (1, 64, 4, 2048), (1, 64, 2, 2048), (1, 64, 1, 2048), (1, 128, 8, 2048),
         (1, 128, 4, 2048), (1, 128, 2, 2048), (1, 128, 1, 2048), (2, 64, 8, 2048), (2, 128, 8, 2048),
         (1, 64, 8, 1536), (1, 128, 2, 3000), (3, 64, 8, 2048)]
CHECK2 = [(2, 64, 1, 2048), (2, 64, 2, 2048), (2, 64, 4, 2048), (2, 128, 1, 2048), (2, 128, 2, 2048),
          (2, 128, 4, 2048), (2, 64, 8, 2048), (2, 64, 4, 3000), (1, 64, 8, 3000), (2, 128, 8, 2048)]
PARTS = {"early": EARLY, "split": SPLIT, "check2": CHECK2}


def switched(fn, **switches):
    def call():
        for name, value in switches.items():
            setattr(da, name, value)
        return fn()
    return call


def run_shape(part, slots, head_dim, group, capacity, rounds):
    case = Case((slots, KV_HEADS * group, KV_HEADS, head_dim, capacity))
    row = {"part": part, "dims": [slots, KV_HEADS * group, KV_HEADS, head_dim, capacity], "checks": {}}
    fns = {"sdpa": case.sdpa, "attn": lambda: case.attention(dense=True)}
    name = "FINISH_EARLY" if part == "early" else "TAIL_SHORT_SPLITS"
    values = {"new": True, "old": False}
    for label, value in values.items():
        fn = switched(lambda: case.fused(vnorm=True, dense=True), **{name: value})
        row["checks"][label] = measure(fn, case.ref)
        if row["checks"][label]["ms"] is not None:
            fns[label] = fn
        if part == "early":  # Hard-KV's call: the mass added into its votes, no argmin
            votes = torch.zeros(case.k.shape[:3], dtype=torch.float32, device=case.k.device)

            def hardkv():
                return da.decode_attention(case.q, case.k, case.v, case.pos, case.cur, case.scale, stat="mass",
                                           length=case.count, dense=True, stat_into=votes)
            fns["mass_" + label] = switched(hardkv, **{name: value})
    if part == "early":  # the votes of both arms, bit for bit, from the same start
        got = {}
        for label, value in values.items():
            setattr(da, name, value)
            votes = torch.zeros(case.k.shape[:3], dtype=torch.float32, device=case.k.device)
            da.decode_attention(case.q, case.k, case.v, case.pos, case.cur, case.scale, stat="mass",
                                length=case.count, dense=True, stat_into=votes)
            out = case.fused(vnorm=True, dense=True)
            got[label] = (votes, out[0], out[2])
        row["bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(got["new"], got["old"]))
    times = {label: [] for label in fns}
    order = list(fns)
    for r in range(rounds):
        for label in order[r % len(order):] + order[:r % len(order)]:
            times[label].append(graph_time_ms(fns[label], reps=9))
    dl.FINISH_EARLY, dl.TAIL_SHORT_SPLITS = True, True
    row["ms"] = {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--part", default="early,split")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start, rows = time.time(), []
    grid = [(part, *dims) for part in args.part.split(",") for dims in PARTS[part]]
    for part, *dims in grid:
        if time.time() - start > args.budget_s:
            print("budget spent: stopped before", part, dims)
            break
        row = run_shape(part, *dims, args.rounds)
        rows.append(row)
        ms, sdpa = row["ms"], row["ms"]["sdpa"]
        cells = " ".join(f"{k} {v / sdpa:.3f}" for k, v in ms.items() if k != "sdpa")
        ratio = f"new/old {ms.get('new', 0) / ms.get('old', 1):.3f}"
        if "mass_new" in ms:
            ratio += f" mass new/old {ms['mass_new'] / ms['mass_old']:.3f}"
        bad = {k: v for k, v in row["checks"].items() if v.get("ms") is None}
        print(part, tuple(row["dims"]), f"sdpa {sdpa * 1e3:.2f} us |", cells, "|", ratio,
              f"| bitwise {row.get('bitwise_equal')}" if part == "early" else "", bad or "", flush=True)
        write_json(os.path.join(args.out, "finish_early_ab.json"),
                   {"device": torch.cuda.get_device_name(), "rows": rows, "seconds": time.time() - start})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
