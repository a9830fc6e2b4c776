"""Benchmark (a): the fused decode kernel against SDPA, unfused PyTorch and the copy-bandwidth floor (bf16).

    PYTHONPATH=. python benchmarks/kernel_decode.py --out docs/benchmarks   # on a CUDA GPU, ~3 min on an H100

Shapes (slots, Hq, Hkv, D, capacity): K1 = (128, 32, 8, 128, 3200), K2 = (64, 16, 8, 128, 16384),
K3 = (256, 16, 8, 128, 1152) by default; ``--shapes`` also takes K4 = (64, 16, 8, 128, 1024), K5 = (128, 16, 8,
128, 1024), K6 = (64, 16, 8, 128, 1152) (the engine's batches 64-128 at budget 1,024), K7 = (32, 16, 8, 128,
1024), K8 = (48, 32, 8, 64, 2048) (head_dim 64, GQA 4). Every cache slot is live (count = capacity). Each call is captured in a CUDA
graph (launch gaps excluded for all alike) and timed as the median of replays with device events.
floor = (K + V + pos + q + out bytes) / copy bandwidth, the bandwidth of a 4 GiB device-to-device copy
(read + write bytes) timed eagerly with events in the same run.

One run measures, per shape, every way the launcher can compute the statistic (``variants``: ||v||_1 in the
hot loop or cached, position reads or ``dense``, the finishing pass in a merge kernel, in-program or by the
last program to arrive), then a coordinate search from the fastest one over splits, finishing mode, phase-1
tile/warps/stages and the statistic block (``--budget-s`` of wall clock in all; what does not fit is listed as
skipped). Every timed call is first checked against the fp32 reference (output error, argmin ties); the
fastest call that passes is "fused". Writes kernel_decode.md (tables) and kernel_decode.json (everything).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels import decode_attention as da
from kvroll.kernels.cache_write import value_norm

SHAPES = {"K1": (128, 32, 8, 128, 3200), "K2": (64, 16, 8, 128, 16384), "K3": (256, 16, 8, 128, 1152),
          # the engine's steady state at smaller batches (session 12: 1.30x its bytes at 64 rows x 1,024 tokens)
          "K4": (64, 16, 8, 128, 1024), "K5": (128, 16, 8, 128, 1024), "K6": (64, 16, 8, 128, 1152),
          "K7": (32, 16, 8, 128, 1024), "K8": (48, 32, 8, 64, 2048)}


def graph_time_ms(fn, calls=10, reps=15) -> float:
    """Median per-call time of ``fn`` captured ``calls`` times in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def kernel_profile(fn, calls: int = 20) -> dict:
    """Mean device time per call (us) of each CUDA kernel ``fn`` launches (eager, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        us = evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
        if us > 0:
            out[evt.key[:80]] = round(us / calls, 2)
    return out



def make_inputs(slots, num_q, num_kv, head_dim, capacity):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(slots, num_q, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(slots, num_kv, capacity, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(slots, num_kv, capacity, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cur = torch.full((slots,), capacity + 1000, dtype=torch.int64, device="cuda")
    order = torch.rand(slots, num_kv, capacity, device="cuda", generator=gen).argsort(-1)
    pos = (order + 1000).to(torch.int32)  # every slot live, shuffled true positions
    count = torch.full((slots, num_kv), capacity, dtype=torch.int64, device="cuda")
    return q, k, v, pos, cur, count


def reference(q, k, v, pos, cur, count, scale, args):
    """fp32 reference (on upcast bf16 inputs) of the fused call: (out, stat, evictable mask)."""
    out, stat, _ = da.decode_attention_ref(q.float(), k.float(), v.float(), pos, cur, scale, length=count, **args)
    _, evictable = da.metadata_masks(pos, cur, args["sinks"], args["window"], count)
    return out, stat, evictable


def check(result, ref):
    """Relative output error vs fp32 and whether every chosen slot ties the reference minimum (1e-5 rel)."""
    out, _, evict = result
    ref_out, ref_stat, evictable = ref
    masked = ref_stat.double().masked_fill(~evictable, float("inf"))
    chosen = masked.gather(-1, evict[..., None])[..., 0]
    return {"rel_err": float((out.float() - ref_out).norm() / ref_out.norm()),
            "argmin_ok": bool((chosen <= masked.min(-1).values * (1 + 1e-5)).all())}


def timed(fn, ref, reps=15):
    """{"ms", "rel_err", "argmin_ok"} of a fused call (checked before timing), or {"error"} if it fails."""
    try:
        row = check(fn(), ref)
        row["ms"] = graph_time_ms(fn, reps=reps)
        return row
    except Exception as err:  # a config the compiler rejects (shared memory, ...) is reported, not fatal
        return {"error": str(err).splitlines()[0][:120] if str(err) else type(err).__name__}


def variants():
    """Named ways to compute the statistic (all at the launcher's default block/warps/stages/splits). Each names
    its finishing mode, L2 hints and discard, so that a label means the same whatever the launcher defaults.
    ``vnorm=True`` marks the cached norms (``Case.fused`` passes the tensor; the configs go to JSON)."""
    vnorm = True
    merge = dict(finish="merge", cache_hints=False, logit_discard=False, block_stat=256)  # the session-4 default
    cached = dict(vnorm=vnorm, dense=True)
    last = {**cached, "finish": "last"}
    return {"dot_merge": {**merge, "vnorm_dot": True},  # ||v||_1 on the tensor cores in the hot loop
            "cached_merge": {**merge, "vnorm": vnorm},
            "cached_dense_merge": {**merge, **cached},
            "cached_dense_merge_hints": {**merge, **cached, "cache_hints": True},
            "cached_dense_merge_hints_discard": {**merge, **cached, "cache_hints": True, "logit_discard": True},
            "cached_dense_chunk1024_hints": {**merge, **cached, "finish_chunk": 1024, "cache_hints": True},
            "cached_dense_merge_asm": {**merge, **cached, "logit_store": "asm"},
            "cached_dense_epilogue1_hints_discard": {**cached, "finish": "epilogue", "num_splits": 1,
                                                     "cache_hints": True, "logit_discard": True, "block_stat": 1024},
            "cached_dense_last": {**last, "cache_hints": False, "logit_discard": False},
            "cached_dense_last_hints": {**last, "cache_hints": True, "logit_discard": False},
            "cached_dense_last_hints_discard": {**last, "cache_hints": True, "logit_discard": True},
            "cached_dense_last_hints_discard_asm": {**last, "cache_hints": True, "logit_discard": True,
                                                    "logit_store": "asm"},
            "default": cached}  # the launcher's defaults, as the engine calls it


PHASE1 = [dict(block_n=b, num_warps=w, num_stages=st) for b, w, st in
          [(32, 4, 2), (32, 4, 3), (32, 8, 3), (64, 4, 2), (64, 4, 4), (64, 8, 2), (64, 8, 3), (128, 8, 2)]]
STAGES = ([dict(num_splits=n) for n in (1, 2, 4, 8)], [dict(block_stat=b) for b in (256, 1024, 2048, 4096)],
          [dict(finish=f) for f in ("merge", "epilogue", "last")],
          [dict(logit_store=w) for w in ("late", "early", "asm")], PHASE1,
          [dict(finish_chunk=c) for c in (None, 512, 1024, 2048)], [dict(cache_hints=h) for h in (False, True)],
          [dict(logit_discard=d) for d in (False, True)])  # most telling first: the budget may cut the rest


def sweep(call, ref, base, deadline):
    """Coordinate search from ``base`` (a timed variant) over STAGES; returns (fastest checked, all tried)."""
    tried = [base]

    def best_of(candidates):
        for cfg in candidates:
            if time.time() > deadline:
                tried.append({**cfg, "skipped": "time budget"})
                continue
            tried.append({**cfg, **timed(lambda: call(**cfg), ref, reps=7)})
        ok = [r for r in tried if r.get("argmin_ok") and "ms" in r]
        return min(ok, key=lambda r: r["ms"]) if ok else None

    def cfg_of(row):
        return {k: row[k] for k in row if k not in ("ms", "rel_err", "argmin_ok", "error", "skipped")}

    best = base
    for stage in STAGES:
        best = best_of([{**cfg_of(best), **c} for c in stage if {**cfg_of(best), **c} != cfg_of(best)]) or best
    return best, tried


class Case:
    """One shape's inputs, the fp32 reference and its calls: ``fused`` (the op as the engine runs it, only the
    argmin back; configs carry vnorm=True as a marker, they go to JSON), ``attention`` (no statistic), ``sdpa``."""

    def __init__(self, shape):
        self.q, self.k, self.v, self.pos, self.cur, self.count = make_inputs(*shape)
        self.vnorm = value_norm(self.v)  # [S, Hkv, C], as the cache keeps it
        self.scale = shape[3] ** -0.5
        self.args = dict(stat="contrib", argmin=True, sinks=0, window=1)
        self.ref = reference(self.q, self.k, self.v, self.pos, self.cur, self.count, self.scale, self.args)

    def fused(self, return_stat=False, **cfg):
        if cfg.get("vnorm") is not None:
            cfg["vnorm"] = self.vnorm
        return da.decode_attention(self.q, self.k, self.v, self.pos, self.cur, self.scale, length=self.count,
                                   return_stat=return_stat, **self.args, **cfg)

    def attention(self, **cfg):
        return da.decode_attention(self.q, self.k, self.v, self.pos, self.cur, self.scale, length=self.count, **cfg)

    def sdpa(self):
        return F.scaled_dot_product_attention(self.q[:, :, None], self.k, self.v, scale=self.scale, enable_gqa=True)


def bench_shape(name, shape, bandwidth, deadline):
    case = Case(shape)
    q, k, v, pos, cur, count, scale, args, ref = (case.q, case.k, case.v, case.pos, case.cur, case.count,
                                                  case.scale, case.args, case.ref)
    call = case.fused
    sdpa_out = case.sdpa()[:, :, 0]
    row = {"shape": name, "dims": shape, "sdpa_bf16_rel_err": float((sdpa_out.float() - ref[0]).norm()
                                                                     / ref[0].norm())}
    kv_bytes = 2 * k.numel() * k.element_size()
    floor_bytes = kv_bytes + pos.numel() * 4 + 2 * q.numel() * q.element_size()
    row["floor_ms"] = floor_bytes / bandwidth * 1e3
    row["variants"] = {label: timed(lambda: call(**cfg), ref) for label, cfg in variants().items()}
    ok = {label: r for label, r in row["variants"].items() if r.get("argmin_ok")}
    base_label = min(ok, key=lambda label: ok[label]["ms"])
    best, row["sweep"] = sweep(call, ref, {**variants()[base_label], **ok[base_label]}, deadline)
    cfg = {key: val for key, val in best.items() if key not in ("ms", "rel_err", "argmin_ok")}
    row["best"] = {**best, "from_variant": base_label}
    row["fused_ms"], row["kernel_rel_err"] = best["ms"], best["rel_err"]
    row["fused_with_stat_ms"] = graph_time_ms(lambda: call(return_stat=True, **cfg))
    phase1 = {key: cfg[key] for key in ("block_n", "num_warps", "num_stages", "num_splits", "cache_hints")
              if key in cfg}
    row["kernel_attention_only_ms"] = graph_time_ms(lambda: case.attention(dense=True, **phase1))
    row["kernel_attention_only_default_ms"] = graph_time_ms(case.attention)
    row["kernel_profile_us"] = {"fused": kernel_profile(lambda: call(**cfg)),
                                "attention_only": kernel_profile(lambda: case.attention(dense=True, **phase1))}
    row["sdpa_ms"] = graph_time_ms(case.sdpa)
    backends = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}
    for label, backend in backends.items():
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                row[f"sdpa_{label}_ms"] = graph_time_ms(case.sdpa)
        except RuntimeError as err:
            row[f"sdpa_{label}_ms"] = None
            row[f"sdpa_{label}_error"] = str(err).splitlines()[0][:120]
    sdpa_times = [row[key] for key in row if key.startswith("sdpa_") and key.endswith("_ms") and row[key]]
    row["sdpa_best_ms"] = min(sdpa_times)
    row["unfused_torch_ms"] = graph_time_ms(
        lambda: da.decode_attention_ref(q, k, v, pos, cur, scale, length=count, **args), calls=2, reps=5)
    row["interleaved_ms"] = interleaved({  # the fixed default against SDPA, free of the sweep's pick of the luckiest
        "sdpa": case.sdpa, "default": lambda: call(**variants()["default"]), "best": lambda: call(**cfg)},
        rounds=5)
    row["default_over_sdpa"] = row["interleaved_ms"]["default"] / row["interleaved_ms"]["sdpa"]
    row["best_over_sdpa_interleaved"] = row["interleaved_ms"]["best"] / row["interleaved_ms"]["sdpa"]
    row["fused_over_floor"] = row["fused_ms"] / row["floor_ms"]
    row["fused_over_sdpa"] = row["fused_ms"] / row["sdpa_ms"]
    row["fused_over_sdpa_best"] = row["fused_ms"] / row["sdpa_best_ms"]
    row["fused_over_attention_only"] = row["fused_ms"] / row["kernel_attention_only_ms"]
    row["unfused_over_fused"] = row["unfused_torch_ms"] / row["fused_ms"]
    return row


def _value(text):
    return int(text) if text.isdigit() else {"True": True, "False": False, "None": None}.get(text, text)


def ab_shape(name, shape, labels, rounds):
    """Interleaved A/B: ``rounds`` rounds, each timing SDPA, the kernel's attention only and every variant in
    ``labels`` (checked first) in a rotated order; the median over rounds of each, and its ratio to SDPA."""
    case = Case(shape)
    named = variants()
    table_of = {}
    for label in labels:  # "variant+key=value+...": a named variant with launcher arguments overridden
        base, *overrides = label.split("+")
        table_of[label] = {**named[base], **{key: _value(val) for key, val in (o.split("=") for o in overrides)}}
    fns = {"sdpa": case.sdpa, "attn_only": lambda: case.attention(dense=True)}
    row = {"shape": name, "dims": shape, "checks": {}, "ms": {}}
    for label, cfg in table_of.items():
        def fn(cfg=cfg):
            return case.fused(**cfg)
        try:
            row["checks"][label] = check(fn(), case.ref)
            fns[label] = fn
        except Exception as err:  # reported, not fatal
            row["checks"][label] = {"error": str(err).splitlines()[0][:160] if str(err) else type(err).__name__}
    row["ms"] = interleaved(fns, rounds)
    row["over_sdpa"] = {label: row["ms"][label] / row["ms"]["sdpa"] for label in fns}
    return row


def base_splits_before_s18(rows, capacity, block_n, sms, stat) -> int:
    """The launcher's split count for rows >= SMs before session 18 (no one-split shortcut), kept to time the
    launcher's before/after in one run."""
    per_sm, tiles = (32, 12) if stat else (16, 8)
    return max(1, min(max(1, round(per_sm * sms / rows)), capacity // (tiles * block_n)))


def interleaved(fns, rounds):
    """Median over ``rounds`` rounds of each call's graph time (ms); each round times every call, in a rotated
    order, so that drifts of the machine fall on all alike."""
    order = list(fns)
    times = {label: [] for label in order}
    for r in range(rounds):
        for label in order[r % len(order):] + order[:r % len(order)]:
            times[label].append(graph_time_ms(fns[label], reps=7))
    return {label: sorted(ts)[len(ts) // 2] for label, ts in times.items()}


def _cfg_text(best) -> str:
    keys = ("vnorm", "dense", "finish", "finish_chunk", "cache_hints", "logit_store", "logit_discard",
            "vnorm_dot",
            "block_n", "num_warps", "num_stages", "num_splits", "block_stat")
    names = {"vnorm": lambda val: "cached" if val else None}
    return ", ".join(f"{key}={names.get(key, str)(best[key])}" for key in keys if best.get(key) is not None)


def table(rows, bandwidth, device, command) -> str:
    lines = ["# Decode kernel benchmark (bf16)", "",
             f"GPU: {device}; date: {time.strftime('%Y-%m-%d')}; torch {torch.__version__}; copy bandwidth measured "
             f"in this run: {bandwidth / 1e12:.2f} TB/s (read + write bytes of a 4 GiB copy, eager, events).", "",
             f"Command: `{command}`", "",
             "fused = attention + LongFlow score + masked argmin (argmin only returned): the fastest variant and "
             "config of this run that passed the check (below); floor = (K+V+pos+q+out bytes) / copy bandwidth; SDPA = "
             "`scaled_dot_product_attention(enable_gqa=True)`, attention only, default dispatch (best backend in "
             "brackets); unfused = the fp32 torch reference (`decode_attention_ref`). Times: median per call of "
             "CUDA-graph replays, ms. The last column times the launcher's default call (argmin only, cached "
             "norms, dense), the sweep's pick and SDPA interleaved over 5 rounds (medians): the sweep's own pick "
             "is the luckiest of many timings, so the target is read from this column.", "",
             "| shape (S, Hq, Hkv, D, C) | floor | fused | fused + stat out | kernel attn only | SDPA [best] "
             "| unfused torch | fused/floor | fused/SDPA [best] | unfused/fused | bf16 err kernel / SDPA "
             "| interleaved: default/SDPA, fused/SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['shape']} {tuple(r['dims'])} | {r['floor_ms']:.3f} | {r['fused_ms']:.3f} | "
            f"{r['fused_with_stat_ms']:.3f} | {r['kernel_attention_only_ms']:.3f} | {r['sdpa_ms']:.3f} "
            f"[{r['sdpa_best_ms']:.3f}] | {r['unfused_torch_ms']:.2f} | {r['fused_over_floor']:.2f}x | "
            f"{r['fused_over_sdpa']:.2f}x [{r['fused_over_sdpa_best']:.2f}x] | {r['unfused_over_fused']:.1f}x | "
            f"{r['kernel_rel_err']:.1e} / {r['sdpa_bf16_rel_err']:.1e} | {r['default_over_sdpa']:.3f}x, "
            f"{r['best_over_sdpa_interleaved']:.3f}x |")
    labels = list(rows[0]["variants"]) if rows else []
    lines += ["", "Variants at the launcher's default block/warps/stages/splits (ms; `x` = failed check or "
              "compile, see JSON): `dot` = ||v||_1 on the tensor cores in the hot loop; `cached` = ||v||_1 read "
              "from the cache's `vnorm`; `dense` = no position reads in the attention pass; `merge` = the rows "
              "finished by a second kernel (256-token blocks; the default until session 4); `chunkN` = that kernel "
              "in chunks of N tokens; `epilogue1` = one split per row, finished by its own program; `last` = the "
              "last program to arrive at a row finishes it (the launcher's block); `hints` = K/V loaded evict-first, "
              "the logits stored evict-last (L2); `discard` = the finishing pass drops the logits' L2 lines once "
              "read (never written back); `asm` = each tile's logits stored right after q.K through inline PTX "
              "from the dot's layout; `default` = the launcher's defaults (since session 5: last, hints, discard, "
              "its own splits and block). "
              "Stat overhead = fused / kernel attention only (same phase-1 config, dense).", "",
              "| shape | " + " | ".join(labels) + " | attn only (default cfg) | best config | stat overhead |",
              "|---|" + "---|" * (len(labels) + 3)]
    for r in rows:
        cells = [f"{r['variants'][label]['ms']:.3f}" if r["variants"][label].get("argmin_ok") else "x"
                 for label in labels]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['kernel_attention_only_default_ms']:.3f} "
                     f"| {_cfg_text(r['best'])} | {r['fused_over_attention_only']:.3f}x |")
    lines += ["", "Device time per call of each kernel, best config and attention only (torch.profiler, eager, us):",
              ""]
    for r in rows:
        for label, kernels in r.get("kernel_profile_us", {}).items():
            lines.append(f"* {r['shape']} {label}: " + ", ".join(f"`{name}` {us:.1f}" for name, us in kernels.items()))
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default="K1,K2,K3")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="wall-clock seconds for the config sweeps (shared by the shapes; the rest is skipped)")
    parser.add_argument("--ab", default="", help="comma-separated variant labels: an interleaved A/B of these "
                        "(plus SDPA and attention only) instead of the sweep; writes kernel_decode_ab.json")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    if args.ab:
        rows = []
        for name in args.shapes.split(","):
            rows.append(ab_shape(name, SHAPES[name], args.ab.split(","), args.rounds))
            torch.cuda.empty_cache()  # the shape's tensors went with its frame
        write_json(os.path.join(args.out, "kernel_decode_ab.json"),
                   {"device": torch.cuda.get_device_name(), "rows": rows, "seconds": time.time() - start})
        for r in rows:
            print(r["shape"], {label: r["checks"][label] for label in r["checks"] if not r["checks"][label].get(
                "argmin_ok")})
            print("  " + ", ".join(f"{label} {ms:.4f} ({r['over_sdpa'][label]:.3f}x)" for label, ms in r["ms"].items()))
        return
    bandwidth = copy_bandwidth()
    names = args.shapes.split(",")
    rows = []
    for i, name in enumerate(names):  # each shape's sweep may use its share of what is left of the budget
        deadline = time.time() + (start + args.budget_s - time.time()) / (len(names) - i)
        rows.append(bench_shape(name, SHAPES[name], bandwidth, deadline))
        torch.cuda.empty_cache()  # the shape's tensors went with its frame
        print(f"{name}: {time.time() - start:.0f} s", flush=True)
    device = torch.cuda.get_device_name()
    command = "PYTHONPATH=. python benchmarks/kernel_decode.py" + (f" --shapes {args.shapes}"
                                                                   if args.shapes != "K1,K2,K3" else "")
    write_json(os.path.join(args.out, "kernel_decode.json"),
               {"device": device, "bandwidth": bandwidth, "rows": rows, "seconds": time.time() - start})
    text = table(rows, bandwidth, device, command)
    with open(os.path.join(args.out, "kernel_decode.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
