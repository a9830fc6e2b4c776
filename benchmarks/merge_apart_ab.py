"""The long tail's merge kernel with its programs apart, against the joint merge (session 32, issue 16 §3).

    PYTHONPATH=.:benchmarks python benchmarks/merge_apart_ab.py --out OUT [--rounds 3] [--grid tail|one_slot]
        [--dims slots:head_dim:group:capacity,...]

Where the long tail finishes its rows in the merge kernel's chunks (``finish="merge"``, ``finish_chunk``), each of
those programs merged a slice of the splits' outputs (two passes over the splits' maxima) and then scored a chunk of
the logits: two chains of dependent loads in one program, before the arrival that reduces the partial argmins.
``MERGE_APART`` gives the slices and the chunks to different programs, ``MERGE_ONE_PASS`` merges every split in one
load. Arms (both switches read at call time, each call captured in its own CUDA graph): "new" (both on), "old"
(both off), "one" (the one-pass merge alone); attention alone (no statistic: the merge only) with and without the
one-pass merge; SDPA. Rounds interleaved in a rotated order; medians. Each statistic arm is first checked against
the fp32 reference (output, argmin tie); attention's output against it.
Shapes (``tail``): one slot at 2k / 8k / 32k tokens x head_dim 128 / 64 x groups 1-8, and the goal grid's other
shapes over 1.4x SDPA (session 32's check: 4 and 8 slots at head_dim 64), odd capacities. Writes
merge_apart_ab.json.
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

from kernel_decode import Case, graph_time_ms
from kernel_tail import KV_HEADS, attention_ok, measure
from kvroll.bench.report import write_json
from kvroll.kernels import decode_launch as dl

ARMS = {"new": (True, True), "old": (False, False), "one": (False, True)}


def shapes(which):
    one_slot = [(1, d, g, c) for c, d, g in itertools.product((8192, 2048, 32768), (64, 128), (1, 2, 4, 8))]
    others = [(4, 64, 8, 8192), (8, 64, 8, 8192), (4, 64, 8, 32768), (8, 64, 8, 32768), (8, 64, 8, 2048),
              (8, 64, 4, 2048), (2, 128, 8, 16384), (3, 64, 2, 12289), (1, 128, 4, 3000), (1, 128, 2, 1024),
              (2, 64, 4, 1536)]
    return one_slot + others if which == "tail" else one_slot


def switched(fn, apart, one):
    def call():
        dl.MERGE_APART, dl.MERGE_ONE_PASS = apart, one
        return fn()
    return call


def run_shape(slots, head_dim, group, capacity, rounds):
    case = Case((slots, KV_HEADS * group, KV_HEADS, head_dim, capacity))
    row = {"dims": [slots, KV_HEADS * group, KV_HEADS, head_dim, capacity], "checks": {}}
    fns = {"sdpa": case.sdpa}
    for label, (apart, one) in ARMS.items():
        fn = switched(lambda: case.fused(vnorm=True, dense=True), apart, one)
        row["checks"][label] = measure(fn, case.ref)
        if row["checks"][label]["ms"] is not None:
            fns["stat_" + label] = fn
    for label, one in (("attn_one", True), ("attn_old", False)):
        fn = switched(lambda: case.attention(dense=True), False, one)
        row["checks"][label] = attention_ok(case, fn)
        fns[label] = fn
    times = {label: [] for label in fns}
    order = list(fns)
    for r in range(rounds):
        for label in order[r % len(order):] + order[:r % len(order)]:
            times[label].append(graph_time_ms(fns[label], reps=9))
    row["ms"] = {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}
    dl.MERGE_APART, dl.MERGE_ONE_PASS = True, True
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--grid", choices=("tail", "one_slot"), default="tail")
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--dims", default="", help="shapes instead of the grid: slots:head_dim:group:capacity,...")
    args = parser.parse_args()
    start, rows = time.time(), []
    grid = [tuple(int(x) for x in d.split(":")) for d in args.dims.split(",")] if args.dims else shapes(args.grid)
    for dims in grid:
        if time.time() - start > args.budget_s:
            print("budget spent: stopped before", dims)
            break
        row = run_shape(*dims, args.rounds)
        rows.append(row)
        ms, sdpa = row["ms"], row["ms"]["sdpa"]
        cells = " ".join(f"{k} {v / sdpa:.3f}" for k, v in ms.items() if k != "sdpa")
        bad = {k: v for k, v in row["checks"].items() if v.get("ms", 0) is None or v.get("error")}
        print(tuple(row["dims"]), f"sdpa {sdpa * 1e3:.2f} us |", cells,
              f"| new/old stat {ms.get('stat_new', 0) / ms.get('stat_old', 1):.3f}", bad or "", flush=True)
        torch.cuda.empty_cache()
    write_json(os.path.join(args.out, "merge_apart_ab.json"),
               {"device": torch.cuda.get_device_name(), "rows": rows, "seconds": time.time() - start})


if __name__ == "__main__":
    main()
