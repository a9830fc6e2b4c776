"""Does a stream-K gate_up stream faster than the chain's 96 tiles? Session 40 (developer probe).

At 64 rows Qwen3-1.7B's gate_up with SiLU * up (``pdl_gemm.linear_pdl(x, w, silu_mul=True)``, N = 12,288, K =
2,048) runs 96 programs of 128 x 128 tiles on an H100's 132 SMs; session 39's fit put a fixed 7.5 us in its 21.3.
Stream-K deals the 96 tiles' K steps (16 of 128 at BLOCK_K 128) evenly to ``--programs`` programs (132: one per
SM), each taking a contiguous run of (tile, K step) units, so every SM streams ~73% of a tile. A tile whose units
several programs share (two or three at 128-132 programs, up to five at 264) is finished by the last of them to
arrive (an arrival counter per tile, reset by that program): every contributor stores its fp32 partial sums, and the
last reloads them all and adds them in the contributors' order, so the result does not depend on the arrival order,
then applies silu_mul's epilogue. No program waits for another (no spin), so the kernel needs no co-residency.
Checked under the interpreter by ``tests/bench/test_dev_benchmarks.py``.

Arms, each over ``--layers`` weight sets in one CUDA graph (weights streamed from memory), plain launches, every
arm's output checked against the chain's (bf16, equal up to a rounding of the partial sums' order):

- ``chain``: the chain's own gate_up (``gemm_config``'s tile on this GPU: 128 x 128, 3 stages before session 40's
  ``H200_TILES``, which c1 ran without);
- ``sk{P}_k{BK}_s{S}_w{W}``: stream-K over P programs, BLOCK_K BK, S stages, W warps;
- ``mlp_chain`` / ``mlp_sk``: gate_up then down in 2 K slices as PDL launches (the engine's MLP half), with the
  chain's gate_up and the best stream-K arm.

    PYTHONPATH=.:benchmarks python benchmarks/streamk_gate_up_probe.py --rows 64 --out OUT/streamk.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _gate_up_streamk(x_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_x, stride_w, stride_y,
                     TILES: tl.constexpr, KSTEPS: tl.constexpr, PROGRAMS: tl.constexpr, CMAX: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # w is [gate; up] [2I, K]; tile t covers gate's rows [t * HALF, (t + 1) * HALF) and up's N / 2 further.
    # Units u in [0, TILES * KSTEPS): tile u // KSTEPS, K step u % KSTEPS; program p takes
    # [p * T // P, (p + 1) * T // P), and unit v belongs to program ((v + 1) * P - 1) // T.
    pid = tl.program_id(0)
    HALF: tl.constexpr = BLOCK_N // 2
    TOTAL: tl.constexpr = TILES * KSTEPS
    u0 = pid * TOTAL // PROGRAMS
    u1 = (pid + 1) * TOTAL // PROGRAMS
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_h = tl.arange(0, HALF)
    m_mask = offs_m < M
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    for tile in range(u0 // KSTEPS, (u1 - 1) // KSTEPS + 1):
        t_lo = tile * KSTEPS
        s_lo = tl.maximum(u0, t_lo) - t_lo
        s_hi = tl.minimum(u1, t_lo + KSTEPS) - t_lo
        offs_n = tile * HALF + offs_h
        g_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
        u_rows = g_rows + (N // 2).to(tl.int64) * stride_w
        acc = tl.zeros([BLOCK_M, HALF], tl.float32)
        acc_u = tl.zeros([BLOCK_M, HALF], tl.float32)
        for s in range(s_lo, s_hi):
            k0 = s * BLOCK_K
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
            g = tl.load(g_rows + (k0 + offs_k)[None, :])
            acc += tl.dot(x, tl.trans(g))
            w = tl.load(u_rows + (k0 + offs_k)[None, :])
            acc_u += tl.dot(x, tl.trans(w))
        p_first = ((t_lo + 1) * PROGRAMS - 1) // TOTAL
        p_last = ((t_lo + KSTEPS) * PROGRAMS - 1) // TOTAL
        done = p_first == p_last
        part_off = offs_m[:, None] * HALF + offs_h[None, :]
        if not done:  # shared tile: store the partials, count the arrival; the last to arrive finishes
            mine = pid - p_first
            base = part_ptr + (tile * CMAX + mine) * 2 * BLOCK_M * HALF
            tl.store(base + part_off, acc)
            tl.store(base + BLOCK_M * HALF + part_off, acc_u)
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            done = arrived == p_last - p_first
            if done:
                tl.atomic_xchg(cnt_ptr + tile, 0)
                acc = tl.zeros([BLOCK_M, HALF], tl.float32)
                acc_u = tl.zeros([BLOCK_M, HALF], tl.float32)
                for j in range(0, p_last - p_first + 1):  # the contributors' order: independent of arrivals
                    src = part_ptr + (tile * CMAX + j) * 2 * BLOCK_M * HALF
                    acc += tl.load(src + part_off, cache_modifier=".cg")
                    acc_u += tl.load(src + BLOCK_M * HALF + part_off, cache_modifier=".cg")
        if done:
            gq = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
            act = (gq / (1.0 + tl.exp(-gq))).to(y_ptr.dtype.element_ty).to(tl.float32)
            out = act * acc_u.to(y_ptr.dtype.element_ty).to(tl.float32)
            tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], out.to(y_ptr.dtype.element_ty),
                     mask=m_mask[:, None])


class StreamK:
    """Workspace (fp32 partials, arrival counters at zero) for one shape and program count."""

    def __init__(self, m, n, k, programs, block_n=128, block_k=128, warps=4, stages=3, device="cuda"):
        assert n % block_n == 0 and k % block_k == 0
        self.tiles, self.ksteps = n // block_n, k // block_k
        self.programs, self.block_n, self.block_k, self.warps, self.stages = programs, block_n, block_k, warps, stages
        self.block_m = max(16, triton.next_power_of_2(m))
        total = self.tiles * self.ksteps
        assert programs <= total
        per = total // programs  # each program takes per or per + 1 units
        self.cmax = -(-(self.ksteps - 1) // max(1, per)) + 2
        self.part = torch.empty(self.tiles * self.cmax * 2 * self.block_m * (block_n // 2), dtype=torch.float32,
                                device=device)
        self.cnt = torch.zeros(self.tiles, dtype=torch.int32, device=device)

    def __call__(self, x, w, pdl=False):
        m, k = x.shape
        out = torch.empty(m, w.shape[0] // 2, dtype=x.dtype, device=x.device)
        _gate_up_streamk[(self.programs,)](
            x, w, out, self.part, self.cnt, m, w.shape[0], k, x.stride(0), w.stride(0), out.stride(0),
            TILES=self.tiles, KSTEPS=self.ksteps, PROGRAMS=self.programs, CMAX=self.cmax, BLOCK_M=self.block_m,
            BLOCK_N=self.block_n, BLOCK_K=self.block_k, PDL=pdl, num_warps=self.warps, num_stages=self.stages,
            **({"launch_pdl": True} if pdl else {}))
        return out


def reference(x, w):
    """silu_mul's rounding of the fp32 product: each half rounded to the dtype, silu in fp32 rounded, one product."""
    half = w.shape[0] // 2
    prod = (x.float() @ w.float().T).to(x.dtype).float()
    g, u = prod[:, :half], prod[:, half:]
    return ((g / (1 + torch.exp(-g))).to(x.dtype).float() * u).to(x.dtype)


