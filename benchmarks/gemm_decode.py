"""The decode step's projections: cuBLAS against ``linear_splitk_experiment.py``'s split-K kernel (bf16).

    PYTHONPATH=. python benchmarks/gemm_decode.py --out OUT [--rows 1,8,16,32,64,128,256] [--budget-s 240]

Qwen3-1.7B's per-layer projections with the fused joins (qkv [4096, 2048], o [2048, 2048], gate_up [12288, 2048],
down [2048, 6144]) and the MLP's tail as the engine runs it (``down+silu``: ``silu_mul`` then cuBLAS's down
projection, against the split-K kernel with the SiLU·mul prologue). Each call is timed as the median of CUDA-graph
replays, every captured call on the next of several weight copies (together over 400 MB, so that no weight is read
from L2, as in a step, where each layer's weights differ), against (weight + input + output bytes) / the copy
bandwidth of the same run. The kernel's configuration: a coordinate search from ``default_config`` (split count,
tiles, stages, warps; each call first checked against the fp32 reference), the default timed too. cuBLASLt
(``torch.backends.cuda.preferred_blas_library``) is timed beside cuBLAS. Writes gemm_decode.json.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import time

import torch
import torch.nn.functional as F

from kvroll.bench.measure import copy_bandwidth
from kvroll.bench.report import write_json
from kvroll.kernels.silu_mul import silu_mul

try:
    import gemm_skinny
    from linear_splitk_experiment import default_config, linear_splitk, linear_torch
except ImportError:  # imported as benchmarks.gemm_decode
    from benchmarks import gemm_skinny
    from benchmarks.linear_splitk_experiment import default_config, linear_splitk, linear_torch

PROJECTIONS = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144),
               "down+silu": (2048, 6144)}
SEARCH = ([dict(split_k=s) for s in (1, 2, 3, 4, 6, 8)], [dict(block_n=b) for b in (32, 64, 128)],
          [dict(block_k=b) for b in (64, 128, 256)], [dict(num_stages=s) for s in (3, 4, 5)],
          [dict(num_warps=w) for w in (4, 8)], [dict(split_k=s) for s in (1, 2, 3, 4, 6, 8, 12)])


def graph_ms(fns) -> float:
    """Median per-call time of the calls ``fns`` in turn, ``len(fns)`` of them captured in one CUDA graph (each
    once: ``gemm_skinny.graph_ms`` over a cycle of them)."""
    calls = itertools.cycle(fns)
    return gemm_skinny.graph_ms(lambda: next(calls)(), calls=len(fns), replays=20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rows", default="1,8,16,32,64,128,256")
    parser.add_argument("--projections", default=",".join(PROJECTIONS))
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    deadline = time.time() + args.budget_s
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for name in args.projections.split(","):
        n, k = PROJECTIONS[name]
        silu = name == "down+silu"
        copies = max(2, math.ceil(400e6 / (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dt, generator=gen) * k ** -0.5 for _ in range(copies)]
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, 2 * k if silu else k, device=dev, dtype=dt, generator=gen)
            ref = linear_torch(x, weights[0], "silu_mul" if silu else None).float()
            floor_ms = (n * k * 2 + x.numel() * 2 + m * n * 2) / bw * 1e3
            row = {"projection": name, "rows": m, "n": n, "k": k, "floor_ms": floor_ms, "weight_copies": copies}

            def cublas(w, x=x):
                return F.linear(silu_mul(x), w) if silu else F.linear(x, w)

            row["cublas_ms"] = graph_ms([lambda w=w: cublas(w) for w in weights])
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                row["cublaslt_ms"] = graph_ms([lambda w=w: cublas(w) for w in weights])
            except Exception as err:  # noqa: BLE001 - reported
                row["cublaslt_error"] = str(err)[:120]
            torch.backends.cuda.preferred_blas_library("cublas")

            def kernel(cfg, w, x=x):
                return linear_splitk(x, w, "silu_mul" if silu else None, **cfg)

            def timed(cfg):
                try:
                    err = float((kernel(cfg, weights[0]).float() - ref).norm() / ref.norm())
                    if not err < 1e-2:
                        return {**cfg, "rel_err": err, "error": "mismatch"}
                    return {**cfg, "rel_err": err, "ms": graph_ms([lambda w=w: kernel(cfg, w) for w in weights])}
                except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is reported
                    return {**cfg, "error": str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}

            default = default_config(m, n, k)
            row["default"] = timed(default)
            tried, best = [row["default"]], row["default"]
            for stage in SEARCH:
                for change in stage:
                    cfg = {key: best[key] for key in default}
                    cfg.update(change)
                    if cfg == {key: best[key] for key in default} or time.time() > deadline:
                        continue
                    res = timed(cfg)
                    tried.append(res)
                    if "ms" in res and res["ms"] < best.get("ms", float("inf")):
                        best = res
            row["best"], row["tried"] = best, tried
            rows_out.append(row)
            print(f"{name:10s} M={m:4d} floor {floor_ms * 1e3:6.1f} us  cublas {row['cublas_ms'] * 1e3:6.1f}  "
                  f"lt {row.get('cublaslt_ms', float('nan')) * 1e3:6.1f}  kernel default "
                  f"{row['default'].get('ms', float('nan')) * 1e3:6.1f}  best {best.get('ms', float('nan')) * 1e3:6.1f}"
                  f"  {({key: best[key] for key in default if key in best})}", flush=True)
        del weights
        torch.cuda.empty_cache()
    write_json(os.path.join(args.out, "gemm_decode.json"),
               {"device": torch.cuda.get_device_name(dev), "copy_bandwidth": bw, "rows": rows_out})


if __name__ == "__main__":
    main()
