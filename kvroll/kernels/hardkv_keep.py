"""Hard-KV's keep sets in one kernel: a calibrated compression event's scoring and selection, without a sort.

``HardKVPolicy.compress`` on the torch path runs ~60 kernels a call over [rows, Hkv, C] tensors: the base scores,
a stable sort of them, the calibrated softmax, its cumulative sum in score order (the top-p count), the ranks by a
scatter, the keep mask and its ascending slots. At 256 slots that is ~14 ms of a 28-layer event's ~18 on an H100
(session 35, ``benchmarks/event_profile.py``), the sort and the two scans the largest. Here one program per
(row, KV head) holds the row's C slots in registers and finds the same set:

* tiers as the torch path: live = pos >= 0; dense = live & (pos < sinks | pos >= cur - window); cand = live & ~dense;
* v = votes x cand, and for the ``snapkv`` base its max_pool1d(``pool``, stride 1; the candidates' votes are >= 0,
  so zero padding is torch's -inf padding: v is torch's value bit for bit);
* the order: v itself (max(v, 1e-30), as float bits; descending, ties by the lower slot), as the torch path
  orders (``HardKVPolicy.scores_and_order``: by v, not by log(v), which may map two v a few ulps apart to one fp32
  value) and the fp64 reference of the tests (``_naive_hardkv_keep``);
* prob = softmax(log(v) / T) over the candidates (T the row's calibrated temperature);
* the top-p count n: the fewest candidates, in that order, whose probability mass reaches ``thr`` (p - 1e-6 in
  fp32, the torch path's bound), found by bisection on the key: the largest key K with mass(key >= K) >= thr,
  then as many of the candidates tied at K (in slot order) as the mass still needs;
* n clamped to [min_keep, room] and to the candidates' count, then the top n by a bisection on counts (skipped
  where the clamp left n as it was);
* keep = dense | the n selected; its slots ([..., width], int32; past each row's count C - 1) in ascending order
  (as ``ascending_slots``) or, with ``hole_fill``, in ``hole_fill_slots``'s order; and the count.

What may differ from the torch path: the sums (softmax's and the mass's) add in another order, so where a row's
mass passes p within a rounding of its bound the count may move by one token (by more where the probabilities at
the bound are below fp32's resolution of the mass, p within a few ulps of 1: p = 0.9999999 moved a count by 16 of
~1,500 candidates on the CPU); session 29 noted the same between two batch sizes of the torch path on a GPU. The
tests compare the sets with the torch path's and the fp64 reference's and allow a difference only at such an edge.

    keep_idx, count = hardkv_keep(pos, votes, temp, rows, cur, sinks=4, window=32, thr=..., min_keep=8,
                                  room=988, width=1024, pool=1)

pos [R, Hkv, C] int32, votes [R, Hkv, C] fp32, temp [R, Hkv] fp32 (rows of the cache's layer-major buffers, any
strides but the last), rows [r] int64 (which R-rows to score), cur [r] int64 (each row's position being decoded).
"""
from __future__ import annotations

import numpy as np
import torch

try:  # Triton is optional on CPU-only installs; the torch path of HardKVPolicy is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


# the warps of a 2,048-slot program: 4 (session 35, H100, one layer of an event, benchmarks/hardkv_keep_ab.py: 118.6 µs
# at 256 slots against 144.1 with 8 and 167.6 with 16; 44.6 against 46.2 and 53.2 at 64)
WARPS = 4


