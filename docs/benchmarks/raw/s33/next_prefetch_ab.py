"""The decode kernel's wave boundaries at the engine's batches (session 33, issue 16 §4): the next wave's row asked
of L2 while a program finishes, and the finishing pass's inputs asked of L2 at a program's start.

    PYTHONPATH=.:benchmarks python benchmarks/next_prefetch_ab.py --out OUT [--rounds 3] [--dims s:hq:hkv:d:c,...]

At rows >= SMs with one split per row, the statistic's programs stream their row and then finish it (the logits
re-read from L2, the positions and cached norms read, the argmin reduced and stored): ~2 us a wave boundary in which
the programs that started together leave the memory idle (session 32's K4 / K5 / K3: the statistic 4.1-4.6% over
attention alone, ~2 us per wave). Arms (module switches of ``kvroll.kernels.decode_attention`` read at call time,
each call captured in its own CUDA graph): ``NEXT_PREFETCH`` tiles of the row ``NEXT_PER_SM`` x SMs rows on (the
row the program of the next wave takes) asked of L2 after the K loop (or at the start, ``NEXT_EARLY``), and
``FIN_PREFETCH``. Each arm is checked against the fp32 reference (output, argmin tie) or, for Hard-KV's call (the
mass added into a running sum, per-head lengths), bit for bit against the base arm. Rounds interleaved in a rotated
order; medians; the floor is the call's K and V bytes over the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from kernel_decode import Case, check, graph_time_ms
from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels import decode_attention as da

ARMS = {"base": (0, 0, False, False), "fin": (0, 0, False, True), "n1": (1, 0, False, False),
        "n2": (2, 0, False, False), "n4": (4, 0, False, False), "n2fin": (2, 0, False, True),
        "n1fin": (1, 0, False, True), "n2early": (2, 0, True, False), "n2ps+1": (2, 1, False, False),
        "n2ps-1": (2, -1, False, False)}

DIMS = [  # (slots, Hq, Hkv, head_dim, capacity, call)
    (64, 16, 8, 128, 1024, "longflow"), (128, 16, 8, 128, 1024, "longflow"), (256, 16, 8, 128, 1024, "longflow"),
    (352, 16, 8, 128, 1024, "longflow"), (48, 16, 8, 128, 1024, "longflow"), (96, 16, 8, 128, 1024, "longflow"),
    (256, 16, 8, 128, 1152, "longflow"), (64, 32, 8, 128, 1024, "longflow"), (64, 64, 8, 128, 1024, "longflow"),
    (64, 32, 8, 64, 1024, "longflow"), (128, 32, 8, 64, 1024, "longflow"), (64, 16, 8, 128, 4096, "longflow"),
    (64, 16, 8, 128, 1024, "hardkv"), (256, 16, 8, 128, 1024, "hardkv"),
    (64, 16, 8, 128, 1024, "attention"), (256, 16, 8, 128, 1024, "attention"),
]


def switched(fn, tiles, per_sm_delta, early, fin, base_per_sm):
    def call():
        da.NEXT_PREFETCH, da.NEXT_EARLY, da.FIN_PREFETCH = tiles, early, fin
        da.NEXT_PER_SM = base_per_sm + per_sm_delta if per_sm_delta else 0
        try:
            return fn()
        finally:
            da.NEXT_PREFETCH, da.NEXT_PER_SM, da.NEXT_EARLY, da.FIN_PREFETCH = 0, 0, False, False
    return call


def hardkv_call(case, gen):
    """Hard-KV's call as the cache makes it: the mass added into the votes' running sum, per-head lengths of a
    compressed cache (~700 of 1,024, as its steady state), no argmin."""
    slots, hkv, cap = case.k.shape[0], case.k.shape[1], case.k.shape[2]
    length = torch.randint(cap * 55 // 100, cap * 85 // 100, (slots, hkv), device="cuda", generator=gen)
    votes = torch.zeros(slots, hkv, cap, dtype=torch.float32, device="cuda")

    def call():
        return da.decode_attention(case.q, case.k, case.v, case.pos, case.cur, case.scale, stat="mass", argmin=False,
                                   length=length, return_stat=True, dense=True, stat_into=votes)
    return call, votes


def run_shape(dims, rounds, bandwidth):
    slots, hq, hkv, d, cap, kind = dims
    case = Case((slots, hq, hkv, d, cap))
    gen = torch.Generator(device="cuda").manual_seed(1)
    row = {"dims": list(dims), "checks": {}}
    kv_bytes = 2 * case.k.numel() * case.k.element_size()
    if kind == "longflow":
        fn = lambda: case.fused(vnorm=True, dense=True)  # noqa: E731
    elif kind == "attention":
        fn = lambda: case.attention(dense=True)  # noqa: E731
    else:
        fn, votes = hardkv_call(case, gen)
    stages = 2 if kind == "longflow" and da.stat_two_stages(slots * hkv, d, cap, hq // hkv, case.q.device) else 3
    base_per_sm = da.resident_programs(64, d, 2, stages, case.q.device)
    row["per_sm"] = base_per_sm
    fns, base_out = {}, None
    for label, (tiles, dps, early, fin) in ARMS.items():
        call = switched(fn, tiles, dps, early, fin, base_per_sm)
        try:
            if kind == "longflow":
                row["checks"][label] = check(call(), case.ref)
            else:
                if kind == "hardkv":
                    votes.zero_()
                out = call()[0]
                got = (out.clone(), votes.clone()) if kind == "hardkv" else (out.clone(),)
                if base_out is None:
                    base_out = got
                row["checks"][label] = {"equal_to_base": all(torch.equal(a, b) for a, b in zip(got, base_out))}
            fns[label] = call
        except Exception as err:  # reported, not fatal
            row["checks"][label] = {"error": (str(err).splitlines() or [type(err).__name__])[0][:160]}
    times = {label: [] for label in fns}
    order = list(fns)
    for r in range(rounds):
        for label in order[r % len(order):] + order[:r % len(order)]:
            times[label].append(graph_time_ms(fns[label], reps=9))
    row["ms"] = {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}
    row["floor_ms"] = kv_bytes / bandwidth * 1e3
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument("--dims", default="", help="s:hq:hkv:d:c:call,... instead of the list")
    args = parser.parse_args()
    grid = [tuple(int(x) for x in d.split(":")[:5]) + (d.split(":")[5],) for d in args.dims.split(",")] \
        if args.dims else DIMS
    bandwidth = copy_bandwidth(torch.device("cuda"))
    start, rows = time.time(), []
    for dims in grid:
        if time.time() - start > args.budget_s:
            print("budget spent: stopped before", dims)
            break
        row = run_shape(dims, args.rounds, bandwidth)
        rows.append(row)
        ms, base = row["ms"], row["ms"].get("base")
        cells = " ".join(f"{k} {v / base:.3f}" for k, v in ms.items() if k != "base") if base else ""
        bad = {k: v for k, v in row["checks"].items() if v.get("error") or v.get("argmin_ok") is False
               or v.get("equal_to_base") is False}
        print(tuple(row["dims"]), f"per_sm {row['per_sm']} base {base * 1e3:.2f} us, {base / row['floor_ms']:.3f}x"
              f" floor |", cells, bad or "", flush=True)
        torch.cuda.empty_cache()
    write_json(os.path.join(args.out, "next_prefetch_ab.json"),
               {"device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "rows": rows,
                "seconds": time.time() - start})


if __name__ == "__main__":
    main()
