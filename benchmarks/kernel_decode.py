"""Benchmark (a): the fused decode kernel against SDPA, unfused PyTorch and the copy-bandwidth floor (bf16).

    PYTHONPATH=. python benchmarks/kernel_decode.py --out docs/benchmarks   # on a CUDA GPU

Shapes (slots, Hq, Hkv, D, capacity): K1 = (128, 32, 8, 128, 3200), K2 = (64, 16, 8, 128, 16384),
K3 = (256, 16, 8, 128, 1152). Every cache slot is live (count = capacity). Each variant is captured in a CUDA
graph (launch gaps excluded for all alike) and timed as the median of replays with device events.
floor = (K + V + pos + q + out bytes) / copy bandwidth, the bandwidth of a 4 GiB device-to-device copy
(read + write bytes) measured in the same run.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F

from kvroll.kernels import decode_attention as da

SHAPES = {"K1": (128, 32, 8, 128, 3200), "K2": (64, 16, 8, 128, 16384), "K3": (256, 16, 8, 128, 1152)}


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


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy, counting read + write bytes."""
    src = torch.empty(1 << 31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # eager: a copy captured in a graph becomes a memcpy node, measured slower (2.78 vs 4.28 TB/s)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    del src, dst
    return 2 * (1 << 32) / (ms * 1e-3)


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


def check(q, k, v, pos, cur, count, scale):
    """bf16 kernel vs fp32 reference (on upcast inputs) and SDPA-bf16 vs the same; argmin tie check."""
    n = min(8, q.shape[0])
    args = dict(stat="contrib", argmin=True, sinks=4, window=16)
    out, st, evict = da.decode_attention(q[:n], k[:n], v[:n], pos[:n], cur[:n], scale, length=count[:n], **args)
    ref, ref_st, _ = da.decode_attention_ref(q[:n].float(), k[:n].float(), v[:n].float(), pos[:n], cur[:n], scale,
                                             length=count[:n], **args)
    sdpa = F.scaled_dot_product_attention(q[:n, :, None], k[:n], v[:n], scale=scale, enable_gqa=True)[:, :, 0]
    _, evictable = da.metadata_masks(pos[:n], cur[:n], 4, 16, count[:n])
    masked = ref_st.double().masked_fill(~evictable, float("inf"))
    chosen = masked.gather(-1, evict[..., None])[..., 0]
    rel = lambda a: float((a.float() - ref).norm() / ref.norm())
    return {"kernel_rel_err": rel(out), "sdpa_bf16_rel_err": rel(sdpa),
            "stat_rel_err": float((st - ref_st).norm() / ref_st.norm()),
            "argmin_ok": bool((chosen <= masked.min(-1).values * (1 + 1e-5)).all())}


def bench_shape(name, shape, bandwidth, sweep):
    slots, num_q, num_kv, head_dim, capacity = shape
    q, k, v, pos, cur, count = make_inputs(*shape)
    scale = head_dim ** -0.5
    row = {"shape": name, "dims": shape, **check(q, k, v, pos, cur, count, scale)}
    kv_bytes = 2 * k.numel() * k.element_size()
    floor_bytes = kv_bytes + pos.numel() * 4 + 2 * q.numel() * q.element_size()
    row["floor_ms"] = floor_bytes / bandwidth * 1e3
    fused = dict(stat="contrib", argmin=True, sinks=0, window=1, length=count, return_stat=False)
    row["fused_ms"] = graph_time_ms(lambda: da.decode_attention(q, k, v, pos, cur, scale, **fused))
    row["fused_with_stat_ms"] = graph_time_ms(
        lambda: da.decode_attention(q, k, v, pos, cur, scale, **{**fused, "return_stat": True}))
    for label, cfg in (("vnorm_sum", dict(vnorm_dot=False)), ("epilogue", dict(epilogue=True)),
                       ("vnorm_sum_epilogue", dict(vnorm_dot=False, epilogue=True))):
        row[f"fused_{label}_ms"] = graph_time_ms(
            lambda: da.decode_attention(q, k, v, pos, cur, scale, **fused, **cfg))
    row["kernel_attention_only_ms"] = graph_time_ms(
        lambda: da.decode_attention(q, k, v, pos, cur, scale, length=count))
    q4 = q[:, :, None]
    row["sdpa_ms"] = graph_time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
    backends = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}
    for label, backend in backends.items():
        try:
            with torch.nn.attention.sdpa_kernel(backend):
                row[f"sdpa_{label}_ms"] = graph_time_ms(
                    lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
        except RuntimeError as err:
            row[f"sdpa_{label}_ms"] = None
            row[f"sdpa_{label}_error"] = str(err).splitlines()[0][:120]
    sdpa_times = [row[k] for k in row if k.startswith("sdpa_") and k.endswith("_ms") and row[k]]
    row["sdpa_best_ms"] = min(sdpa_times)
    unfused = dict(stat="contrib", argmin=True, sinks=0, window=1, length=count)
    row["unfused_torch_ms"] = graph_time_ms(lambda: da.decode_attention_ref(q, k, v, pos, cur, scale, **unfused),
                                            calls=2, reps=5)
    if sweep:
        row["sweep"] = []
        for block_n, warps, stages, splits in itertools.product((32, 64), (4, 8), (2, 3, 4), (None, 1, 2)):
            cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages, num_splits=splits)
            try:
                ms = graph_time_ms(lambda: da.decode_attention(q, k, v, pos, cur, scale, **fused, **cfg), reps=7)
            except Exception as err:  # a config the compiler rejects (shared memory) is reported, not fatal
                ms = f"error: {str(err).splitlines()[0][:80]}"
            row["sweep"].append({**cfg, "ms": ms})
        ok = [r for r in row["sweep"] if isinstance(r["ms"], float)]
        row["best_config"] = min(ok, key=lambda r: r["ms"])
    row["fused_over_floor"] = row["fused_ms"] / row["floor_ms"]
    row["fused_over_sdpa"] = row["fused_ms"] / row["sdpa_ms"]
    row["fused_over_sdpa_best"] = row["fused_ms"] / row["sdpa_best_ms"]
    row["unfused_over_fused"] = row["unfused_torch_ms"] / row["fused_ms"]
    del q, k, v, pos
    torch.cuda.empty_cache()
    return row


