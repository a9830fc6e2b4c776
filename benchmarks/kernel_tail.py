"""The rollout's long tail: the fused decode kernel at batch 1-8 against SDPA, on a grid of shapes (bf16).

    PYTHONPATH=. python benchmarks/kernel_tail.py --out OUT [--mode check|explore|tune|splits|budget] [--budget-s 400]
        [--shapes 8x64x8x2048,...]

Shapes (``--mode check``): slots (1, 4, 8) x head_dim (128, 64) x GQA group (1, 2, 4, 8) x capacity (8192, 32768),
the issue's long tail, then slots (1, 8) at capacity 2048 (a compressed cache's budget); 8 KV heads, every slot
live (``kernel_decode.make_inputs``). Calls are timed as ``kernel_decode.graph_time_ms`` (CUDA graph of 10 calls,
median of replays) after a check against the fp32 reference.

``--mode check``: per shape, SDPA, the launcher's defaults for attention alone and for the statistic (as the
engine calls it: LongFlow's ``contrib`` with cached norms, dense, argmin only), the same calls with the tile and
split rule of sessions 10-12 ("old"), and the defaults without the merge's programmatic dependent launch ("no
PDL"): a before/after of the launcher in one run (the kernels are the new ones in all).
Then ``EDGES``: shapes at the rule's edges, odd capacities.
``--mode explore``: per shape (a smaller grid), a search over splits (x1-8 of the old default for attention, x0.5-4
with the statistic) and the finishing mode (the last program to arrive; the merge kernel, one program per row or
in chunks of 512-2048 tokens).
``--mode tune``: the worst shapes of session 10's check; per shape the kernels' device times at the defaults
(split pass vs merge, ``kernel_decode.kernel_profile``), then a search over the split pass's tile (block_n 64 /
128), warps (4 / 8), pipeline stages (2-4) and splits (x0.5-4 of the default), for attention alone and with the
statistic (3-4 stages, x0.5-2 splits, finished by the merge kernel in 512 / 1,024-token chunks or by the last
program to arrive).
``--mode splits``: rows 8-64 (slots 1-8) x 2k-32k tokens x (head_dim, group) (128, 8), (128, 1), (64, 4); at the
launcher's tile, the time of each number of splits (1-64, and 1, 2 and 4 programs per SM), attention alone and with
the statistic: the data the long-tail split rule is fitted to.
``--mode budget``: a compressed cache's steady state in the tail (slots 1-8 x capacity 512 / 1,024 / 2,048 x
(head_dim, group) (128, 2), (128, 8), (64, 4)): the statistic's call over splits 1-16 x finishing modes.
Writes kernel_tail_MODE.json and prints one line per shape as it goes; stops at ``--budget-s``, reporting what ran.
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import torch

from kernel_decode import Case, base_splits_before_s18, check, graph_time_ms
from kvroll.bench.report import write_json
from kvroll.kernels import decode_launch as dl

KV_HEADS = 8


def session12_splits(slots, num_kv_heads, capacity, block_n, device, stat):
    """The split rule of sessions 10-12 (64-token tiles), to time the launcher's before/after in one run."""
    sms, rows = dl.sm_count(device), slots * num_kv_heads
    splits = base_splits_before_s18(rows, capacity, block_n, sms, stat)
    if dl.long_tail(slots, num_kv_heads, capacity, block_n, device, stat):
        splits = max(splits, min(-(-sms // rows), capacity // ((4 if stat else 2) * block_n)))
    return splits


TUNE = [(1, 128, 8, 32768), (1, 64, 4, 32768), (4, 128, 8, 32768), (4, 64, 8, 32768), (8, 64, 8, 8192),
        (1, 64, 2, 8192), (1, 128, 1, 8192), (8, 128, 8, 8192), (1, 128, 8, 2048), (8, 64, 8, 2048)]


def grid(mode):
    if mode == "tune":
        return TUNE
    if mode == "budget":  # a compressed cache's steady state in the tail: slots 1-8 x budgets 512-2048
        return [(s, d, g, c) for c, (d, g), s in itertools.product((1024, 512, 2048), ((128, 2), (128, 8), (64, 4)),
                                                                    (1, 2, 4, 8))]
    if mode == "splits":  # rows 8-64 x 2k-32k tokens x three (head_dim, group) pairs
        return [(s, d, g, c) for (d, g), c, s in itertools.product(((128, 8), (128, 1), (64, 4)),
                                                                    (2048, 4096, 8192, 16384, 32768), (1, 2, 4, 8))]
    if mode == "explore":
        return [(s, d, g, c) for d, g, c, s in itertools.product((128, 64), (4, 1, 8), (32768, 2048), (1, 8))]
    goal = [(s, d, g, c) for c, d, g, s in itertools.product((8192, 32768), (128, 64), (1, 2, 4, 8), (1, 4, 8))]
    return goal + [(s, d, g, 2048) for d, g, s in itertools.product((128, 64), (1, 2, 4, 8), (1, 8))] + EDGES


# shapes at the tail rule's edges, named by no goal: 16 rows (128 (slot, head) rows, just under an H200's 132 SMs)
# at 1k-4k tokens, 2 rows at 16k, odd capacities
EDGES = [(16, 128, 2, 1024), (16, 64, 4, 4096), (2, 128, 8, 16384), (3, 64, 2, 12289), (1, 128, 4, 3000),
         (12, 128, 2, 6000)]


def parse_shapes(text):
    """``--shapes``: "SLOTSxHEAD_DIMxGROUPxCAPACITY,..." as the grid's (slots, head_dim, group, capacity) tuples."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise SystemExit(f"kernel_tail.py: --shapes item {item!r} is not SLOTSxHEAD_DIMxGROUPxCAPACITY "
                             "(positive integers, e.g. 8x64x8x2048)")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


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
    if mode == "splits":
        return splits_shape(case, row, block_n, attn, fused)
    if mode == "budget":
        return budget_shape(case, row, attn, fused)
    if mode == "tune":
        return tune_shape(case, row, block_n, attn, fused)
    attn_err = attention_ok(case, attn())
    if attn_err["rel_err"] > 2e-2:
        row["attention_error"] = attn_err
    row["attn_default"] = graph_time_ms(attn())
    row["stat_default"] = measure(fused(), case.ref)["ms"]
    old_a = session12_splits(slots, KV_HEADS, capacity, block_n, case.q.device, stat=False)
    old_s = session12_splits(slots, KV_HEADS, capacity, block_n, case.q.device, stat=True)
    row["old_splits"] = [old_a, old_s]
    row["attn_old"] = graph_time_ms(attn(num_splits=old_a, block_n=block_n))
    row["stat_old"] = measure(fused(num_splits=old_s, block_n=block_n), case.ref)["ms"]
    # session 13-17's logit store and discard (since session 18 the defaults give the tail "asm", no discard)
    row["stat_prev"] = measure(fused(logit_store="late", logit_discard=True), case.ref)["ms"]
    row["attn_nopdl"] = graph_time_ms(attn(pdl=False))  # the defaults with an ordinary launch of the merge
    row["stat_nopdl"] = measure(fused(pdl=False), case.ref)["ms"]
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


def tune_shape(case, row, block_n, attn, fused):
    """``--mode tune``: the defaults' kernels, then the phase-1 search (see the module docstring)."""
    from kernel_decode import kernel_profile

    slots, _, _, head_dim, capacity = row["dims"]
    dev = case.q.device
    row["attn_default"] = graph_time_ms(attn())
    row["stat_default"] = measure(fused(), case.ref)["ms"]
    row["profile_us"] = {"attention": kernel_profile(attn()), "stat": kernel_profile(fused())}
    group = row["dims"][1] // KV_HEADS  # the launcher's rule depends on it (tail_stat_split)
    base = {stat: dl.default_splits(slots, KV_HEADS, capacity, block_n, dev, stat=stat, head_dim=head_dim,
                                    group=group) for stat in (False, True)}
    row["default_splits"] = [base[False], base[True]]
    row["attn_search"], row["stat_search"] = {}, {}
    for bn, warps, stages in itertools.product((64, 128), (4, 8), (2, 3, 4)):
        if bn == 128 and head_dim == 128 and stages == 4:
            continue  # 4 x 64 KB of K/V tiles: over the shared memory
        for stat in (False, True):
            if stat and stages == 2:
                continue
            scale_bn = block_n / bn  # the same tokens per split as the default at the default tile
            for m in ((0.5, 1, 2) if stat else (0.5, 1, 2, 4)):
                n = max(1, min(capacity // bn, int(base[stat] * m * scale_bn) or 1))
                for finish, chunk in ((("merge", 512), ("merge", 1024), ("last", None)) if stat
                                      else ((None, None),)):
                    cfg = dict(block_n=bn, num_warps=warps, num_stages=stages, num_splits=n)
                    label = f"bn{bn}/w{warps}/s{stages}/n{n}" + (f"/c{chunk}" if chunk else "") + \
                        ("/last" if finish == "last" else "")
                    search = row["stat_search" if stat else "attn_search"]
                    if label in search:
                        continue
                    if stat:
                        search[label] = measure(fused(finish=finish, finish_chunk=chunk, **cfg), case.ref)["ms"]
                    else:
                        try:
                            search[label] = graph_time_ms(attn(**cfg))
                        except Exception as err:  # a config the compiler rejects
                            search[label] = None
                            row.setdefault("errors", {})[label] = str(err).splitlines()[0][:120] if str(err) else ""
    for key in ("attn", "stat"):
        times = {k: v for k, v in row[f"{key}_search"].items() if v}
        row[f"{key}_best"] = min(times, key=times.get) if times else None
    return row


def splits_shape(case, row, block_n, attn, fused):
    """``--mode splits``: at the launcher's tile, warps and stages, the time per number of splits (1-64 and one
    program per SM), attention alone and with the statistic (finished by the merge kernel in 1,024-token chunks)."""
    slots, _, _, head_dim, capacity = row["dims"]
    dev = case.q.device
    bn = dl.tail_block_n(head_dim, capacity, case.q.dtype, dev, 3) or block_n
    sms, rows_ = dl.sm_count(dev), slots * KV_HEADS
    row["block_n"] = bn
    group = row["dims"][1] // KV_HEADS  # the launcher's rule depends on it (tail_stat_split)
    row["default_splits"] = [dl.default_splits(slots, KV_HEADS, capacity, bn, dev, stat=stat, head_dim=head_dim,
                                               group=group) for stat in (False, True)]
    row["attn_default"] = graph_time_ms(attn())
    row["stat_default"] = measure(fused(), case.ref)["ms"]
    row["attn_splits"], row["stat_splits"] = {}, {}
    for n in sorted({1, 2, 4, 8, 16, 32, 64, -(-sms // rows_), -(-2 * sms // rows_), -(-4 * sms // rows_)}):
        if n > capacity // bn:
            continue
        row["attn_splits"][n] = graph_time_ms(attn(num_splits=n, block_n=bn))
        if n <= capacity // max(bn, 256):
            row["stat_splits"][n] = measure(fused(num_splits=n, block_n=bn, finish="merge", finish_chunk=1024),
                                            case.ref)["ms"]
    for key in ("attn", "stat"):
        times = {k: v for k, v in row[f"{key}_splits"].items() if v}
        row[f"{key}_best"] = min(times, key=times.get) if times else None
    return row


def budget_shape(case, row, attn, fused):
    """``--mode budget``: the statistic's call at the defaults, then splits 1-16 x the finishing modes (the last
    program to arrive; the merge kernel in chunks of 256 / 1,024 tokens; the program itself with one split)."""
    slots, _, _, head_dim, capacity = row["dims"]
    row["attn_default"] = graph_time_ms(attn())
    row["stat_default"] = measure(fused(), case.ref)["ms"]
    row["default_splits"] = dl.default_splits(slots, KV_HEADS, capacity, 64, case.q.device, stat=True,
                                              head_dim=head_dim, group=row["dims"][1] // KV_HEADS)
    row["stat_search"] = {}
    for n in (1, 2, 4, 8, 16):
        if n > capacity // 64:
            continue
        modes = [("last", None), ("merge", 256), ("merge", 1024)] + ([("epilogue", None)] if n == 1 else [])
        for finish, chunk in modes:
            row["stat_search"][f"{n}/{finish}/{chunk}"] = measure(
                fused(num_splits=n, finish=finish, finish_chunk=chunk), case.ref)["ms"]
    times = {k: v for k, v in row["stat_search"].items() if v}
    row["stat_best"] = min(times, key=times.get) if times else None
    return row


def fmt_(v, sd):
    """A time as a multiple of SDPA's, "x" for a call that did not run or check out."""
    return f"{v / sd:.2f}" if v else "x"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--mode", choices=("explore", "check", "tune", "splits", "budget"), default="check")
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--shapes", default="",
                        help="comma-separated SLOTSxHEAD_DIMxGROUPxCAPACITY (e.g. 8x64x8x2048) instead of the "
                             "mode's grid")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start, rows = time.time(), []
    shapes = parse_shapes(args.shapes) if args.shapes else grid(args.mode)
    path = os.path.join(args.out, f"kernel_tail_{args.mode}.json")
    for shape in shapes:
        if time.time() - start > args.budget_s:
            break
        row = run_shape(*shape, args.mode)
        rows.append(row)
        torch.cuda.empty_cache()  # the shape's tensors went with its frame
        sd = row["sdpa"]
        extra = f" best stat {row['stat_best']} {row['stat_search'].get(row['stat_best'])}" \
            f" attn {row['attn_best']} {row['attn_search'][row['attn_best']]:.4f}" \
            if args.mode in ("explore", "tune") else ""
        if args.mode == "budget":
            best = row["stat_best"]
            extra = f" | best {best} {fmt_(row['stat_search'].get(best), sd)} | " + " ".join(
                f"{k}:{fmt_(v, sd)}" for k, v in row["stat_search"].items()) + \
                f" | default splits {row['default_splits']}"
        if args.mode == "splits":
            extra = " | splits attn " + " ".join(f"{n}:{v / sd:.2f}" for n, v in row["attn_splits"].items()) + \
                " | stat " + " ".join(f"{n}:{fmt_(v, sd)}" for n, v in row["stat_splits"].items()) + \
                f" | defaults {row['default_splits']} bn {row['block_n']}"
        if args.mode == "tune":
            rows_ok = lambda s: {k: v for k, v in row[s].items() if v}  # noqa: E731
            extra += f" | attn best {min(rows_ok('attn_search').values()) / sd:.2f} stat best " \
                f"{min(rows_ok('stat_search').values()) / sd:.2f} x SDPA; profile {row['profile_us']}"
        old = f" (old {fmt_(row['attn_old'], sd)})" if "attn_old" in row else ""
        old_s = f" (old {fmt_(row['stat_old'], sd)}) x SDPA, old splits {row['old_splits']}" \
            if "stat_old" in row else ""
        if "attn_nopdl" in row:
            old_s += f" | no PDL: attn {fmt_(row['attn_nopdl'], sd)} stat {fmt_(row['stat_nopdl'], sd)}"
        if "stat_prev" in row:
            old_s += f" | late store + discard: stat {fmt_(row['stat_prev'], sd)}"
        print(f"{shape}: sdpa {sd:.4f} ms | attn {fmt_(row['attn_default'], sd)}{old} | stat "
              f"{fmt_(row['stat_default'], sd)}{old_s}" + extra, flush=True)
        write_json(path, {"device": torch.cuda.get_device_name(), "mode": args.mode, "rows": rows,
                          "shapes_planned": len(shapes), "seconds": time.time() - start})
    print(f"{len(rows)} of {len(shapes)} shapes in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
