"""An experiment, not used by kvroll: a decode step's QKV projection, (Qwen3's q/k norms,) rotary and cache write
in one kernel, for small batches; timed against cuBLAS's matmul and ``rotary.rotary`` by
``benchmarks/qkv_rotary_ab.py``. Session 21 on an H100 (docs/benchmarks/engine_throughput.md): 1.03-1.26x the
two kernels' time at 1-64 rows of Qwen3-1.7B's and Qwen2-0.5B's layouts, every config of the sweep (the split-K
GEMM alone is slower than cuBLAS's by more than the rotary kernel costs). Not adopted; kept to reproduce that.

``fused_qkv_rotary`` runs the attention prologue as cuBLAS's QKV matmul, then ``rotary.rotary`` with the cache
write: two launches, and at batch <= 64 each carries a fixed cost (cuBLAS's qkv ~9 us for 5.6 us of weight bytes on
an H100, the rotary kernel ~2.9 us). Here the matmul is a split-K Triton GEMM whose programs each take one head's
columns (D of them) of the joined weight [Wq; Wk; Wv] over a chunk of K; the last program to arrive at a (row
block, head) tile sums the chunks' fp32 partials in chunk order, adds the bias, rounds to the model's dtype (the
matmul's output, as ``F.linear`` gives it up to the order of the sum), stores it in the joined row, and then runs
that head's epilogue from it: a query head is normed (Qwen3) and rotated into ``q_out`` (and R-KV's / SnapKV's
observation ring), a key head normed, rotated and written to the K cache at its write index, a value head written
to the V cache with its ||v||_1; the second of a KV head's key and value epilogues to finish writes the slot's
position and live count and advances an appending cache's write index (both read the index first). The roundings
are ``rotary.rotary``'s (HF's), so the outputs are ``F.linear`` + ``rotary(..., write=)``'s given the same matmul
output:

    q_rot = qkv_rotary(x, weight, bias, cos, sin, n_q, n_k, write, q_norm=(wq, eps), k_norm=(wk, eps))
    # == rotary(q, k, cos, sin, write=write, ...)[0] with q, k, v = F.linear(x, weight, bias).split(...)

``rows_ok(rows, head_dim)``: the batches and head dims it serves (``MAX_ROWS``).
"""
from __future__ import annotations

import torch

from kvroll.kernels.decode_attention import _arrival_counters
from kvroll.kernels.decode_launch import sm_count
from kvroll.kernels.rotary import CacheWrite, _check_norm, _check_write, _rows

try:  # Triton is optional on CPU-only installs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_ROWS = 64  # the batches it was written for
CONFIG: dict | None = None  # a benchmark's override of ``_config``'s (block_m, block_k, split_k, warps, stages)


def rows_ok(rows: int, head_dim: int) -> bool:
    return triton is not None and 0 < rows <= MAX_ROWS and head_dim in (64, 128)


