"""Does an L2 prefetch issued from a kernel land? A check under sessions 24's and 31's prefetch experiments.

A 16 MB bf16 buffer is read by a streaming kernel (a program per 64 KB, each summing its slice), timed with CUDA
events, in four states, each trial after a 256 MB sweep that evicts L2:

* ``cold``: straight after the sweep (the bytes come from memory);
* ``warm``: after one read of the buffer (the bytes sit in L2: the best a prefetch could do);
* ``line``: after a kernel whose programs issue one PTX ``prefetch.global.L2`` per 128-byte line of their slice
  (what sessions 24 and 31 used), then a 20 us delay kernel so that the prefetches may finish;
* ``bulk``: the same with Hopper's ``cp.async.bulk.prefetch.L2.global`` (one per 4 KB; Triton spreads the 16
  addresses of a program over its 128 threads, so each is issued by several threads: redundant, not wrong).

If ``line`` reads as fast as ``warm``, the prefetches landed and what the chain loses is not the first bytes'
latency; if it reads as ``cold``, the per-line prefetch was dropped and the bulk one is the one to try.
Developer probe (session 31); nothing in kvroll uses it.

    PYTHONPATH=. python benchmarks/l2_prefetch_check.py --out OUT
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

CHUNK = 32768  # bf16 elements per program: 64 KB


@triton.jit
def _read(x_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, CHUNK, BLOCK):
        acc += tl.load(x_ptr + pid * CHUNK + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _prefetch(x_ptr, CHUNK: tl.constexpr, BULK: tl.constexpr):
    pid = tl.program_id(0)
    if BULK:  # 4 KB per instruction (2,048 bf16 elements)
        ptrs = x_ptr + pid * CHUNK + tl.arange(0, CHUNK // 2048) * 2048
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], 4096; mov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:  # one per 128-byte line (64 bf16 elements)
        ptrs = x_ptr + pid * CHUNK + tl.arange(0, CHUNK // 64) * 64
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _timer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _delay(ns):
    t0 = _timer()
    t = t0
    while t - t0 < ns:
        t = _timer()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=16)
    ap.add_argument("--trials", type=int, default=25)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    n = args.mb * (1 << 20) // 2
    x = torch.randn(n, device="cuda").bfloat16()
    programs = n // CHUNK
    out = torch.empty(programs, device="cuda")
    sweep = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ref = x.view(programs, CHUNK).float().sum(1)

    def read():
        _read[(programs,)](x, out, CHUNK=CHUNK, BLOCK=1024, num_warps=4)

    read()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-1)
    result = {}
    for state in ("cold", "warm", "line", "bulk", "cold"):
        times = []
        if state == "bulk":
            try:
                _prefetch[(programs,)](x, CHUNK=CHUNK, BULK=True, num_warps=4)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a PTX this Triton or GPU does not take: recorded
                result[state] = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                print(state, result[state], flush=True)
                continue
        for _ in range(args.trials):
            sweep.add_(1)  # 512 MB of traffic through L2: the buffer leaves it
            if state == "warm":
                read()
            elif state in ("line", "bulk"):
                _prefetch[(programs,)](x, CHUNK=CHUNK, BULK=state == "bulk", num_warps=4)
            _delay[(1,)](20_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            read()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        times.sort()
        key = state if state not in result else state + "_again"
        result[key] = dict(median_us=times[len(times) // 2], min_us=times[0])
        print(key, json.dumps(result[key]), flush=True)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-1)
    with open(os.path.join(args.out, "l2_prefetch_check.json"), "w") as f:
        json.dump(dict(mb=args.mb, programs=programs, **result), f, indent=1)


if __name__ == "__main__":
    main()
