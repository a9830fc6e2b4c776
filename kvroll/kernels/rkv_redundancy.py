"""R-KV redundancy (Eqs. 5-6 of papers/r-kv.txt) without the [n, Hkv, C, C] similarity matrix.

The reference (``kvroll.policies.rkv.rkv_redundancy``) builds S = cosine similarity of the normalised keys
(eps 1e-8) of every live pair, diagonal zeroed, zeroes for each row u its similarity to its ``beta`` most
recent tokens v with S[u, v] > T, takes the column mean and a softmax over the live tokens. At n = 224 rows,
8 heads and C = 1152 that is ~20 GB of fp32 sims, int64 ranks and masks per layer. Two bounded versions:

* ``rkv_redundancy_blocked`` (torch, any ``beta``, the CPU path): the reference over blocks of rows u, each
  block's column sums accumulated; memory ~ ``block_elems`` similarities at a time.
* ``rkv_redundancy_triton`` (CUDA, ``beta`` in {0, 1}): S is symmetric, so column v's sum over u equals row
  v's sum; with beta = 1 each row u exempts one entry, (u, ex(u)), the live v != u of largest position with
  S[u, v] > T. Hence col[v] = rowsum[v] - sum_{u: ex(u) = v} S[u, v]. Four kernels, all ``tl.dot`` on the raw
  keys (scaled by the inverse norms afterwards); torch subtracts the exemptions, takes the mean and the softmax:

  - ``kernel="ordered"`` (needs T >= 0 and the live positions ascending with the slot index,
    which the engine's periodic caches keep, checked by ``slot_ordered``): the newest similar token is the
    similar token of largest slot, so the position ranking drops out. Per tile element: one multiply
    (s = S[u, v] / inv_u), the row sum (scaled by inv_u once at the end), one compare against T / inv_u and a
    max of slot indices; dead slots have inv = 0 (their keys are not read), so no pair mask outside the
    diagonal tiles; S[u, ex(u)] is recomputed once per row after the loop.
  - ``kernel="scan"`` (the engine's: "ordered"'s contract, "auto"'s pick while ``ORDERED_SCAN``): the row sums are
    linear in the normalised keys, sum_{v != u} S[u, v] = inv_u k_u . s - inv_u^2 |k_u|^2 with s the row's sum of
    normalised keys (one pass over the keys, which also writes the inverse norms), so the tiles serve the exemption
    alone: the newest BLOCK_V slots first, the older ones only where a live u row of the block found no similar
    token there. A real model's keys are mostly similar (SmolLM2-135M: 63-71% of pairs above T = 0.5, 97-99% of
    rows with their newest similar token in the newest 128 slots), so most blocks stop after one tile; random keys
    have no similar pair and every block visits every tile.
  - ``kernel="rows"`` (any order and threshold): every tile, each program owning its u rows, the exemption
    ranked by position: rowsum[u], ex(u) (-1: none) and S[u, ex(u)] are plain stores; the exemptions are
    subtracted with an fp64 scatter (exact, hence order-free, for T = 0.5: the values lie in (T, 1]).
  - ``kernel="symmetric"``: one program per (row * head, block of u rows) visits only the tiles on or
    right of the diagonal (pairs v >= u) and credits both sides: row u over columns v, and by symmetry row v
    over columns u (the tile's column sums and column-wise exemptions). Half the tiles of "rows".
    Rows receive contributions from several programs, through integer atomics so that the result is
    bitwise deterministic: row sums in int64 fixed point (each fp32 partial sum truncated to a multiple of
    2^-40, integer addition being exact and order-free; error <= 2^-40 per partial, ~1e-11 per row; fp64
    atomics would not do: a partial below ~2^-19 next to a sum ~2^11 rounds, differently in each order), and the
    exemption as an int64 ``atomic_max`` of (rank of the position << 32 | the fp32 bits of S[u, v]): ranks
    (the order of the positions within a row, from a stable argsort) are unique, so the max is the newest
    candidate and carries its similarity, and the rank maps back to the slot through the argsort. Dead
    slots' keys are not read (a masked load, inverse norm 0), so a non-finite key there cannot leak in. On an
    H200 it is slower than "rows" (6.67 vs 5.26 ms per layer at 256 slots x 8 heads x 1152 tokens): its
    atomics and diagonal tiles cost more than the tiles it skips.

Grid: one program per (row * head, block of u rows), the blocks of a row adjacent (a 1-D grid), so that they run
together and read the row's keys from L2 (ordered the other way, the ordered kernel took 3.25 instead of 2.56 ms
per layer in an H200 profile at 256 slots x 8 heads x 1152 tokens).

Exactly like the reference, a candidate for the exemption is any v with pos[v] >= 0 whose *masked* S[u, v]
(0 on the diagonal and for non-live pairs) exceeds T, so with T < 0 the diagonal can take the exemption (it
removes 0). Positions of live tokens are unique per (row, head), as in the cache; ties would be broken
differently from ``topk`` (the symmetric kernel: the larger slot index).

Precision: bf16/fp16 keys are multiplied on the tensor cores with fp32 accumulation; their products are exact
in fp32, so the sims differ from the fp32 reference by summation order only (~1e-7 relative), as do the
outputs. fp32 keys use ``dot_precision`` ("ieee" by default; the interpreter tests run fp32 "ieee").

    red = rkv_redundancy_triton(k, pos >= 0, pos, threshold=0.5, beta=1)   # [n, Hkv, C] fp32, on CUDA
    red = rkv_redundancy_blocked(k, pos >= 0, pos, threshold=0.5, beta=1)  # the same on CPU
"""
from __future__ import annotations

