"""R-KV's redundancy kernels on one layer's cache, on random keys and on a real model's keys: the slot-ordered
kernel that visits every tile ("ordered") against the one that takes the row sums from the sum of the normalised
keys and stops its exemption search at the first hit from the newest tile ("scan"), per block configuration. Each
variant is checked against the full-matrix kernel ("rows") on the same keys first. Session 25 (developer probe).

Keys: ``random`` (N(0, 1), the engine benchmark's random-weight model has ~no pair above T = 0.5: the scan visits
every tile) and ``real`` (post-RoPE keys of the embedded SmolLM2-135M on 1,152 tokens of this repository's text,
every (layer, KV head) sequence a row of the cache, cycled to fill it; head_dim 64; at head_dim 128 two sequences
side by side). Times: device time of calls replayed from a CUDA graph (from c7 on; c3-c6 timed eager calls, host
launches included). The real keys are made on a CPU (the model is not on the device) and carried:

    PYTHONPATH=. python benchmarks/rkv_scan_probe.py --dump-keys .devdata/smollm2_keys_1152.pt      # CPU
    PYTHONPATH=. python benchmarks/rkv_scan_probe.py --real-keys .devdata/smollm2_keys_1152.pt --out OUT  # GPU
"""
from __future__ import annotations

import argparse
import json
import os

import torch

import kvroll.kernels.rkv_redundancy as rr

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.rkv_scan_probe
    from benchmarks.kernel_decode import graph_time_ms

CONFIGS = [(64, 128, 4, 2), (64, 128, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 2), (32, 128, 4, 3),
           (128, 128, 8, 2)]


def dump_keys(path: str, tokens: int = 1152) -> None:
    from kvroll.rollout.model import load_model

    net, tok = load_model("smollm2", dtype=torch.float32, device="cpu")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = ("README.md", "docs/benchmarks/engine_throughput.md")  # session 25's calls: these files at d02b2dc
    text = "".join(open(os.path.join(here, name)).read() for name in names)
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    assert ids.shape[1] == tokens, ids.shape
    with torch.no_grad():
        out = net(ids, use_cache=True)
    keys = torch.stack([layer.keys[0] for layer in out.past_key_values.layers])  # [L, Hkv, T, D], post-RoPE
    torch.save(keys.half().contiguous(), path)
    print(path, tuple(keys.shape))


def real_cache(keys: torch.Tensor, slots: int, heads: int, head_dim: int) -> torch.Tensor:
    """[slots, heads, T, head_dim] from the real sequences [L * Hkv, T, D], cycled; D < head_dim: side by side."""
    seqs = keys.flatten(0, 1).float()
    per = head_dim // seqs.shape[-1]
    need = slots * heads * per
    idx = torch.arange(need) % seqs.shape[0]
    out = seqs[idx].view(slots * heads, per, seqs.shape[1], seqs.shape[2]).permute(0, 2, 1, 3)
    return out.reshape(slots, heads, seqs.shape[1], head_dim)


def time_ms(fn) -> float:
    """Device ms per call of ``fn`` replayed from a CUDA graph of 20 calls (as the engine replays its events: no
    host launch cost), the median of 5 replays (``kernel_decode.graph_time_ms``)."""
    return graph_time_ms(fn, calls=20, reps=5)


