"""SnapKV's decode-time window score in one kernel: logits, causal mask, softmax and the window sum, per (row, head).

The torch path (``kvroll.policies.snapkv.snapkv_window_scores``) materialises the window logits [n, Hkv, G, W, C]
in fp32 and makes five passes over them (scale, mask, softmax, nan_to_num, sum): at a 256-row event on
Qwen3-1.7B's cache (G = 2, W = 32, C = 1152) that is 600 MB a tensor, ~12 ms of a 33 ms event on an H200. Here one
program per (row, KV head) holds the group's G x W queries and streams the head's keys twice:

1. the logits tile by tile (``tl.dot``, fp32 accumulation), masked to the keys each query sees (live, position at
   most the query's), with the running row max and the sum of exponentials (online softmax);
2. the logits again, turned into probabilities with the final max and sum, summed over the G x W queries, times
   the candidate mask (live, older than the window): the score of each key, stored.

Nothing but the scores [n, Hkv, C] is written. The pooling (``avg_pool1d``) stays in torch. A query that sees no
key (a row whose window starts before any live key) contributes 0, as ``nan_to_num`` makes it in torch.

Precision: bf16/fp16 products are exact in fp32 and accumulate in fp32, so the logits differ from the torch
path's by summation order only (~1e-7 relative), as the scores do (and the kept set only at near-ties); fp32
inputs use ``ieee`` dots (the interpreter tests run fp32).

    scores = snapkv_scores_triton(q_obs, k, pos, cur_pos, scale)   # [n, Hkv, C] fp32: CUDA, or CPU interpreted
"""
from __future__ import annotations

import torch

try:  # Triton is optional on CPU-only installs; the torch path is the CPU one.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

kernel_on_cpu = False  # tests: take the kernel on CPU tensors too (needs TRITON_INTERPRET=1)
enabled = True  # False: the torch path on CUDA too (benchmarks' A/B, the GPU test's reference)


def use_kernel(k: torch.Tensor) -> bool:
    return enabled and triton is not None and (k.is_cuda or kernel_on_cpu)


if triton is not None:

    @triton.jit
    def _logits(q, k_base, pos_base, offs_c, offs_d, c_mask, q_pos, stride_kc, scale,
                DOT_PREC: tl.constexpr):
        """One tile's masked logits [M, BLOCK_C] (fp32, -inf where a query does not see the key) and the keys'
        positions."""
        k = tl.load(k_base + offs_c[:, None] * stride_kc + offs_d[None, :], mask=c_mask[:, None], other=0.0)
        pos = tl.load(pos_base + offs_c, mask=c_mask, other=-1)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale
        seen = (pos[None, :] >= 0) & (pos[None, :].to(tl.int64) <= q_pos[:, None])
        return tl.where(seen, s, float("-inf")), pos

    @triton.jit
    def _snapkv_scores_kernel(
        q_ptr, k_ptr, pos_ptr, cur_ptr, out_ptr,
        stride_qn, stride_qh, stride_qw, stride_kn, stride_kh, stride_kc, stride_pn, stride_ph,
        num_kv_heads, capacity, scale,
        GROUP: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
        HEAD_DIM: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row, head = pid // num_kv_heads, pid % num_kv_heads
        offs_m = tl.arange(0, BLOCK_M)  # query m = g * W + w of the group's G x W queries (padded to BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_mask = offs_m < GROUP * WINDOW
        g, w = offs_m // WINDOW, offs_m % WINDOW
        q_rows = q_ptr + row.to(tl.int64) * stride_qn + (head * GROUP + g) * stride_qh + w * stride_qw
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=m_mask[:, None], other=0.0)
        cur = tl.load(cur_ptr + row)
        # query w sits at position cur - W + w; padding rows see nothing
        q_pos = tl.where(m_mask, cur - WINDOW + w, -1).to(tl.int64)
        k_base = k_ptr + row.to(tl.int64) * stride_kn + head * stride_kh
        pos_base = pos_ptr + row.to(tl.int64) * stride_pn + head * stride_ph
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, capacity, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            s, _ = _logits(q, k_base, pos_base, offs_c, offs_d, offs_c < capacity, q_pos, stride_kc, scale,
                           DOT_PREC)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m_i = m_new
        # a query that sees no key: its probabilities are 0 (torch: softmax of all -inf is nan, nan_to_num -> 0)
        inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        out_base = out_ptr + pid.to(tl.int64) * capacity
        for c0 in range(0, capacity, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            c_mask = offs_c < capacity
            s, pos = _logits(q, k_base, pos_base, offs_c, offs_d, c_mask, q_pos, stride_kc, scale, DOT_PREC)
            p = tl.exp(s - m_safe[:, None]) * inv_l[:, None]
            score = tl.sum(p, 0)
            cand = (pos >= 0) & (pos.to(tl.int64) < cur - WINDOW)
            tl.store(out_base + offs_c, tl.where(cand, score, 0.0), mask=c_mask)


def snapkv_scores_triton(q_obs: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, cur_pos: torch.Tensor,
                         scale: float, block_c: int = 64, num_warps: int | None = None) -> torch.Tensor:
    """The window score of every slot before pooling, [n, Hkv, C] fp32 (0 off the candidates).

    q_obs [n, Hq, W, D] (any strides but a contiguous last dim; Hq = Hkv x G, head-major), k [n, Hkv, C, D] in
    q_obs's dtype, pos [n, Hkv, C] int32 (contiguous last dim), cur_pos [n] int64."""
    assert triton is not None, "snapkv_scores_triton needs Triton"
    n, num_q_heads, window, dim = q_obs.shape
    _, num_kv_heads, capacity, _ = k.shape
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads and k.shape == (n, num_kv_heads, capacity, dim), (q_obs.shape, k.shape)
    assert q_obs.dtype == k.dtype and q_obs.stride(-1) == k.stride(-1) == 1, (q_obs.dtype, k.dtype)
    assert dim in (16, 32, 64, 128, 256), f"head_dim {dim} must be a power of two in [16, 256]"
    assert pos.shape == (n, num_kv_heads, capacity) and pos.dtype == torch.int32 and pos.stride(-1) == 1
    cur_pos = cur_pos.to(torch.int64).contiguous()
    out = torch.empty(n, num_kv_heads, capacity, dtype=torch.float32, device=k.device)
    if n == 0:
        return out
    block_m = max(16, triton.next_power_of_2(group * window))
    prec = "ieee" if k.dtype == torch.float32 else "tf32"
    _snapkv_scores_kernel[(n * num_kv_heads,)](
        q_obs, k, pos, cur_pos, out,
        q_obs.stride(0), q_obs.stride(1), q_obs.stride(2), k.stride(0), k.stride(1), k.stride(2),
        pos.stride(0), pos.stride(1), num_kv_heads, capacity, scale,
        GROUP=group, WINDOW=window, BLOCK_M=block_m, BLOCK_C=block_c, HEAD_DIM=dim, DOT_PREC=prec,
        num_warps=num_warps or (8 if block_m >= 128 else 4),
    )
    return out
