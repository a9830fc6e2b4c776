"""Is there a faster cuBLASLt algorithm for a decode step's projections than the one cuBLAS picks? For each of
Qwen3-1.7B's four projections (qkv, o, gate_up, down) at M = 1-256 rows, bf16, this asks cuBLASLt's heuristic for
up to ``--algos`` algorithms (through ctypes: the library torch itself loaded) and times each in a CUDA graph of
calls with the weight rotated past the L2 (``--copies`` copies), against ``F.linear`` (cuBLAS, torch's default) in
the same way. Each algorithm's output is checked against ``F.linear``'s (fp32 accumulation in another order: a
bf16 tolerance). Session 24 (developer probe; nothing in kvroll uses it).

    PYTHONPATH=.:benchmarks python benchmarks/cublaslt_algo_probe.py --out OUT [--rows 1,8,64,128,256]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os

import torch
import torch.nn.functional as F

try:
    from kernel_decode import graph_time_ms
except ImportError:  # imported as benchmarks.cublaslt_algo_probe
    from benchmarks.kernel_decode import graph_time_ms

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}  # (N, K)
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, OP_N, OP_T = 3, 4, 0, 1
PREF_MAX_WORKSPACE = 1


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _lib():
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # torch loads its cuBLAS(Lt)
    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcublasLt" in line})
    assert paths, "libcublasLt is not loaded in this process"
    return ctypes.CDLL(paths[0]), paths[0]


def _ok(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class LtMatmul:
    """Y [M, N] = X [M, K] @ W [N, K]^T in bf16 (fp32 accumulation) with one chosen cuBLASLt algorithm."""

    def __init__(self, lib, handle, m, n, k, workspace):
        self.lib, self.handle, self.workspace = lib, handle, workspace
        self.desc = ctypes.c_void_p()
        _ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "descCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            val = ctypes.c_int32(op)
            _ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(val), 4), "setAttr")
        self.layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # A = W^T col-major, B = X^T, C = D = Y^T
            lay = ctypes.c_void_p()
            _ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, ctypes.c_uint64(rows),
                                               ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layoutCreate")
            self.layouts.append(lay)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def heuristics(self, count):
        pref = ctypes.c_void_p()
        _ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "prefCreate")
        size = ctypes.c_uint64(self.workspace.numel())
        _ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size), 8), "pref")
        results, got = (Heuristic * count)(), ctypes.c_int(0)
        a, b, c = self.layouts
        _ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, c, c, pref, count, results,
                                                    ctypes.byref(got)), "heuristic")
        return [results[i] for i in range(got.value) if results[i].state == 0]

    def __call__(self, x, w, y, algo):
        a, b, c = self.layouts
        _ok(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()),
                                    a, ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self.beta),
                                    ctypes.c_void_p(y.data_ptr()), c, ctypes.c_void_p(y.data_ptr()), c,
                                    ctypes.byref(algo), ctypes.c_void_p(self.workspace.data_ptr()),
                                    ctypes.c_size_t(self.workspace.numel()),
                                    ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "matmul")


def graph_us(fn, copies, reps=9):
    """Median per-call time (µs) of ``copies`` calls (one per weight copy) captured in one CUDA graph."""
    return graph_time_ms(lambda: [fn(i) for i in range(copies)], calls=1, reps=reps) * 1e3 / copies


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", default=os.environ.get("ROWS", "1,8,64,128,256"))
    ap.add_argument("--algos", type=int, default=32)
    ap.add_argument("--copies", type=int, default=12)
    args = ap.parse_args()
    lib, path = _lib()
    handle = ctypes.c_void_p()
    _ok(lib.cublasLtCreate(ctypes.byref(handle)), "create")
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    bw = None
    try:
        from kvroll.bench.measure import copy_bandwidth
        bw = copy_bandwidth(torch.device("cuda"))
    except ImportError:
        pass
    rows_out = []
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, weights[0]).float()
            lt = LtMatmul(lib, handle, m, n, k, workspace)
            found = lt.heuristics(args.algos)
            base = graph_us(lambda i: torch.mm(x, weights[i].t(), out=y), args.copies)
            timed = []
            for j, h in enumerate(found):
                try:
                    lt(x, weights[0], y, h.algo)
                    torch.cuda.synchronize()
                    err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
                    us = graph_us(lambda i, a=h.algo: lt(x, weights[i], y, a), args.copies)
                except RuntimeError as e:
                    timed.append(dict(index=j, error=str(e)))
                    continue
                timed.append(dict(index=j, us=us, rel_err=err, waves=h.wavesCount, workspace=h.workspaceSize,
                                  algo=list(h.algo.data)))
            base2 = graph_us(lambda i: torch.mm(x, weights[i].t(), out=y), args.copies)
            good = [t for t in timed if "us" in t and t["rel_err"] < 2e-2]
            best = min(good, key=lambda t: t["us"]) if good else None
            floor = n * k * 2 / bw * 1e6 if bw else None
            row = dict(proj=name, m=m, cublas_us=[base, base2], lt_first_us=good[0]["us"] if good else None,
                       best=best, floor_us=floor, algos=timed)
            rows_out.append(row)
            print(f"{name:8s} M={m:4d} cublas {base:6.1f}/{base2:6.1f}  lt#0 {row['lt_first_us'] or 0:6.1f}  "
                  f"best {best['us'] if best else 0:6.1f} (#{best['index'] if best else -1} of {len(found)})  "
                  f"floor {floor or 0:5.1f}", flush=True)
        del weights
    with open(os.path.join(args.out, "cublaslt_algo_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), lib=path, bandwidth=bw, rows=rows_out), f)


if __name__ == "__main__":
    main()
