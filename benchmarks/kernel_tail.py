"""The rollout's long tail: the fused decode kernel at batch 1-8 against SDPA, on a grid of shapes (bf16).

    PYTHONPATH=. python benchmarks/kernel_tail.py --out OUT [--mode explore|check] [--budget-s 400]

Shapes (``--mode check``): slots (1, 4, 8) x head_dim (128, 64) x GQA group (1, 2, 4, 8) x capacity (8192, 32768),
the issue's long tail, then slots (1, 8) at capacity 2048 (a compressed cache's budget); 8 KV heads, every slot
live (``kernel_decode.make_inputs``). Calls are timed as ``kernel_decode.graph_time_ms`` (CUDA graph of 10 calls,
median of replays) after a check against the fp32 reference.

``--mode check``: per shape, SDPA, the launcher's defaults for attention alone and for the statistic (as the
engine calls it: LongFlow's ``contrib`` with cached norms, dense, argmin only) and the same calls with the
splits of the session-9 heuristic and its finishing (last arrival) with the statistic, for a before/after of the
heuristic in one run (the merge of the splits is the new one in both).
``--mode explore``: per shape (a smaller grid), a search over splits (x1-8 of the old default for attention, x0.5-4
with the statistic) and the finishing mode (the last program to arrive; the merge kernel, one program per row or
in chunks of 512-2048 tokens).
Writes kernel_tail.json and prints one line per shape as it goes; stops at ``--budget-s``, reporting what ran.
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

from kernel_decode import Case, check, graph_time_ms
from kvroll.bench.report import write_json
from kvroll.kernels import decode_attention as da

KV_HEADS = 8


def session9_splits(slots, num_kv_heads, capacity, block_n, device, stat):
    """The split heuristic before session 10 (the launcher's usual rule, without the long tail's), to time
    before/after in one run."""
    return da._base_splits(slots * num_kv_heads, capacity, block_n, da._sm_count(device), stat)


def grid(mode):
    if mode == "explore":
        return [(s, d, g, c) for d, g, c, s in itertools.product((128, 64), (4, 1, 8), (32768, 2048), (1, 8))]
    goal = [(s, d, g, c) for c, d, g, s in itertools.product((8192, 32768), (128, 64), (1, 2, 4, 8), (1, 4, 8))]
    return goal + [(s, d, g, 2048) for d, g, s in itertools.product((128, 64), (1, 2, 4, 8), (1, 8))]


def measure(fn, ref):
    """{"ms", "rel_err", "argmin_ok"} of a call with the statistic, timed only if its argmin checks out."""
    try:
        row = check(fn(), ref)
        if not row["argmin_ok"]:
            return {**row, "ms": None}
        return {**row, "ms": graph_time_ms(fn)}
    except Exception as err:  # reported, not fatal (a config the compiler rejects)
        return {"error": (str(err).splitlines() or [type(err).__name__])[0][:160], "ms": None}


def attention_ok(case, fn):
    out = fn()[0].float()
    return {"rel_err": float((out - case.ref[0]).norm() / case.ref[0].norm())}


def run_shape(slots, head_dim, group, capacity, mode):
    case = Case((slots, KV_HEADS * group, KV_HEADS, head_dim, capacity))
    row = {"dims": [slots, KV_HEADS * group, KV_HEADS, head_dim, capacity]}
    block_n = 64 if head_dim <= 128 else 32
    stat_call = dict(vnorm=True, dense=True)

    def attn(**cfg):
        return lambda: case.attention(dense=True, **cfg)

    def fused(**cfg):
        return lambda: case.fused(**stat_call, **cfg)

    row["sdpa"] = graph_time_ms(case.sdpa)
    attn_err = attention_ok(case, attn())
    if attn_err["rel_err"] > 2e-2:
        row["attention_error"] = attn_err
    row["attn_default"] = graph_time_ms(attn())
    row["stat_default"] = measure(fused(), case.ref)["ms"]
    old_a = session9_splits(slots, KV_HEADS, capacity, block_n, case.q.device, stat=False)
    old_s = session9_splits(slots, KV_HEADS, capacity, block_n, case.q.device, stat=True)
    row["old_splits"] = [old_a, old_s]
    row["attn_old"] = graph_time_ms(attn(num_splits=old_a))
    row["stat_old"] = measure(fused(num_splits=old_s, finish="last"), case.ref)["ms"]
    if mode == "explore":
        max_splits = max(1, capacity // block_n)
        row["attn_search"] = {}
        for m in (1, 2, 4, 8):
            n = min(max_splits, old_a * m)
            for finish in ("merge", "last"):
                label = f"{n}/{finish}"
                if label not in row["attn_search"]:
                    row["attn_search"][label] = graph_time_ms(attn(num_splits=n, finish=finish))
        row["stat_search"] = {}
        for m in (0.5, 1, 2, 4):
            n = max(1, min(max_splits, int(old_s * m)))
            for finish, chunk in (("last", None), ("merge", None), ("merge", 512), ("merge", 1024),
                                  ("merge", 2048)):
                label = f"{n}/{finish}/{chunk}"
                if label not in row["stat_search"]:
                    row["stat_search"][label] = measure(
                        fused(num_splits=n, finish=finish, finish_chunk=chunk), case.ref)["ms"]
        times = {k: v for k, v in row["stat_search"].items() if v}
        row["stat_best"] = min(times, key=times.get) if times else None
        row["attn_best"] = min(row["attn_search"], key=row["attn_search"].get)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--mode", choices=("explore", "check"), default="check")
    parser.add_argument("--budget-s", type=float, default=400.0)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start, rows = time.time(), []
    shapes = grid(args.mode)
    path = os.path.join(args.out, f"kernel_tail_{args.mode}.json")
    for shape in shapes:
        if time.time() - start > args.budget_s:
            break
        row = run_shape(*shape, args.mode)
        rows.append(row)
        torch.cuda.empty_cache()  # the shape's tensors went with its frame
        sd = row["sdpa"]
        extra = f" best stat {row['stat_best']} {row['stat_search'].get(row['stat_best'])}" \
            f" attn {row['attn_best']} {row['attn_search'][row['attn_best']]:.4f}" if args.mode == "explore" else ""
        fmt = lambda v: f"{v / sd:.2f}" if v else "x"  # noqa: E731
        print(f"{shape}: sdpa {sd:.4f} ms | attn {fmt(row['attn_default'])} (old {fmt(row['attn_old'])}) | stat "
              f"{fmt(row['stat_default'])} (old {fmt(row['stat_old'])}) x SDPA, old splits {row['old_splits']}"
              + extra, flush=True)
        write_json(path, {"device": torch.cuda.get_device_name(), "mode": args.mode, "rows": rows,
                          "shapes_planned": len(shapes), "seconds": time.time() - start})
    print(f"{len(rows)} of {len(shapes)} shapes in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