import torch

try:  # Triton is optional on CPU-only installs; the blocked torch version is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

_EPS = 1e-8


def redundancy_softmax(col: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Eq. 6 from the column sums col [n, Hkv, C]: mean over the live rows, softmax over the live tokens."""
    mean = col / live.sum(dim=-1, keepdim=True).clamp_min(1)
    return mean.masked_fill(~live, float("-inf")).softmax(dim=-1).nan_to_num(0.0)


def rkv_redundancy_blocked(k: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, threshold: float, beta: int,
                           block_elems: int = 1 << 24) -> torch.Tensor:
    """The reference over blocks of rows u: k [n, Hkv, C, D]; live, pos [n, Hkv, C]. Returns [n, Hkv, C] fp32.

    Each block holds about ``block_elems`` similarities (fp32, plus an int64 rank when ``beta > 0``).
    """
    n, heads, capacity, _ = k.shape
    kf = k.float()
    normed = kf / (kf.norm(dim=-1, keepdim=True) + _EPS)  # [n, Hkv, C, D]
    rows = max(1, min(capacity, block_elems // max(1, n * heads * capacity)))
    col = torch.zeros(n, heads, capacity, dtype=torch.float32, device=k.device)
    pos_v = pos.long()[..., None, :]  # [n, Hkv, 1, C]
    columns = torch.arange(capacity, device=k.device)
    for u0 in range(0, capacity, rows):
        u1 = min(capacity, u0 + rows)
        sim = normed[:, :, u0:u1] @ normed.transpose(-1, -2)  # [n, Hkv, B, C]: rows u0..u1, every column v
        pair = live[..., u0:u1, None] & live[..., None, :]
        diag = columns[u0:u1, None] == columns[None, :]
        sim = sim.masked_fill(~pair | diag, 0.0)
        if beta > 0:
            rank = torch.where(sim > threshold, pos_v, -1)  # position of each similar v
            top = rank.topk(min(beta, capacity), dim=-1)
            exempt = torch.zeros_like(pair).scatter_(-1, top.indices, top.values >= 0)
            sim = sim.masked_fill(exempt, 0.0)
        col += sim.sum(dim=-2)
    return redundancy_softmax(col, live)


if triton is not None:

    @triton.jit
    def _inv_norm_kernel(x_ptr, out_ptr, stride_r, rows, eps, DIM: tl.constexpr, BLOCK: tl.constexpr):
        offs_r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        r_mask = offs_r < rows
        x = tl.load(x_ptr + offs_r.to(tl.int64)[:, None] * stride_r + tl.arange(0, DIM)[None, :],
                    mask=r_mask[:, None], other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_r, 1.0 / (tl.sqrt(tl.sum(x * x, 1)) + eps), mask=r_mask)

    @triton.jit
    def _row_and_block(capacity, BLOCK_U: tl.constexpr):
        """(row * Hkv + head, block of u rows) of this program: the blocks of a row are adjacent program ids (a
        1-D grid), so they run together and share the row's keys in L2."""
        blocks = tl.cdiv(capacity, BLOCK_U)
        return tl.program_id(0) // blocks, tl.program_id(0) % blocks

    @triton.jit
    def _rkv_rows_kernel(
        k_ptr, inv_ptr, live_ptr, pos_ptr, rowsum_ptr, ex_idx_ptr, ex_val_ptr,
        stride_kr, stride_kc, capacity, threshold,
        HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        r, ub = _row_and_block(capacity, BLOCK_U)
        offs_u = ub * BLOCK_U + tl.arange(0, BLOCK_U)
        offs_d = tl.arange(0, HEAD_DIM)
        u_mask = offs_u < capacity
        k_base = k_ptr + r.to(tl.int64) * stride_kr  # int64: large batches pass 2^31 elements
        meta = r * capacity  # inv, live, pos and the outputs are contiguous [rows * Hkv, C]
        k_u = tl.load(k_base + offs_u[:, None] * stride_kc + offs_d[None, :], mask=u_mask[:, None], other=0.0)
        inv_u = tl.load(inv_ptr + meta + offs_u, mask=u_mask, other=0.0)
        live_u = tl.load(live_ptr + meta + offs_u, mask=u_mask, other=0) != 0
        rowsum = tl.zeros([BLOCK_U], tl.float32)
        best_pos = tl.full([BLOCK_U], -1, tl.int32)
        best_idx = tl.full([BLOCK_U], -1, tl.int32)
        best_val = tl.zeros([BLOCK_U], tl.float32)
        for v0 in range(0, capacity, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            v_mask = offs_v < capacity
            k_v = tl.load(k_base + offs_v[:, None] * stride_kc + offs_d[None, :], mask=v_mask[:, None], other=0.0)
            inv_v = tl.load(inv_ptr + meta + offs_v, mask=v_mask, other=0.0)
            live_v = tl.load(live_ptr + meta + offs_v, mask=v_mask, other=0) != 0
            pos_v = tl.load(pos_ptr + meta + offs_v, mask=v_mask, other=-1)
            sim = tl.dot(k_u, tl.trans(k_v), input_precision=DOT_PREC) * inv_u[:, None] * inv_v[None, :]
            pair = live_u[:, None] & live_v[None, :] & (offs_u[:, None] != offs_v[None, :])
            sim = tl.where(pair, sim, 0.0)  # [BLOCK_U, BLOCK_V], masked as in the reference
            rowsum += tl.sum(sim, 1)
            if EXEMPT:  # the candidate of largest position in this tile, kept if newer than the best so far
                cand = (sim > threshold) & (pos_v >= 0)[None, :]
                key = tl.where(cand, pos_v[None, :], -1)
                tile_pos = tl.max(key, 1)
                hit = cand & (key == tile_pos[:, None])
                tile_idx = tl.max(tl.where(hit, offs_v[None, :], -1), 1)
                tile_val = tl.sum(tl.where(offs_v[None, :] == tile_idx[:, None], sim, 0.0), 1)
                newer = tile_pos > best_pos
                best_pos = tl.where(newer, tile_pos, best_pos)
                best_idx = tl.where(newer, tile_idx, best_idx)
                best_val = tl.where(newer, tile_val, best_val)
        tl.store(rowsum_ptr + meta + offs_u, rowsum, mask=u_mask)
        if EXEMPT:
            tl.store(ex_idx_ptr + meta + offs_u, best_idx, mask=u_mask)
            tl.store(ex_val_ptr + meta + offs_u, best_val, mask=u_mask)

    @triton.jit
    def _live_keys(k_base, inv_ptr, live_ptr, meta, offs, stride_kc, capacity, HEAD_DIM: tl.constexpr):
        """Liveness, keys and inverse norms of slots ``offs`` of one row (dead slots read as 0, inverse norm 0, so
        their S is 0)."""
        live = tl.load(live_ptr + meta + offs, mask=offs < capacity, other=0) != 0
        k = tl.load(k_base + offs[:, None] * stride_kc + tl.arange(0, HEAD_DIM)[None, :], mask=live[:, None],
                    other=0.0)
        inv = tl.load(inv_ptr + meta + offs, mask=live, other=0.0)
        return live, k, inv

    @triton.jit
    def _live_row_block(k_ptr, inv_ptr, live_ptr, stride_kr, stride_kc, capacity, HEAD_DIM: tl.constexpr,
                        BLOCK_U: tl.constexpr):
        """A program's (row * head, block of u rows) and its live u keys (dead slots read as 0, inverse norm 0)."""
        r, ub = _row_and_block(capacity, BLOCK_U)
        u0 = ub * BLOCK_U
        offs_u = u0 + tl.arange(0, BLOCK_U)
        offs_d = tl.arange(0, HEAD_DIM)
        k_base = k_ptr + r.to(tl.int64) * stride_kr  # int64: large batches pass 2^31 elements
        meta = r * capacity  # inv, live, rank and the outputs are contiguous [rows * Hkv, C]
        live_u, k_u, inv_u = _live_keys(k_base, inv_ptr, live_ptr, meta, offs_u, stride_kc, capacity, HEAD_DIM)
        return u0, offs_u, offs_d, k_base, meta, live_u, k_u, inv_u

    @triton.jit
    def _rkv_ordered_tile(
        k_u, thr_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr, meta, v0, stride_kc, capacity,
        HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, DIAG: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """Tile (u rows, v0 + BLOCK_V columns) of the ordered kernel: s = S[u, v] / inv_u, so the row sum is scaled
        once at the end and the exemption test is s > T / inv_u; the newest candidate is the largest slot."""
        offs_v = v0 + tl.arange(0, BLOCK_V)
        _, k_v, inv_v = _live_keys(k_base, inv_ptr, live_ptr, meta, offs_v, stride_kc, capacity, HEAD_DIM)
        s = tl.dot(k_u, tl.trans(k_v), input_precision=DOT_PREC) * inv_v[None, :]
        if DIAG:  # a tile crossing the diagonal: S[u, u] is 0
            s = tl.where(offs_v[None, :] != offs_u[:, None], s, 0.0)
        rowsum += tl.sum(s, 1)
        if EXEMPT:
            best = tl.maximum(best, tl.max(tl.where(s > thr_u[:, None], offs_v[None, :], -1), 1))
        return rowsum, best

    @triton.jit
    def _rkv_ordered_kernel(
        k_ptr, inv_ptr, live_ptr, rowsum_ptr, ex_idx_ptr, ex_val_ptr, stride_kr, stride_kc, capacity, threshold,
        HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        u0, offs_u, offs_d, k_base, meta, live_u, k_u, inv_u = _live_row_block(
            k_ptr, inv_ptr, live_ptr, stride_kr, stride_kc, capacity, HEAD_DIM, BLOCK_U)
        thr_u = tl.where(live_u, threshold / tl.where(live_u, inv_u, 1.0), float("inf"))  # dead u: no exemption
        rowsum = tl.zeros([BLOCK_U], tl.float32)
        best = tl.full([BLOCK_U], -1, tl.int32)
        v_lo = u0 // BLOCK_V * BLOCK_V  # tiles from v_lo to v_hi cross the diagonal
        v_hi = tl.minimum(tl.cdiv(u0 + BLOCK_U, BLOCK_V) * BLOCK_V, capacity)
        for v0 in range(0, v_lo, BLOCK_V):
            rowsum, best = _rkv_ordered_tile(k_u, thr_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr, meta, v0,
                                             stride_kc, capacity, HEAD_DIM, BLOCK_V, False, EXEMPT, DOT_PREC)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            rowsum, best = _rkv_ordered_tile(k_u, thr_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr, meta, v0,
                                             stride_kc, capacity, HEAD_DIM, BLOCK_V, True, EXEMPT, DOT_PREC)
        for v0 in range(v_hi, capacity, BLOCK_V):
            rowsum, best = _rkv_ordered_tile(k_u, thr_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr, meta, v0,
                                             stride_kc, capacity, HEAD_DIM, BLOCK_V, False, EXEMPT, DOT_PREC)
        u_mask = offs_u < capacity
        tl.store(rowsum_ptr + meta + offs_u, rowsum * inv_u, mask=u_mask)
        if EXEMPT:  # S[u, ex(u)] once more, on the CUDA cores (summation order differs from the tile's by ~1e-7)
            found = best >= 0
            k_ex = tl.load(k_base + best[:, None] * stride_kc + offs_d[None, :], mask=found[:, None], other=0.0)
            inv_ex = tl.load(inv_ptr + meta + best, mask=found, other=0.0)
            val = tl.sum(k_u.to(tl.float32) * k_ex.to(tl.float32), 1) * inv_u * inv_ex
            tl.store(ex_idx_ptr + meta + offs_u, best, mask=u_mask)
            tl.store(ex_val_ptr + meta + offs_u, tl.where(found, val, 0.0), mask=u_mask)

    @triton.jit
    def _norm_sum_kernel(k_ptr, live_ptr, inv_ptr, part_ptr, stride_kr, stride_kc, capacity, chunks, eps,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
        """Program (row * head, chunk of BLOCK slots): the chunk's inverse norms (0 where not live: those keys are
        not read) and its sum of normalised keys, sum_v inv_v k_v, as one fp32 partial [HEAD_DIM] of the row."""
        r = tl.program_id(0) // chunks
        c = tl.program_id(0) % chunks
        offs = c * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        meta = r * capacity
        live = tl.load(live_ptr + meta + offs, mask=offs < capacity, other=0) != 0
        x = tl.load(k_ptr + r.to(tl.int64) * stride_kr + offs[:, None] * stride_kc + offs_d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)
        inv = tl.where(live, 1.0 / (tl.sqrt(tl.sum(x * x, 1)) + eps), 0.0)
        tl.store(inv_ptr + meta + offs, inv, mask=offs < capacity)
        tl.store(part_ptr + tl.program_id(0) * HEAD_DIM + offs_d, tl.sum(x * inv[:, None], 0))

    @triton.jit
    def _scan_tile(k_u, thr_u, offs_u, k_base, inv_ptr, live_ptr, meta, v0, stride_kc, capacity,
                   HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, DIAG: tl.constexpr, DOT_PREC: tl.constexpr):
        """The largest slot v of tile v0 with S[u, v] > T, v != u (``DIAG``: the tile may hold v = u), per u row
        (-1: none)."""
        offs_v = v0 + tl.arange(0, BLOCK_V)
        k_v, inv_v = _live_keys(k_base, inv_ptr, live_ptr, meta, offs_v, stride_kc, capacity, HEAD_DIM)[1:]
        hit = tl.dot(k_u, tl.trans(k_v), input_precision=DOT_PREC) * inv_v[None, :] > thr_u[:, None]
        if DIAG:
            hit = hit & (offs_v[None, :] != offs_u[:, None])
        return tl.max(tl.where(hit, offs_v[None, :], -1), 1)

    @triton.jit
    def _rkv_scan_kernel(
        k_ptr, inv_ptr, live_ptr, total_ptr, rowsum_ptr, ex_idx_ptr, ex_val_ptr, stride_kr, stride_kc, capacity,
        threshold,
        HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """The slot-ordered contract without the full matrix where the keys allow it. Row sums from the row's sum
        of normalised keys s (``_norm_sum_kernel``'s partials, summed by torch: deterministic): sum_{v != u} S[u, v] =
        inv_u k_u . s - inv_u^2 |k_u|^2. The exemption, the similar token of largest slot: the newest tile first,
        then, only if a live u row of the block found none there, every older tile (a pipelined
        loop, the largest similar slot kept). With real keys the hit is almost always in the newest tile; random
        keys have none, and the block visits every tile, as "ordered" does."""
        u0, offs_u, offs_d, k_base, meta, live_u, k_u, inv_u = _live_row_block(
            k_ptr, inv_ptr, live_ptr, stride_kr, stride_kc, capacity, HEAD_DIM, BLOCK_U)
        r = _row_and_block(capacity, BLOCK_U)[0]
        total = tl.load(total_ptr + r * HEAD_DIM + offs_d)
        ku = k_u.to(tl.float32)
        rowsum = inv_u * tl.sum(ku * total[None, :], 1) - inv_u * inv_u * tl.sum(ku * ku, 1)
        u_mask = offs_u < capacity
        tl.store(rowsum_ptr + meta + offs_u, rowsum, mask=u_mask)
        if EXEMPT:
            thr_u = tl.where(live_u, threshold / tl.where(live_u, inv_u, 1.0), float("inf"))  # dead u: none
            newest = tl.maximum(capacity - BLOCK_V, 0)  # the newest BLOCK_V slots (unaligned: a full tile)
            best = _scan_tile(k_u, thr_u, offs_u, k_base, inv_ptr, live_ptr, meta, newest, stride_kc, capacity,
                              HEAD_DIM, BLOCK_V, True, DOT_PREC)
            # the older slots [0, newest) only where a live row found nothing in the newest (a hit there beats any
            # older one; the last older tile may overlap the newest: the max is the same), the diagonal masked in
            # the tiles crossing it only, as in the ordered kernel
            searching = tl.sum((live_u & (best < 0)).to(tl.int32), 0)
            end = tl.where(searching > 0, newest, 0)
            end_tiles = tl.cdiv(end, BLOCK_V) * BLOCK_V  # the older tiles end here (past ``end`` where unaligned)
            v_lo = tl.minimum(u0 // BLOCK_V * BLOCK_V, end_tiles)
            v_hi = tl.minimum(tl.cdiv(u0 + BLOCK_U, BLOCK_V) * BLOCK_V, end_tiles)
            v_hi = tl.maximum(v_hi, v_lo)
            for v0 in range(0, v_lo, BLOCK_V):
                best = tl.maximum(best, _scan_tile(k_u, thr_u, offs_u, k_base, inv_ptr, live_ptr, meta, v0,
                                                   stride_kc, capacity, HEAD_DIM, BLOCK_V, False, DOT_PREC))
            for v0 in range(v_lo, v_hi, BLOCK_V):
                best = tl.maximum(best, _scan_tile(k_u, thr_u, offs_u, k_base, inv_ptr, live_ptr, meta, v0,
                                                   stride_kc, capacity, HEAD_DIM, BLOCK_V, True, DOT_PREC))
            for v0 in range(v_hi, end, BLOCK_V):
                best = tl.maximum(best, _scan_tile(k_u, thr_u, offs_u, k_base, inv_ptr, live_ptr, meta, v0,
                                                   stride_kc, capacity, HEAD_DIM, BLOCK_V, False, DOT_PREC))
            found = best >= 0  # S[u, ex(u)] once more, on the CUDA cores, as in the ordered kernel
            k_ex = tl.load(k_base + best[:, None] * stride_kc + offs_d[None, :], mask=found[:, None], other=0.0)
            inv_ex = tl.load(inv_ptr + meta + best, mask=found, other=0.0)
            val = tl.sum(ku * k_ex.to(tl.float32), 1) * inv_u * inv_ex
            tl.store(ex_idx_ptr + meta + offs_u, best, mask=u_mask)
            tl.store(ex_val_ptr + meta + offs_u, tl.where(found, val, 0.0), mask=u_mask)

    _FIXED = tl.constexpr(2.0 ** 40)  # row sums are int64 multiples of 2^-40: |sum| < C < 2^21 leaves 2 bits spare

    @triton.jit
    def _pack_exemption(rank, val):
        """[B] int32 rank (-1: none) and fp32 S -> int64 key ordered by rank (-1: none), S in the low 32 bits."""
        bits = val.to(tl.int32, bitcast=True).to(tl.uint32, bitcast=True).to(tl.int64)
        return tl.where(rank >= 0, (rank.to(tl.int64) << 32) | bits, -1)

    @triton.jit
    def _rkv_sym_tile(
        k_u, inv_u, rank_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr, rank_ptr, sum_ptr, ex_ptr, meta, v0,
        stride_kc, capacity, threshold,
        HEAD_DIM: tl.constexpr, BLOCK_V: tl.constexpr, DIAG: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """Tile (u rows, v0 + BLOCK_V columns), pairs v >= u only: row u's sum and exemption candidate go to the
        registers (rowsum, best), row v's (the transposed tile, pairs v > u) to the atomics."""
        offs_v = v0 + tl.arange(0, BLOCK_V)
        live_v, k_v, inv_v = _live_keys(k_base, inv_ptr, live_ptr, meta, offs_v, stride_kc, capacity, HEAD_DIM)
        sim = tl.dot(k_u, tl.trans(k_v), input_precision=DOT_PREC) * inv_u[:, None] * inv_v[None, :]
        if DIAG:  # a tile crossing the diagonal: pairs v < u belong to another tile, the diagonal is 0
            sim = tl.where(offs_v[None, :] > offs_u[:, None], sim, 0.0)
        rowsum += tl.sum(sim, 1)
        tl.atomic_add(sum_ptr + meta + offs_v, (tl.sum(sim, 0) * _FIXED).to(tl.int64), mask=live_v, sem="relaxed")
        if EXEMPT:  # candidates: masked S > T at a position >= 0 (rank -1 otherwise), the newest per row
            similar = sim > threshold
            if DIAG:
                similar = similar & (offs_v[None, :] >= offs_u[:, None])
            rank_v = tl.load(rank_ptr + meta + offs_v, mask=offs_v < capacity, other=-1)
            row_key = tl.where(similar, rank_v[None, :], -1)
            row_rank = tl.max(row_key, 1)
            row_val = tl.sum(tl.where(row_key == row_rank[:, None], sim, 0.0), 1)
            best = tl.maximum(best, _pack_exemption(row_rank, row_val))
            col_key = tl.where(similar, rank_u[:, None], -1)
            col_rank = tl.max(col_key, 0)
            col_val = tl.sum(tl.where(col_key == col_rank[None, :], sim, 0.0), 0)
            tl.atomic_max(ex_ptr + meta + offs_v, _pack_exemption(col_rank, col_val), mask=live_v & (col_rank >= 0),
                          sem="relaxed")
        return rowsum, best

    @triton.jit
    def _rkv_sym_kernel(
        k_ptr, inv_ptr, live_ptr, rank_ptr, sum_ptr, ex_ptr, stride_kr, stride_kc, capacity, threshold,
        HEAD_DIM: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_V: tl.constexpr, EXEMPT: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        u0, offs_u, offs_d, k_base, meta, live_u, k_u, inv_u = _live_row_block(
            k_ptr, inv_ptr, live_ptr, stride_kr, stride_kc, capacity, HEAD_DIM, BLOCK_U)
        rank_u = tl.load(rank_ptr + meta + offs_u, mask=offs_u < capacity, other=-1)
        rowsum = tl.zeros([BLOCK_U], tl.float32)
        best = tl.full([BLOCK_U], -1, tl.int64)
        v_mid = tl.minimum(tl.cdiv(u0 + BLOCK_U, BLOCK_V) * BLOCK_V, capacity)  # tiles before it cross the diagonal
        for v0 in range(u0 // BLOCK_V * BLOCK_V, v_mid, BLOCK_V):
            rowsum, best = _rkv_sym_tile(k_u, inv_u, rank_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr,
                                         rank_ptr, sum_ptr, ex_ptr, meta, v0, stride_kc, capacity, threshold,
                                         HEAD_DIM, BLOCK_V, True, EXEMPT, DOT_PREC)
        for v0 in range(v_mid, capacity, BLOCK_V):
            rowsum, best = _rkv_sym_tile(k_u, inv_u, rank_u, offs_u, rowsum, best, k_base, inv_ptr, live_ptr,
                                         rank_ptr, sum_ptr, ex_ptr, meta, v0, stride_kc, capacity, threshold,
                                         HEAD_DIM, BLOCK_V, False, EXEMPT, DOT_PREC)
        tl.atomic_add(sum_ptr + meta + offs_u, (rowsum * _FIXED).to(tl.int64), mask=live_u, sem="relaxed")
        if EXEMPT:
            tl.atomic_max(ex_ptr + meta + offs_u, best, mask=live_u & (best >= 0), sem="relaxed")


def inverse_norms(x: torch.Tensor, use_triton: bool = True, block: int = 64) -> torch.Tensor:
    """1 / (||x_i||_2 + 1e-8) of every row of x [R, D] in fp32 (the reference's normalisation), [R]: one Triton
    kernel (where Triton runs and D is a power of two in [16, 256]), else torch's ``vector_norm``."""
    rows, dim = x.shape
    if not use_triton or triton is None or dim not in (16, 32, 64, 128, 256) or x.stride(-1) != 1:
        return 1.0 / (torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32) + _EPS)
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    _inv_norm_kernel[(triton.cdiv(rows, block),)](x, out, x.stride(0), rows, _EPS, DIM=dim, BLOCK=block,
                                                  num_warps=4)
    return out


KERNELS = ("auto", "scan", "ordered", "rows", "symmetric")
# "auto" on time-ordered rows: "scan" (row sums from the sum of the normalised keys, the older tiles searched only
# where the newest holds no similar token) when True, else "ordered" (every tile). Session 25 (H100, one layer's
# redundancy from CUDA graphs): 0.60-0.82x "ordered"'s time on a real model's keys; 1.05-1.13x on random keys, which
# have no similar pair (the engine benchmark's random-weight model: its R-KV events ~4% longer, its steps ~0.2%)
ORDERED_SCAN = True  # the A/B's switch
NORM_BLOCK = 128  # slots per program of ``_norm_sum_kernel`` (c6 at 64-256 slots: 16-64 slower)


def slot_ordered(live: torch.Tensor, pos: torch.Tensor) -> bool:
    """Whether the live positions strictly increase with the slot index in every row of ``pos`` [..., C]: then a
    row's newest similar token is its similar token of largest slot. The engine's periodic caches hold their
    tokens in time order (appended at the end, compacted in ascending slot order). One host sync."""
    p = pos.masked_fill(~live, -1)
    earlier = torch.cat([torch.full_like(p[..., :1], -1), p[..., :-1].cummax(dim=-1).values], dim=-1)
    return bool(((p > earlier) | ~live).all())


def rkv_redundancy_triton(k: torch.Tensor, live: torch.Tensor, pos: torch.Tensor, threshold: float, beta: int,
                          block_u: int = 64, block_v: int | None = None, dot_precision: str = "ieee",
                          num_warps: int = 4, num_stages: int = 2, kernel: str = "auto",
                          time_ordered: bool = False) -> torch.Tensor:
    """The reference's contract (see the module docstring) for ``beta`` in {0, 1}; [n, Hkv, C] fp32.

    k [n, Hkv, C, D] bf16/fp16/fp32 with a contiguous head dim; live bool and pos int32 [n, Hkv, C].
    ``dot_precision`` applies to fp32 keys only ("ieee" or "tf32"). ``kernel``: "ordered" (needs T >= 0 and the
    live positions ascending with the slot, ``slot_ordered``; asserted), "scan" (the same contract, the tiles
    searched newest first, see the module docstring), "rows" (the full matrix, any order), "symmetric" (the half
    matrix, deterministic through integer atomics), "auto" = "scan" (or "ordered" without ``ORDERED_SCAN``) where it
    applies, else "rows". All take the block sizes (``block_v`` None: 128 for "ordered" and "scan", 64 for the
    others, the H200 sweep's best at 256 slots x 8 heads x 1152 tokens, and the session-25 H100 probe's for
    "scan"). ``time_ordered=True``: the caller guarantees the order
    "ordered" needs (the engine's caches keep it), so it is not checked (no host sync).

        red = rkv_redundancy_triton(k, pos >= 0, pos, 0.5, 1)                       # scan or rows
        red = rkv_redundancy_triton(k, pos >= 0, pos, 0.5, 1, kernel="symmetric")   # half the tiles
    """
    assert triton is not None, "rkv_redundancy_triton needs Triton; use rkv_redundancy_blocked on CPU"
    assert beta in (0, 1), f"the kernel exempts at most one token per row (beta={beta}); use the blocked version"
    assert kernel in KERNELS, f"kernel={kernel!r}: one of {KERNELS}"
    n, heads, capacity, head_dim = k.shape
    assert live.shape == pos.shape == (n, heads, capacity), (live.shape, pos.shape, k.shape)
    assert live.dtype == torch.bool and pos.dtype == torch.int32, (live.dtype, pos.dtype)
    assert k.dtype in (torch.bfloat16, torch.float16, torch.float32), k.dtype
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim} must be a power of two in [16, 256]"
    assert dot_precision in ("ieee", "tf32"), dot_precision
    assert capacity < 2 ** 21, f"capacity {capacity}: the fixed-point row sums need |sum| < 2^21"
    if kernel in ("auto", "ordered", "scan"):
        ordered = beta == 0 or (threshold >= 0 and (time_ordered or slot_ordered(live, pos)))
        assert ordered or kernel == "auto", \
            f"kernel={kernel!r} needs threshold >= 0 (got {threshold}) and live positions ascending with the slot"
        if kernel == "auto":
            kernel = ("scan" if ORDERED_SCAN else "ordered") if ordered else "rows"
    block_v = block_v or (128 if kernel in ("ordered", "scan") else 64)
    rows = k.reshape(n * heads, capacity, head_dim)
    assert rows.stride(-1) == 1, "the head dim must be contiguous"
    live8 = live.reshape(n * heads, capacity).to(torch.int8)
    pos32 = pos.reshape(n * heads, capacity).contiguous()
    launch = dict(HEAD_DIM=head_dim, BLOCK_U=block_u, BLOCK_V=block_v, EXEMPT=beta == 1,
                  DOT_PREC=dot_precision if k.dtype == torch.float32 else "tf32", num_warps=num_warps,
                  num_stages=num_stages)
    grid = (n * heads * triton.cdiv(capacity, block_u),)
    if kernel == "scan":
        col = _scan_col_sums(rows, live8, float(threshold), launch, grid)
        return redundancy_softmax(col.view(n, heads, capacity), live)
    inv = inverse_norms(rows.reshape(-1, head_dim)).view(n * heads, capacity)  # [n * Hkv, C] fp32
    args = (rows, inv, live8, pos32, float(threshold), launch, grid)
    col = _symmetric_col_sums(*args) if kernel == "symmetric" else _row_col_sums(*args, ordered=kernel == "ordered")
    return redundancy_softmax(col.view(n, heads, capacity), live)


def _row_col_sums(rows, inv, live8, pos32, threshold, launch, grid, ordered) -> torch.Tensor:
    """Column sums [n * Hkv, C] fp32 from a full-matrix kernel ("rows" or "ordered"): each program owns its rows'
    sums and exemption; the exemptions are subtracted afterwards in fp64."""
    rowsum, ex_idx, ex_val = _row_outputs(live8)
    if ordered:
        _rkv_ordered_kernel[grid](rows, inv, live8, rowsum, ex_idx, ex_val, rows.stride(0), rows.stride(1),
                                  rows.shape[1], threshold, **launch)
    else:
        _rkv_rows_kernel[grid](rows, inv, live8, pos32, rowsum, ex_idx, ex_val, rows.stride(0), rows.stride(1),
                               rows.shape[1], threshold, **launch)
    return _subtract_exemptions(rowsum, ex_idx, ex_val) if launch["EXEMPT"] else rowsum


def _row_outputs(live8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The full-matrix and scan kernels' outputs for rows shaped like ``live8`` [n * Hkv, C]: the row sums (fp32),
    each row's exemption slot (int32, -1: none) and its similarity (0 where none)."""
    rowsum = torch.empty(live8.shape, dtype=torch.float32, device=live8.device)
    return rowsum, torch.full(live8.shape, -1, dtype=torch.int32, device=live8.device), torch.zeros_like(rowsum)


def _subtract_exemptions(rowsum, ex_idx, ex_val) -> torch.Tensor:
    """Column sums: the row sums less S[u, ex(u)] in column ex(u), in fp64 (exact for T = 0.5, order-free)."""
    exempt = torch.zeros_like(rowsum, dtype=torch.float64)  # ex_val = 0 where ex_idx = -1
    exempt.scatter_add_(-1, ex_idx.clamp_min(0).long(), ex_val.double())
    return (rowsum.double() - exempt).float()


def _scan_col_sums(rows, live8, threshold, launch, grid) -> torch.Tensor:
    """Column sums [n * Hkv, C] fp32 from the scan kernel: the inverse norms and each row's sum of normalised keys
    (in partials of ``NORM_BLOCK`` slots), then row sums and exemptions per block of u rows."""
    count, capacity, head_dim = rows.shape
    chunks = triton.cdiv(capacity, NORM_BLOCK)
    inv = torch.empty(live8.shape, dtype=torch.float32, device=rows.device)
    part = torch.empty(count, chunks, head_dim, dtype=torch.float32, device=rows.device)
    _norm_sum_kernel[(count * chunks,)](rows, live8, inv, part, rows.stride(0), rows.stride(1), capacity, chunks,
                                        _EPS, HEAD_DIM=head_dim, BLOCK=NORM_BLOCK, num_warps=4)
    total = part.sum(dim=1)  # [n * Hkv, D]
    rowsum, ex_idx, ex_val = _row_outputs(live8)
    _rkv_scan_kernel[grid](rows, inv, live8, total, rowsum, ex_idx, ex_val, rows.stride(0), rows.stride(1), capacity,
                           threshold, **launch)
    return _subtract_exemptions(rowsum, ex_idx, ex_val) if launch["EXEMPT"] else rowsum


def _symmetric_col_sums(rows, inv, live8, pos32, threshold, launch, grid) -> torch.Tensor:
    """Column sums [n * Hkv, C] fp32 from the half-matrix kernel, in int64 fixed point until the end."""
    live = live8 != 0
    inv = inv.masked_fill(~live, 0.0)  # dead slots are never read; a 0 norm keeps a non-finite key out too
    fixed_sum = torch.zeros(pos32.shape, dtype=torch.int64, device=rows.device)
    ex_key = torch.full_like(fixed_sum, -1)
    rank, order = _position_ranks(pos32) if launch["EXEMPT"] else (pos32, None)
    _rkv_sym_kernel[grid](rows, inv, live8, rank, fixed_sum, ex_key, rows.stride(0), rows.stride(1),
                          rows.shape[1], threshold, **launch)
    if launch["EXEMPT"]:  # subtract S[u, ex(u)] from column ex(u), in the same fixed point: integer, order-free
        found = ex_key >= 0
        slot = order.gather(-1, (ex_key >> 32).clamp_min(0))
        low = ex_key & 0xFFFFFFFF  # the fp32 bits of S[u, ex(u)]
        val = torch.where(low >= 2 ** 31, low - 2 ** 32, low).to(torch.int32).view(torch.float32)
        fixed_val = (val.masked_fill(~found, 0.0).double() * 2.0 ** 40).trunc().long()
        fixed_sum.scatter_add_(-1, slot, fixed_val.neg_())
    return (fixed_sum.double() * 2.0 ** -40).float()


def _position_ranks(pos32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank [R, C] int32 of each slot's position within its row, -1 where pos < 0; the slots in rank order)."""
    order = pos32.argsort(dim=-1, stable=True)  # ties (not in a cache) go to the larger slot index
    ranks = torch.arange(pos32.shape[-1], dtype=torch.int32, device=pos32.device).expand_as(pos32)
    rank = torch.empty_like(pos32).scatter_(-1, order, ranks)
    return rank.masked_fill_(pos32 < 0, -1), order