def table(rows, bandwidth, device, command) -> str:
    lines = [f"# Decode kernel benchmark (bf16)", "",
             f"GPU: {device}; date: 2026-11-21; torch {torch.__version__}; copy bandwidth measured in this run: "
             f"{bandwidth / 1e12:.2f} TB/s (read + write bytes of a 4 GiB copy).", "", f"Command: `{command}`", "",
             "fused = attention + LongFlow score + masked argmin (argmin only returned); floor = (K+V+pos+q+out "
             "bytes) / copy bandwidth; SDPA = `scaled_dot_product_attention(enable_gqa=True)`, attention only, "
             "default dispatch (best backend in brackets); unfused = the fp32 torch reference "
             "(`decode_attention_ref`). Times: median per call of CUDA-graph replays, ms.", "",
             "| shape (S, Hq, Hkv, D, C) | floor | fused | fused + stat out | kernel attn only | SDPA [best] "
             "| unfused torch | fused/floor | fused/SDPA [best] | unfused/fused | bf16 err kernel / SDPA |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['shape']} {tuple(r['dims'])} | {r['floor_ms']:.3f} | {r['fused_ms']:.3f} | "
            f"{r['fused_with_stat_ms']:.3f} | {r['kernel_attention_only_ms']:.3f} | {r['sdpa_ms']:.3f} "
            f"[{r['sdpa_best_ms']:.3f}] | {r['unfused_torch_ms']:.2f} | {r['fused_over_floor']:.2f}x | "
            f"{r['fused_over_sdpa']:.2f}x [{r['fused_over_sdpa_best']:.2f}x] | {r['unfused_over_fused']:.1f}x | "
            f"{r['kernel_rel_err']:.1e} / {r['sdpa_bf16_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shapes", default="K1,K2,K3")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of block/warps/stages/splits")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    start = time.time()
    bandwidth = copy_bandwidth()
    rows = [bench_shape(n, SHAPES[n], bandwidth, args.sweep) for n in args.shapes.split(",")]
    device = torch.cuda.get_device_name()
    command = "PYTHONPATH=. python benchmarks/kernel_decode.py" + (" --sweep" if args.sweep else "")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "kernel_decode.json"), "w") as f:
        json.dump({"device": device, "bandwidth": bandwidth, "rows": rows, "seconds": time.time() - start}, f,
                  indent=1)
    text = table(rows, bandwidth, device, command)
    with open(os.path.join(args.out, "kernel_decode.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
