"""The long tail's finish at 2,048 tokens with many query heads per KV head: who finishes the statistic, in how many
programs, with how many warps (session 36, issue 16 §3).

    PYTHONPATH=.:benchmarks python benchmarks/tail_finish_probe.py --out OUT [--rounds 3] [--budget-s 500]
        [--dims slots:head_dim:group:capacity,...]

Session 33's check left two of §3's 64 shapes over 1.5x SDPA with LongFlow's statistic, both at head_dim 64, 8 query
heads per KV head and 2,048 tokens: one slot (1.54x; the merge kernel finishes, its chunks apart from its merge
slices) and 8 slots (1.64x; 2 splits, the last program to arrive at a row finishes its 16k logits alone). Arms, per
shape (each checked against the fp32 reference first: output, argmin tie; then timed in its own CUDA graph, rounds
interleaved in a rotated order, medians):

* ``default``: the launcher's choice;
* ``last/nN/wW``: N splits finished by the last arrival, the split kernel at W warps (its finish runs at W too);
* ``merge/nN/cC/mwW``: N splits, the merge kernel finishing the statistic in chunks of C tokens at W warps
  (``MERGE_WARPS``);
* SDPA, and attention alone at the defaults.

Writes tail_finish_probe.json.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from kernel_decode import Case, graph_time_ms
from kernel_tail import KV_HEADS, measure
from kvroll.bench.report import write_json
from kvroll.kernels import decode_launch as dl

SHAPES = [(8, 64, 8, 2048), (1, 64, 8, 2048), (8, 64, 4, 2048), (4, 64, 8, 2048), (8, 128, 8, 2048),
          (1, 128, 8, 2048), (2, 64, 8, 2048)]


def arms(capacity):
    out = {"default": {}}
    for n in (2, 4, 8):
        if n <= capacity // 256:
            for w in (4, 8):
                out[f"last/n{n}/w{w}"] = dict(finish="last", num_splits=n, num_warps=w)
    for n in (4, 8, 16):
        for c in (256, 512, 1024):
            for mw in (4, 8):
                if n == 16 and c == 1024:
                    continue
                out[f"merge/n{n}/c{c}/mw{mw}"] = dict(finish="merge", num_splits=n, finish_chunk=c, merge_warps=mw)
    return out


def configured(fn, cfg):
    cfg = dict(cfg)
    merge_warps = cfg.pop("merge_warps", 4)

    def call():
        dl.MERGE_WARPS = merge_warps
        return fn(**cfg)
    return call


def run_shape(slots, head_dim, group, capacity, rounds):
    case = Case((slots, KV_HEADS * group, KV_HEADS, head_dim, capacity))
    row = {"dims": [slots, KV_HEADS * group, KV_HEADS, head_dim, capacity], "checks": {}}
    fns = {"sdpa": case.sdpa, "attn": lambda: case.attention(dense=True)}
    for label, cfg in arms(capacity).items():
        fn = configured(lambda **kw: case.fused(vnorm=True, dense=True, **kw), cfg)
        row["checks"][label] = measure(fn, case.ref)
        if row["checks"][label]["ms"] is not None:
            fns[label] = fn
    dl.MERGE_WARPS = 4
    times = {label: [] for label in fns}
    order = list(fns)
    for r in range(rounds):
        for label in order[r % len(order):] + order[:r % len(order)]:
            times[label].append(graph_time_ms(fns[label], reps=9))
    dl.MERGE_WARPS = 4
    row["ms"] = {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=500.0)
    parser.add_argument("--dims", default="", help="shapes instead of the list: slots:head_dim:group:capacity,...")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start, rows = time.time(), []
    grid = [tuple(int(x) for x in d.split(":")) for d in args.dims.split(",")] if args.dims else SHAPES
    for dims in grid:
        if time.time() - start > args.budget_s:
            print("budget spent: stopped before", dims)
            break
        row = run_shape(*dims, args.rounds)
        rows.append(row)
        ms, sdpa = row["ms"], row["ms"]["sdpa"]
        stat = {k: v for k, v in ms.items() if k not in ("sdpa", "attn")}
        best = min(stat, key=stat.get)
        bad = {k: v for k, v in row["checks"].items() if v.get("ms") is None}
        print(tuple(row["dims"]), f"sdpa {sdpa * 1e3:.2f} us | attn {ms['attn'] / sdpa:.3f} | default "
              f"{ms['default'] / sdpa:.3f} | best {best} {ms[best] / sdpa:.3f} |",
              " ".join(f"{k} {v / sdpa:.3f}" for k, v in sorted(stat.items(), key=lambda kv: kv[1])),
              f"| failed {bad}" if bad else "", f"| {time.time() - start:.0f} s", flush=True)
        write_json(os.path.join(args.out, "tail_finish_probe.json"),
                   {"device": torch.cuda.get_device_name(), "rows": rows, "seconds": time.time() - start})
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