def similar_stats(k: torch.Tensor, rows: int = 16) -> dict:
    """On the first rows: the share of pairs above T = 0.5, and where each u's newest similar token lies (tiles of
    128 back from the newest)."""
    x = k.flatten(0, 1)[:rows].float()
    x = x / (x.norm(dim=-1, keepdim=True) + 1e-8)
    s = x @ x.transpose(-1, -2)
    s.diagonal(dim1=-2, dim2=-1).fill_(0)
    sim = s > 0.5
    idx = torch.arange(s.shape[-1], device=s.device).expand_as(s)
    newest = torch.where(sim, idx, -1).amax(-1)
    back = (s.shape[-1] - 1 - newest[newest >= 0]) // 128
    return {"pairs_above_T": float(sim.float().mean()), "rows_without_similar": float((newest < 0).float().mean()),
            "found_in_newest_tile": float((back == 0).float().sum() / newest.numel())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump-keys", default=None, help="write the real keys here (CPU, the embedded model) and exit")
    ap.add_argument("--real-keys", default=None)
    ap.add_argument("--shapes", default="64x8x1152x128,256x8x1152x128,64x8x1152x64,16x8x1152x128,64x2x777x128",
                    help="slots x KV heads x capacity x head_dim, comma-separated")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dump_keys:
        return dump_keys(args.dump_keys)
    real = torch.load(args.real_keys) if args.real_keys else None
    results = []
    for spec in args.shapes.split(","):
        slots, heads, capacity, head_dim = map(int, spec.split("x"))
        for source in ("random", "real") if real is not None else ("random",):
            g = torch.Generator(device="cuda").manual_seed(0)
            if source == "random":
                k = torch.randn(slots, heads, capacity, head_dim, device="cuda", generator=g)
            else:
                k = real_cache(real[:, :, :capacity], slots, heads, head_dim).cuda()
            k = k.bfloat16()
            pos = torch.arange(capacity, device="cuda", dtype=torch.int32).expand(slots, heads, -1).contiguous()
            live = pos >= 0
            want = rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, kernel="rows")
            row = {"shape": spec, "keys": source, **similar_stats(k)}
            for kernel in ("ordered", "scan"):
                for bu, bv, warps, stages in CONFIGS:
                    fn = lambda: rr.rkv_redundancy_triton(k, live, pos, 0.5, 1, bu, bv, num_warps=warps,  # noqa: E731
                                                          num_stages=stages, kernel=kernel, time_ordered=True)
                    err = float((fn() - want).abs().max() / want.abs().max())
                    name = f"{kernel}_bu{bu}_bv{bv}_w{warps}_s{stages}"
                    row[name] = round(time_ms(fn), 4)
                    row[name + "_err"] = err
                    if err > 1e-4:
                        print("DISAGREES", spec, source, name, err, flush=True)
                best = min((key for key in row if key.startswith(kernel + "_bu") and not key.endswith("_err")),
                           key=row.get)
                row[kernel + "_best"] = best
                row[kernel + "_default"] = row[f"{kernel}_bu64_bv128_w4_s2"]  # the library's (c3-c7: scan's at 3)
            if source == "random":  # where the time goes: the norm passes alone, and both kernels without the exemption
                rows = k.reshape(-1, capacity, head_dim)
                live8 = torch.ones(rows.shape[:2], dtype=torch.int8, device="cuda")
                for block in (16, 32, 64, 128):
                    chunks = -(-capacity // block)
                    inv = torch.empty(rows.shape[:2], dtype=torch.float32, device="cuda")
                    part = torch.empty(rows.shape[0], chunks, head_dim, dtype=torch.float32, device="cuda")

                    def norm_pass(block=block, chunks=chunks, inv=inv, part=part):
                        rr._norm_sum_kernel[(rows.shape[0] * chunks,)](
                            rows, live8, inv, part, rows.stride(0), rows.stride(1), capacity, chunks, 1e-8,
                            HEAD_DIM=head_dim, BLOCK=block, num_warps=4)
                        return part.sum(1)
                    row[f"norm_sum_b{block}_ms"] = round(time_ms(norm_pass), 4)
                row["inverse_norms_ms"] = round(time_ms(lambda: rr.inverse_norms(rows.reshape(-1, head_dim))), 4)
                for kernel in ("ordered", "scan"):
                    row[f"{kernel}_beta0_ms"] = round(time_ms(lambda: rr.rkv_redundancy_triton(  # noqa: E731
                        k, live, pos, 0.5, 0, kernel=kernel, time_ordered=True)), 4)
            row["scan_over_ordered_default"] = round(row["scan_default"] / row["ordered_default"], 4)
            row["scan_best_over_ordered_best"] = round(row[row["scan_best"]] / row[row["ordered_best"]], 4)
            print(json.dumps({key: value for key, value in row.items() if not key.endswith("_err")
                              and "_bu" not in key and "pairs" not in key and "found" not in key
                              or key in (row["scan_best"], row["ordered_best"])}), flush=True)
            results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