if triton is not None:
    from kvroll.kernels.rotary import _normed  # HF's RMSNorm roundings after the scale

    @triton.jit
    def _rotate_rows(src, stride_src, rows, rmask, cos_ptr, sin_ptr, stride_cr, stride_sr, w_ptr, eps,
                     NORM: tl.constexpr, D: tl.constexpr):
        """The head at ``src`` of each row (``rows`` [BM]): ``rotary._rotate_heads``'s roundings with each row's
        own cos / sin; returns the rotated heads [BM, D] in fp32."""
        cols = tl.arange(0, D)
        rest: tl.constexpr = D - D // 2
        first = cols < rest
        partner = tl.where(first, cols + D // 2, cols - rest)
        mask = rmask[:, None]
        base = src + rows[:, None] * stride_src
        x = tl.load(base + cols[None, :], mask=mask, other=0.0)
        xp = tl.load(base + partner[None, :], mask=mask, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            scale = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
            x = _normed(x, scale, tl.load(w_ptr + cols)[None, :])
            xp = _normed(xp, scale, tl.load(w_ptr + partner)[None, :])
        c = tl.load(cos_ptr + rows[:, None] * stride_cr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + rows[:, None] * stride_sr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xp = tl.where(first[None, :], -xp.to(tl.float32), xp.to(tl.float32))
        a = (x.to(tl.float32) * c).to(x.dtype)
        b = (xp * s).to(x.dtype)
        return a.to(tl.float32) + b.to(tl.float32)

    @triton.jit
    def _qkv_rotary_kernel(
            x_ptr, w_ptr, b_ptr, qkv_ptr, ws_ptr, cnt_ptr, pair_ptr, M, K, k_chunk, stride_xm, stride_wn, stride_y,
            cos_ptr, sin_ptr, stride_cr, stride_sr, qo_ptr, qw_ptr, kw_ptr, q_eps, k_eps,
            kc_ptr, vc_ptr, vn_ptr, pos_ptr, count_ptr, idx_ptr, cur_pos_ptr, stride_kcs, stride_kch, stride_kcc,
            stride_vcs, stride_vch, stride_vcc, stride_ns, stride_nh, stride_ps, stride_ph, stride_cs, stride_is,
            capacity, ring_ptr, stride_rs, stride_rw, stride_rh, ring_size, n_q, n_k,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
            EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, VNORM: tl.constexpr,
            ADVANCE: tl.constexpr, RING: tl.constexpr):
        # program (head tile t, K chunk, row block): t < n_q a query head, then n_k key heads, then n_k value heads
        t, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = tl.arange(0, D)
        ks = tl.arange(0, BLOCK_K)
        k_lo = pid_k * k_chunk
        k_hi = tl.minimum(k_lo + k_chunk, K)
        # rows past M load row M - 1 (no row mask in the loop); their results are never stored
        x_ptrs = x_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_xm + k_lo + ks[None, :]
        w_ptrs = w_ptr + (t * D + cols).to(tl.int64)[:, None] * stride_wn + k_lo + ks[None, :]
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                kmask = (k0 + ks) < k_hi
                a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0, eviction_policy="evict_first")
            if a.dtype == tl.float32:
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(a, tl.trans(w))
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        tile = pid_m * tl.num_programs(0) + t
        last = True
        if SPLIT:  # the last of the tile's chunks to arrive sums the partials in chunk order (deterministic)
            n_splits = tl.num_programs(1)
            part = ws_ptr + (tile * n_splits).to(tl.int64) * (BLOCK_M * D) \
                + tl.arange(0, BLOCK_M)[:, None] * D + cols[None, :]
            tl.store(part + pid_k * (BLOCK_M * D), acc)
            tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
            last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") == n_splits - 1
            if last:
                tl.atomic_xchg(cnt_ptr + tile, 0)  # self-resetting: zero between launches
                acc = tl.zeros([BLOCK_M, D], tl.float32)
                for sk in range(n_splits):
                    acc += tl.load(part + sk * (BLOCK_M * D), cache_modifier=".cg")
        if last:
            if HAS_BIAS:
                acc += tl.load(b_ptr + t * D + cols).to(tl.float32)[None, :]
            y_row = qkv_ptr + t * D
            tl.store(y_row + rows[:, None] * stride_y + cols[None, :], acc.to(qkv_ptr.dtype.element_ty),
                     mask=rmask[:, None])  # the matmul's output in the joined row, as F.linear writes it
            tl.debug_barrier()  # read back below (the partner columns) by other threads of this program
            cur = tl.load(cur_pos_ptr + rows, mask=rmask, other=0)
            if t < n_q:
                out = _rotate_rows(y_row, stride_y, rows, rmask, cos_ptr, sin_ptr, stride_cr, stride_sr, qw_ptr,
                                   q_eps, NORM, D)
                tl.store(qo_ptr + (rows[:, None] * n_q + t) * D + cols[None, :], out.to(qo_ptr.dtype.element_ty),
                         mask=rmask[:, None])
                if RING:  # the observation window's slot of this step, cur_pos % W
                    ring_rows = ring_ptr + rows.to(tl.int64) * stride_rs + (cur % ring_size) * stride_rw
                    tl.store(ring_rows[:, None] + t * stride_rh + cols[None, :], out.to(ring_ptr.dtype.element_ty),
                             mask=rmask[:, None])
            else:
                kh = t - n_q
                if kh >= n_k:
                    kh -= n_k
                idx = tl.load(idx_ptr + rows * stride_is + kh, mask=rmask, other=0)
                if t < n_q + n_k:  # a key head: rotated into the K cache at its write index
                    out = _rotate_rows(y_row, stride_y, rows, rmask, cos_ptr, sin_ptr, stride_cr, stride_sr,
                                       kw_ptr, k_eps, NORM, D)
                    dst = kc_ptr + rows.to(tl.int64) * stride_kcs + kh * stride_kch + idx * stride_kcc
                    tl.store(dst[:, None] + cols[None, :], out.to(kc_ptr.dtype.element_ty), mask=rmask[:, None])
                else:  # a value head: the matmul's output into the V cache, with its ||v||_1
                    val = tl.load(y_row + rows[:, None] * stride_y + cols[None, :], mask=rmask[:, None], other=0.0)
                    val = val.to(vc_ptr.dtype.element_ty)
                    dst = vc_ptr + rows.to(tl.int64) * stride_vcs + kh * stride_vch + idx * stride_vcc
                    tl.store(dst[:, None] + cols[None, :], val, mask=rmask[:, None])
                    if VNORM:
                        tl.store(vn_ptr + rows * stride_ns + kh * stride_nh + idx,
                                 tl.sum(tl.abs(val.to(tl.float32)), axis=1), mask=rmask)
                tl.debug_barrier()  # both halves read the write index before the second one advances it
                pair = pair_ptr + pid_m * n_k + kh
                if tl.atomic_add(pair, 1, sem="acq_rel") == 1:  # the second of the key and value epilogues
                    tl.atomic_xchg(pair, 0)
                    tl.store(pos_ptr + rows * stride_ps + kh * stride_ph + idx, cur.to(tl.int32), mask=rmask)
                    count = tl.minimum(tl.load(count_ptr + rows * stride_cs + kh, mask=rmask, other=0) + 1,
                                       capacity)
                    tl.store(count_ptr + rows * stride_cs + kh, count, mask=rmask)
                    if ADVANCE:
                        tl.store(idx_ptr + rows * stride_is + kh, tl.minimum(count, capacity - 1), mask=rmask)


def _config(rows: int, tiles: int, k: int, device) -> tuple[int, int, int, int, int]:
    """(block_m, block_k, split_k, num_warps, num_stages): the row tile that holds the rows (16-64), then the K
    chunks that bring the programs to about one per SM (at most 8, at least 256 columns a chunk)."""
    if CONFIG is not None:
        return CONFIG[max(key for key in CONFIG if key <= max(rows, min(CONFIG)))]
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    programs = tiles * triton.cdiv(rows, block_m)
    split = max(1, min(8, sm_count(device) // max(programs, 1), k // 256))
    return block_m, 128, split, 4, 4


def qkv_rotary(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, n_q: int, n_k: int, write: CacheWrite, q_norm=None, k_norm=None,
               qkv_out: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, H] (or [rows, 1, H]) through the joined weight [(n_q + 2 n_k) D, H] (and bias), then
    ``rotary(q, k, cos, sin, write=write, q_norm=, k_norm=)`` on the result: returns q_rot [rows, n_q, D] (the
    module docstring). ``qkv_out`` [rows, (n_q + 2 n_k) D]: where the matmul's output goes (a new tensor if None)."""
    assert triton is not None, "qkv_rotary needs Triton"
    x2 = x.reshape(-1, x.shape[-1])
    rows, k = x2.shape
    width, head_dim = weight.shape[0], write.k_cache.shape[-1]
    assert width == (n_q + 2 * n_k) * head_dim and weight.shape[1] == k, (weight.shape, n_q, n_k, head_dim)
    assert x2.dtype == weight.dtype and x2.stride(-1) == 1 and weight.stride(-1) == 1, (x2.dtype, weight.dtype)
    assert rows_ok(rows, head_dim), f"{rows} rows of head_dim {head_dim}: see rows_ok"
    assert bias is None or (bias.shape == (width,) and bias.is_contiguous()), bias
    cos2, sin2 = cos.reshape(rows, head_dim), sin.reshape(rows, head_dim)
    assert cos2.dtype == sin2.dtype == x2.dtype and cos2.stride(-1) == sin2.stride(-1) == 1
    qkv = qkv_out if qkv_out is not None else torch.empty(rows, width, dtype=x2.dtype, device=x2.device)
    assert qkv.shape == (rows, width) and qkv.stride(-1) == 1 and qkv.dtype == x2.dtype
    k_rows = qkv[:, n_q * head_dim:(n_q + n_k) * head_dim].view(rows, n_k, head_dim)
    kc = _check_write(write._replace(value=qkv[:, (n_q + n_k) * head_dim:].view(rows, n_k, head_dim)), k_rows)
    assert (q_norm is None) == (k_norm is None), "pass both q_norm and k_norm, or neither"
    norm = q_norm is not None
    (qw, q_eps), (kw, k_eps) = (_check_norm(q_norm, k_rows), _check_norm(k_norm, k_rows)) if norm else \
        ((qkv, 0.0), (qkv, 0.0))
    q_out = torch.empty(rows, n_q, head_dim, dtype=x2.dtype, device=x2.device)
    tiles = n_q + 2 * n_k
    bm, bk, split, warps, stages = _config(rows, tiles, k, x2.device)
    k_chunk = triton.cdiv(triton.cdiv(k, split), bk) * bk
    splits = triton.cdiv(k, k_chunk)
    blocks = triton.cdiv(rows, bm)
    ws = torch.empty(blocks * tiles * splits * bm * head_dim, dtype=torch.float32, device=x2.device) \
        if splits > 1 else qkv
    counters = _arrival_counters(x2.device, blocks * tiles + blocks * n_k)  # zero between launches
    cnt, pair = counters[:blocks * tiles], counters[blocks * tiles:]
    vn = write.vnorm if write.vnorm is not None else write.pos
    ring = write.q_ring if write.q_ring is not None else q_out
    _qkv_rotary_kernel[(tiles, splits, blocks)](
        x2, weight, bias if bias is not None else weight, qkv, ws, cnt, pair, rows, k, k_chunk, x2.stride(0),
        weight.stride(0), qkv.stride(0), cos2, sin2, cos2.stride(0), sin2.stride(0), q_out, qw, kw, q_eps, k_eps,
        kc, write.v_cache, vn, write.pos, write.count, write.write_idx, write.cur_pos, *kc.stride()[:3],
        *write.v_cache.stride()[:3], vn.stride(0), vn.stride(1), write.pos.stride(0), write.pos.stride(1),
        write.count.stride(0), write.write_idx.stride(0), write.capacity,
        ring, ring.stride(0), ring.stride(1), ring.stride(2) if ring.dim() == 4 else 0,
        ring.shape[1] if write.q_ring is not None else 1, n_q, n_k,
        D=head_dim, BLOCK_M=bm, BLOCK_K=bk, SPLIT=splits > 1, EVEN_K=k % k_chunk == 0 and k_chunk % bk == 0,
        HAS_BIAS=bias is not None, NORM=norm, VNORM=write.vnorm is not None, ADVANCE=bool(write.advance),
        RING=write.q_ring is not None, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return q_out