def main():
    try:
        from kernel_decode import graph_time_ms
    except ImportError:  # imported as benchmarks.streamk_gate_up_probe
        from benchmarks.kernel_decode import graph_time_ms
    from kvroll.bench.measure import copy_bandwidth
    from kvroll.bench.report import write_json
    from kvroll.kernels import pdl_gemm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=6144)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"copy_bandwidth_tb_s": bw / 1e12, "sms": sms, "rows": {}}
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s, {sms} SMs", flush=True)
    hidden, inter = args.hidden, args.inter
    wgus = [(torch.randn(2 * inter, hidden, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
    wds = [(torch.randn(hidden, inter, device="cuda") * 0.02).bfloat16() for _ in range(args.layers)]
    floor_us = 2 * inter * hidden * 2 / bw * 1e6
    arms_cfg = [(sms, 128, 3, 4), (sms, 128, 4, 4), (sms, 64, 4, 4), (sms, 64, 5, 4), (sms, 128, 3, 8),
                (sms - 4, 128, 3, 4), (2 * sms, 64, 3, 4), (2 * sms, 128, 2, 4)]
    for rows in args.rows:
        x = torch.randn(rows, hidden, device="cuda").bfloat16()
        ref = reference(x, wgus[0])
        chain_out = pdl_gemm.linear_pdl(x, wgus[0], pdl=False, silu_mul=True)
        chain_cfg = pdl_gemm.gemm_config(rows, 2 * inter, hidden, 1, True, x.device)
        row = {"floor_us": round(floor_us, 2), "chain_cfg": chain_cfg,
               "us": {}, "max_err_vs_chain": {}, "max_err_chain_vs_ref": float((chain_out.float() - ref.float())
                                                                               .abs().max())}
        row["us"]["chain"] = round(1000 * graph_time_ms(
            lambda: [pdl_gemm.linear_pdl(x, a, pdl=False, silu_mul=True) for a in wgus]) / args.layers, 2)
        best = None
        for programs, bk, stages, warps in arms_cfg:
            name = f"sk{programs}_k{bk}_s{stages}_w{warps}"
            try:
                sk = StreamK(rows, 2 * inter, hidden, programs, 128, bk, warps, stages)
                out = sk(x, wgus[0])
                out2 = sk(x, wgus[0])
                torch.cuda.synchronize()
                err = float((out.float() - chain_out.float()).abs().max())
                row["max_err_vs_chain"][name] = err
                ok = torch.equal(out, out2) and err <= 4 * float(ref.float().abs().max()) * 2 ** -7
                if not ok:
                    row["us"][name] = f"wrong (err {err}, repeat equal {torch.equal(out, out2)})"
                    continue
                us = round(1000 * graph_time_ms(lambda sk=sk: [sk(x, a) for a in wgus]) / args.layers, 2)
                row["us"][name] = us
                if best is None or us < best[1]:
                    best = (sk, us, name)
            except Exception as exc:  # a config that does not compile (shared memory): recorded, not fatal
                row["us"][name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            print(json.dumps({"rows": rows, name: row["us"][name]}), flush=True)
        if best is not None:
            sk = best[0]
            row["best"] = best[2]

            def mlp(gate_up, wgu, wd):
                return pdl_gemm.linear_pdl(gate_up(wgu), wd, pdl=True, parts=2)

            row["us"]["mlp_chain"] = round(1000 * graph_time_ms(lambda: [mlp(
                lambda a: pdl_gemm.linear_pdl(x, a, pdl=True, silu_mul=True), a, b) for a, b in zip(wgus, wds)])
                / args.layers, 2)
            row["us"]["mlp_sk"] = round(1000 * graph_time_ms(lambda: [mlp(
                lambda a: sk(x, a, pdl=True), a, b) for a, b in zip(wgus, wds)]) / args.layers, 2)
            out_pdl = sk(x, wgus[0], pdl=True)
            row["pdl_equal"] = bool(torch.equal(out_pdl, sk(x, wgus[0])))
        print(json.dumps({"rows": rows, **row}), flush=True)
        results["rows"][rows] = row
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
