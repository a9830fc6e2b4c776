"""Session 25: the scan kernel's parts against torch on one GPU cache (inverse norms, the sum partials, row sums,
exemptions), printed, not asserted: where a GPU disagrees and the interpreter does not.

    PYTHONPATH=. python benchmarks/rkv_scan_debug.py
"""
import torch

import kvroll.kernels.rkv_redundancy as rr

for dtype in (torch.float32, torch.bfloat16):
    for slots, heads, capacity, dim in [(2, 2, 300, 128), (4, 8, 1152, 128)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(slots, heads, capacity, dim, device="cuda", generator=g).to(dtype)
        rows = k.reshape(-1, capacity, dim)
        live8 = torch.ones(rows.shape[:2], dtype=torch.int8, device="cuda")
        chunks = (capacity + rr.NORM_BLOCK - 1) // rr.NORM_BLOCK
        inv = torch.empty(rows.shape[:2], dtype=torch.float32, device="cuda")
        part = torch.empty(rows.shape[0], chunks, dim, dtype=torch.float32, device="cuda")
        rr._norm_sum_kernel[(rows.shape[0] * chunks,)](rows, live8, inv, part, rows.stride(0), rows.stride(1), capacity,
                                                       chunks, 1e-8, HEAD_DIM=dim, BLOCK=rr.NORM_BLOCK, num_warps=4)
        kf = rows.float()
        want_inv = 1 / (kf.norm(dim=-1) + 1e-8)
        normed = kf * want_inv[..., None]
        want_total = normed.sum(1)
        want_rowsum = (normed @ want_total[..., None])[..., 0] - (normed * normed).sum(-1)
        tag = f"{dtype} {slots}x{heads}x{capacity}x{dim}"
        print(tag, "inv", float((inv - want_inv).abs().max() / want_inv.abs().max()),
              "total", float((part.sum(1) - want_total).abs().max() / want_total.abs().max()))
        pos = torch.arange(capacity, device="cuda", dtype=torch.int32).expand(slots, heads, -1).contiguous()
        live = pos >= 0
        for beta in (0, 1):
            ref = rr.rkv_redundancy_triton(k, live, pos, 0.5, beta, kernel="rows")
            got = rr.rkv_redundancy_triton(k, live, pos, 0.5, beta, kernel="scan")
            print(tag, "beta", beta, "scan vs rows", float((got - ref).abs().max() / ref.abs().max()))
        rowsum = torch.empty(rows.shape[:2], dtype=torch.float32, device="cuda")
        ex_idx = torch.full(rows.shape[:2], -1, dtype=torch.int32, device="cuda")
        ex_val = torch.zeros_like(rowsum)
        rr._rkv_scan_kernel[(rows.shape[0] * ((capacity + 63) // 64),)](
            rows, inv, live8, part.sum(1), rowsum, ex_idx, ex_val, rows.stride(0), rows.stride(1), capacity, 0.5,
            HEAD_DIM=dim, BLOCK_U=64, BLOCK_V=128, EXEMPT=False, DOT_PREC="ieee" if dtype == torch.float32 else "tf32")
        print(tag, "rowsum", float((rowsum - want_rowsum).abs().max()), "of", float(want_rowsum.abs().max()),
              "worst row", int((rowsum - want_rowsum).abs().argmax()))