def warps_for(block: int) -> int:
    """A program's warps: ``WARPS`` at 2,048 slots, in proportion above (16 elements a thread; at most 16 warps) and
    half below."""
    return min(16, max(WARPS, block // 512)) if block >= 2048 else max(1, WARPS // 2)


def keep_threshold(p: float) -> float:
    """The top-p count's bound as the torch path compares it: ``mass < p - 1e-6`` against an fp32 tensor."""
    return float(np.float32(p - 1e-6))


if triton is not None:

    @triton.jit
    def _tiers(pos, sinks, window, cur):
        """(dense, cand): the live sinks and window, and the other live tokens (the scored ones)."""
        live = pos >= 0
        dense = live & ((pos < sinks) | (pos >= cur - window))
        return dense, live & (dense == 0)

    @triton.jit
    def _pooled(votes_row, pos_row, offs, d, capacity, sinks, window, cur):
        """votes x cand at slots offs + d (0 outside the row): the candidates' votes, shifted by d."""
        o = offs + d
        inside = (o >= 0) & (o < capacity)
        pos = tl.load(pos_row + o, mask=inside, other=-1)
        cand = _tiers(pos, sinks, window, cur)[1]
        votes = tl.load(votes_row + o, mask=inside, other=0.0)
        return votes * cand.to(tl.float32)

    @triton.jit
    def _bisect(key, weight, cand, need, lo, hi):
        """The largest key K in [lo, hi) with sum(weight over cand & key >= K) >= need, given that lo holds it and
        hi does not (int32 keys: a range below 2^31 closes in 31 halvings). Testing 3, 7 or 15 thresholds a round
        in one [WAYS, BLOCK] reduction was slower at every shape (session 35, ``raw/s35/keep_multiway.patch``)."""
        for _ in range(31):
            mid = lo + (hi - lo) // 2
            total = tl.sum(tl.where(cand & (key >= mid), weight, 0.0), axis=0)
            ok = total >= need
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        return lo

    @triton.jit
    def _row(pos_ptr, votes_ptr, rows_ptr, cur_ptr, stride_pr, stride_ph, stride_vr, stride_vh, capacity, sinks,
             window, POOL: tl.constexpr, BLOCK: tl.constexpr):
        """Program (i, h)'s row: its R-row, slots, tiers (dense, cand), the candidates' votes (votes x cand) and the
        score's basis v = max(votes x cand, max-pooled for the snapkv base, 1e-30) with its key (float bits)."""
        i, h = tl.program_id(0), tl.program_id(1)
        row = tl.load(rows_ptr + i).to(tl.int64)
        cur = tl.load(cur_ptr + i)
        pos_row = pos_ptr + row * stride_pr + h * stride_ph
        votes_row = votes_ptr + row * stride_vr + h * stride_vh
        offs = tl.arange(0, BLOCK)
        inside = offs < capacity
        pos = tl.load(pos_row + offs, mask=inside, other=-1)
        dense, cand = _tiers(pos, sinks, window, cur)
        raw = tl.load(votes_row + offs, mask=inside, other=0.0) * cand.to(tl.float32)
        # the snapkv base's max_pool1d (a maximum is exact: torch's value bit for bit)
        if POOL == 1:
            v = raw
        else:
            v = tl.zeros([BLOCK], dtype=tl.float32)
            for d in tl.static_range(POOL):
                v = tl.maximum(v, _pooled(votes_row, pos_row, offs, d - POOL // 2, capacity, sinks, window, cur))
        v = tl.maximum(v, 1e-30)
        key = v.to(tl.int32, bitcast=True)  # v > 0: its bits order as the value
        return row, offs, dense, cand, raw, v, key

    @triton.jit
    def _top_p(key, prob, cand, thr, num_cand):
        """The top-p count n (the fewest candidates by key, ties by slot, whose prob reaches thr; every candidate if
        their total does not), with the key K at rank n and the number of candidates tied at K it takes."""
        lo = tl.min(tl.where(cand, key, 0x7F800000), axis=0)
        hi = tl.max(tl.where(cand, key, 0), axis=0) + 1
        reach = tl.sum(prob, axis=0) >= thr  # else (rounding, or no candidates) every candidate
        top = _bisect(key, prob, cand, thr, lo, hi)
        above = cand & (key > top)
        tied = cand & (key == top)
        mass = tl.sum(tl.where(above, prob, 0.0), axis=0)
        q = tl.max(tl.where(tied, prob, 0.0), axis=0)  # the tied candidates' one probability (> 0 if reach)
        ties = tl.sum(tied.to(tl.int32), axis=0)
        need = tl.minimum(tl.maximum(tl.ceil((thr - mass) / tl.where(q > 0, q, 1.0)).to(tl.int32), 1), ties)
        n = tl.where(reach, tl.sum(above.to(tl.int32), axis=0) + need, num_cand)
        return n, tl.where(reach, top, lo), tl.where(reach, need, num_cand)

    @triton.jit
    def _top_n(key, cand, n):
        """The key K at rank n among the candidates (by key, ties by slot; 1 <= n <= their count) and how many of
        those tied at K rank within n."""
        lo = tl.min(tl.where(cand, key, 0x7F800000), axis=0)
        hi = tl.max(tl.where(cand, key, 0), axis=0) + 1
        top = _bisect(key, cand.to(tl.float32), cand, n.to(tl.float32), lo, hi)
        return top, n - tl.sum((cand & (key > top)).to(tl.int32), axis=0)

    @triton.jit
    def _softmax(z, cand, num_cand):
        """softmax over the candidates (0 elsewhere; all 0 without a candidate, as the torch path's nan_to_num)."""
        z = tl.where(cand, z, float("-inf"))
        e = tl.exp(z - tl.where(num_cand > 0, tl.max(z, axis=0), 0.0))
        total = tl.sum(e, axis=0)
        return tl.where(cand, e / tl.where(total > 0, total, 1.0), 0.0)

    @triton.jit
    def _hardkv_calibrate_kernel(
        pos_ptr, votes_ptr, temp_ptr, rows_ptr, cur_ptr,
        stride_pr, stride_ph, stride_vr, stride_vh, stride_tr, stride_th,
        capacity, sinks, window, thr, p,
        ITERS: tl.constexpr, POOL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """``calibrate_temperature`` for the uncalibrated heads (temp <= 0) of rows ``rows``: n = the top-p count of
        the raw attention (the candidates' votes, normalised), then ITERS bisection rounds on log T over
        [spread x 1e-4, spread x 1e4] until the n highest-score candidates hold mass p under softmax(s / T)."""
        row, offs, dense, cand, raw, v, key = _row(pos_ptr, votes_ptr, rows_ptr, cur_ptr, stride_pr, stride_ph,
                                                   stride_vr, stride_vh, capacity, sinks, window, POOL, BLOCK)
        h = tl.program_id(1)
        t_ptr = temp_ptr + row * stride_tr + h * stride_th
        num_cand = tl.sum(cand.to(tl.int32), axis=0)
        attention = raw / tl.maximum(tl.sum(raw, axis=0), 1e-30)
        n, _, _ = _top_p(attention.to(tl.int32, bitcast=True), attention, cand, thr, num_cand)
        n = tl.where(tl.sum(attention, axis=0) >= thr, n, capacity)  # the torch path's count: C if p is not reached
        if n < num_cand:  # the n highest scores (ties by slot); else every candidate
            top, need = _top_n(key, cand, tl.maximum(n, 1))
            tie_rank = tl.cumsum((cand & (key == top)).to(tl.int32), axis=0)
            first = cand & ((key > top) | ((key == top) & (tie_rank <= need)))
        else:
            first = cand
        s = tl.log(v)
        spread = tl.max(tl.where(cand, s, float("-inf")), axis=0) - tl.min(tl.where(cand, s, float("inf")), axis=0)
        spread = tl.maximum(tl.where(num_cand > 0, spread, 1.0), 1e-6)
        low, high = tl.log(spread * 1e-4), tl.log(spread * 1e4)
        for _ in range(ITERS):
            mid = (low + high) / 2
            prob = _softmax(tl.math.div_rn(s, tl.exp(mid)), cand, num_cand)
            above = tl.sum(tl.where(first, prob, 0.0), axis=0) > p  # too peaked: raise T
            low = tl.where(above, mid, low)
            high = tl.where(above, high, mid)
        old = tl.load(t_ptr)
        tl.store(t_ptr, tl.where(old <= 0, tl.exp((low + high) / 2), old))

    @triton.jit
    def _hardkv_keep_kernel(
        pos_ptr, votes_ptr, temp_ptr, rows_ptr, cur_ptr, out_ptr, count_ptr,
        stride_pr, stride_ph, stride_vr, stride_vh, stride_tr, stride_th,
        num_heads, capacity, width, sinks, window, thr, min_keep, room,
        POOL: tl.constexpr, TOP_P: tl.constexpr, HOLE_FILL: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row, offs, dense, cand, raw, v, key = _row(pos_ptr, votes_ptr, rows_ptr, cur_ptr, stride_pr, stride_ph,
                                                   stride_vr, stride_vh, capacity, sinks, window, POOL, BLOCK)
        i, h = tl.program_id(0), tl.program_id(1)
        num_cand = tl.sum(cand.to(tl.int32), axis=0)
        if TOP_P:
            temp = tl.load(temp_ptr + row * stride_tr + h * stride_th)
            prob = _softmax(tl.math.div_rn(tl.log(v), temp), cand, num_cand)
            n_p, top, need = _top_p(key, prob, cand, thr, num_cand)
        else:  # p = 1 keeps every candidate (the torch path's rule)
            top = tl.min(tl.where(cand, key, 0x7F800000), axis=0)
            n_p = num_cand
            need = num_cand
        n = tl.minimum(tl.minimum(tl.maximum(n_p, min_keep), room), num_cand)
        if n != n_p:  # clamped: the top n by count
            top, need = _top_n(key, cand, tl.maximum(n, 1))
        above = cand & (key > top)
        tied = cand & (key == top)
        tie_rank = tl.cumsum(tied.to(tl.int32), axis=0)  # 1-based among the tied, in slot order
        chosen = (above | (tied & (tie_rank <= need))) & (n > 0)
        keep = (dense.to(tl.int32) + chosen.to(tl.int32)) > 0  # (a bool the interpreter's store takes as a mask)
        count = tl.sum(keep.to(tl.int32), axis=0)
        out_row = out_ptr + (i * num_heads + h).to(tl.int64) * width
        if HOLE_FILL:  # kept slots below count stay; the holes below count take the kept slots past it, in turn
            below = offs < count
            hole = below & (keep == 0)
            tail = keep & (below == 0)
            hole_rank = tl.cumsum(hole.to(tl.int32), axis=0) - 1
            tail_rank = tl.cumsum(tail.to(tl.int32), axis=0) - 1
            tl.store(out_row + hole_rank, offs, mask=hole)  # out[r] = the r-th hole (scratch: rewritten below)
            tl.debug_barrier()
            dest = tl.load(out_row + tail_rank, mask=tail, other=0)
            tl.debug_barrier()
            tl.store(out_row + offs, offs, mask=keep & below)
            tl.store(out_row + dest, offs, mask=tail)
        else:  # kept slots in ascending order
            dest = tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(out_row + dest, offs, mask=keep & (dest < width))
        tl.store(out_row + offs, tl.full([BLOCK], 0, tl.int32) + capacity - 1, mask=(offs >= count) & (offs < width))
        tl.store(count_ptr + i * num_heads + h, count.to(tl.int64))


def _layout(pos: torch.Tensor, votes: torch.Tensor, temp: torch.Tensor) -> tuple[int, int]:
    """(Hkv, C) of the launchers' buffers, checked: pos int32, votes and temp fp32, rows contiguous along C."""
    assert pos.dtype == torch.int32 and votes.dtype == torch.float32 and temp.dtype == torch.float32
    assert pos.stride(-1) == 1 and votes.stride(-1) == 1 and votes.shape == pos.shape, (pos.stride(), votes.shape)
    return pos.shape[1], pos.shape[2]


def _check_rows(rows: torch.Tensor, cur: torch.Tensor) -> None:
    """rows [r] int64 and cur [r], each contiguous: the kernels read entry i at ptr + i."""
    assert rows.dim() == 1 and cur.shape == rows.shape and rows.dtype == torch.int64, \
        (rows.shape, cur.shape, rows.dtype)
    assert rows.is_contiguous() and cur.is_contiguous(), (rows.stride(), cur.stride())


def hardkv_keep(pos: torch.Tensor, votes: torch.Tensor, temp: torch.Tensor, rows: torch.Tensor,
                cur: torch.Tensor, *, sinks: int, window: int, thr: float, min_keep: int, room: int, width: int,
                pool: int = 1, top_p: bool = True, hole_fill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept slots [r, Hkv, width] int32 and counts [r, Hkv] int64 (module doc): in ascending order, or
    with ``hole_fill`` in ``hole_fill_slots``'s order (``kvroll.policies.base``).

    ``top_p=False``: every candidate (p >= 1), clamped as the torch path clamps."""
    heads, capacity = _layout(pos, votes, temp)
    _check_rows(rows, cur)
    assert 0 < width <= capacity and pool % 2 == 1, (width, capacity, pool)
    n = rows.shape[0]
    out = torch.empty(n, heads, width, dtype=torch.int32, device=pos.device)
    count = torch.empty(n, heads, dtype=torch.int64, device=pos.device)
    if n == 0:
        return out, count
    block = triton.next_power_of_2(capacity)
    _hardkv_keep_kernel[(n, heads)](
        pos, votes, temp, rows, cur, out, count, pos.stride(0), pos.stride(1), votes.stride(0), votes.stride(1),
        temp.stride(0), temp.stride(1), heads, capacity, width, sinks, window, thr, min_keep, room,
        POOL=pool, TOP_P=top_p, HOLE_FILL=hole_fill, BLOCK=block,
        num_warps=warps_for(block))
    return out, count


def hardkv_calibrate(pos: torch.Tensor, votes: torch.Tensor, temp: torch.Tensor, rows: torch.Tensor,
                     cur: torch.Tensor, *, sinks: int, window: int, p: float, iters: int, pool: int = 1) -> None:
    """``calibrate_temperature`` (``kvroll.policies.hardkv``) in one kernel for the heads of ``rows`` whose
    temperature is not set (temp <= 0), in place in ``temp``; the layouts as ``hardkv_keep``'s. The same bisection
    on log T; its rounds' masses add in another order than the torch path's, so T agrees to the bisection's
    rounding (the tests: relative 1e-4), not bit for bit."""
    heads, capacity = _layout(pos, votes, temp)
    _check_rows(rows, cur)
    if rows.shape[0] == 0:
        return
    block = triton.next_power_of_2(capacity)
    _hardkv_calibrate_kernel[(rows.shape[0], heads)](
        pos, votes, temp, rows, cur, pos.stride(0), pos.stride(1), votes.stride(0), votes.stride(1),
        temp.stride(0), temp.stride(1), capacity, sinks, window, keep_threshold(p), p,
        ITERS=iters, POOL=pool, BLOCK=block, num_warps=warps_for(block))
