"""Decode attention over the static compressed cache, with the eviction statistics in the same pass.

One call handles one layer. The fp32 PyTorch reference (the CPU path and the oracle of the tests):

    out, stat, evict = decode_attention_torch(q, k_cache, v_cache, valid, scale, stat="contrib",
                                              evictable=evictable)

q: [slots, Hq, D]; k_cache, v_cache: [slots, Hkv, capacity, D]; valid, evictable: [slots, Hkv, capacity] bool.
out: [slots, Hq, D] in q's dtype; stat: [slots, Hkv, capacity] fp32 or None, where
  "contrib" = sum over the group's query heads of ||alpha_i * v_i||_1 (LongFlow) and
  "mass"    = sum over the group's query heads of alpha_i (H2O accumulation);
evict: argmin of stat over evictable slots, [slots, Hkv] (or [slots, 1] with ``layer_shared``), or None.

The fused Triton kernel (``decode_attention``) takes the cache metadata instead of materialised masks:
``pos`` [slots, Hkv, capacity] int32 true positions (-1 = empty), ``cur_pos`` [slots] and the protected
(sinks, window); ``length`` [slots, Hkv] optionally bounds the live region (slots at or past it are not read).
``decode_attention_ref`` is the same contract on top of the torch reference.

    out, stat, evict = decode_attention(q, k, v, pos, cur_pos, scale, stat="contrib", argmin=True,
                                        sinks=0, window=1, length=count)

How it runs: phase 1 has one program per (slot, KV head, capacity split); it loads each K/V tile once for all
the group's query heads, keeps an online (flash-decoding) softmax in fp32 and, when a statistic is asked for,
writes each token's per-query-head log2-domain logit t_gi. The statistic needs the final per-head normalisers
(M_g, L_g), so it is finished afterwards: stat_i = sum_g exp2(t_gi - M_g) / L_g, times ||v_i||_1 for
"contrib", then its masked argmin, per head or summed over the layer's KV heads. ||v_i||_1 comes from the
cache (``vnorm``, computed once when the token is written: the hot loop does no |V| work) or, without it, is
folded into t_gi in the hot loop. The finishing pass (which also merges the splits' partial softmax states)
runs, by default, in the last program to arrive at the row; a row's splits are neighbours in launch order, so
they run together and the logits they wrote are still in L2 (stored evict-last, K/V loaded evict-first) when
that program re-reads them, and it then discards their lines (PTX ``discard.global.L2``), so they are never
written back to memory (with fewer (slot, head) rows than SMs and 2+ query heads per KV head the logits are
instead stored straight from the dot's registers and not discarded: ``logit_defaults``; at 36-66 slots of 8 KV
heads they are stored from the registers too, with 2 pipeline stages: ``stat_two_stages``). Alternatives
(``finish``): a second small kernel (one program per row, or per chunk of a row with ``finish_chunk``), or the
program itself when one split owns the row. Extra traffic per token:
4 x group bytes of logits written and re-read (L2 only, when finished in place), 4 bytes of norm, 4 of
position, against 4 x head_dim bytes of K/V.
"""
from __future__ import annotations

import os

import torch

from kvroll.kernels import decode_launch as launch

try:  # Triton is optional on CPU-only installs; the torch reference is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
try:  # grid dependency control (programmatic dependent launch), Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - the kernels then never take the PDL branches
    gdc_launch_dependents = gdc_wait = None

STATS = (None, "contrib", "mass")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_STAT_CODE = {None: 0, "contrib": 1, "mass": 2}
_LOG2E = 1.4426950408889634


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    stat: str | None = None,
    evictable: torch.Tensor | None = None,
    layer_shared: bool = False,
):
    """fp32 reference of the fused decode kernel (see the module docstring)."""
    assert stat in STATS, stat
    slots, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.float().view(slots, num_kv_heads, group, head_dim)
    logits = torch.einsum("shgd,shcd->shgc", qg, k_cache.float()) * scale  # [S, Hkv, G, C]
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.einsum("shgc,shcd->shgd", probs, v_cache.float()).reshape(slots, num_q_heads, head_dim)
    score = None
    if stat is not None:
        score = probs.sum(dim=2)  # [S, Hkv, C]
        if stat == "contrib":
            score = score * v_cache.float().abs().sum(dim=-1)
    evict = None
    if evictable is not None and score is not None:
        evict = masked_argmin_stat(score, evictable, layer_shared)
    return out.to(q.dtype), score, evict


def masked_argmin_stat(score: torch.Tensor, evictable: torch.Tensor, layer_shared: bool) -> torch.Tensor:
    """argmin of ``score`` over evictable slots; ``layer_shared`` sums over KV heads first -> [S, 1]."""
    if layer_shared:
        score, evictable = score.sum(dim=1, keepdim=True), evictable[:, :1]
    return score.masked_fill(~evictable, float("inf")).argmin(dim=-1)


def metadata_masks(pos, cur_pos, sinks: int, window: int, length=None):
    """(valid, evictable) [slots, Hkv, capacity] from the cache metadata, exactly as the kernel derives them."""
    valid = pos >= 0
    if length is not None:
        valid = valid & (torch.arange(pos.shape[-1], device=pos.device) < length[..., None])
    evictable = valid & (pos >= sinks) & (pos <= (cur_pos - window)[:, None, None])
    return valid, evictable


def decode_attention_ref(q, k_cache, v_cache, pos, cur_pos, scale, stat=None, argmin=False, sinks=0, window=1,
                         layer_shared=False, length=None):
    """The kernel's contract (``decode_attention``) computed by the fp32 torch reference."""
    valid, evictable = metadata_masks(pos, cur_pos, sinks, window, length)
    return decode_attention_torch(q, k_cache, v_cache, valid, scale, stat=stat,
                                  evictable=evictable if argmin else None, layer_shared=layer_shared)


if triton is not None:

    @triton.jit
    def _decode_split_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, len_ptr, vn_ptr, out_ptr, part_o_ptr, part_ml_ptr, t_ptr, stat_ptr,
        cur_pos_ptr, evict_ptr, lock_ptr, stride_qs, stride_qh, stride_ks, stride_kh, stride_kc, stride_vs,
        stride_vh, stride_vc, stride_ps, stride_ph, stride_ns, stride_nh, stride_os, stride_oh,
        num_kv_heads, capacity, chunk, num_splits, qk_scale, sinks, window,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
        STAT: tl.constexpr, VNORM: tl.constexpr, DENSE: tl.constexpr, HAS_LEN: tl.constexpr,
        SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, FINISH: tl.constexpr, HEADS: tl.constexpr,
        SPLITS_PAD: tl.constexpr, WRITE_STAT: tl.constexpr, ARGMIN: tl.constexpr, BLOCK_E: tl.constexpr,
        KV_EVICT: tl.constexpr, T_EVICT: tl.constexpr, T_EARLY: tl.constexpr, T_ASM: tl.constexpr,
        DISCARD: tl.constexpr, GROUP_P2: tl.constexpr, MERGE_SB: tl.constexpr, EVICT_WRITE: tl.constexpr,
        PDL: tl.constexpr = False, PDL_WAIT: tl.constexpr = False, MERGE_ONE: tl.constexpr = False,
        EARLY: tl.constexpr = False,
    ):
        c, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # a row's splits run side by side
        if PDL_WAIT:  # a PDL launch in the decode layer's chain (kvroll.kernels.pdl_gemm): the previous kernel ends
            gdc_wait()
        if PDL:  # the next kernel (the merge, or the chain's o projection) may launch; it waits for this grid's end
            gdc_launch_dependents()
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        q = tl.load(q_ptr + s * stride_qs + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=g_mask[:, None], other=0.0)
        start = c * chunk
        end = tl.minimum(start + chunk, capacity)
        n_live = capacity  # the row's live slots (its finish reads no length again: ``EARLY``)
        if HAS_LEN:
            n_len = tl.load(len_ptr + s * num_kv_heads + h).to(tl.int32)
            end = tl.minimum(end, n_len)
            n_live = tl.minimum(n_len, capacity)
        if EARLY and FINISH != 0:
            cur = tl.load(cur_pos_ptr + s)  # the finish's one other scalar, asked for now
        k_base = k_ptr + s * stride_ks + h * stride_kh
        v_base = v_ptr + s * stride_vs + h * stride_vh
        p_base = pos_ptr + s * stride_ps + h * stride_ph
        t_base = t_ptr + (s * num_kv_heads + h) * GROUP * capacity
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + offs_n
            n_mask = offs < end
            if DENSE:  # the caller promises pos >= 0 below the live length: no position reads here
                live = n_mask
            else:
                live = tl.load(p_base + offs, mask=n_mask, other=-1) >= 0
            k = tl.load(k_base + offs[:, None] * stride_kc + offs_d[None, :], mask=n_mask[:, None], other=0.0,
                        eviction_policy=KV_EVICT)
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [G, N], log2 domain
            qk = tl.where(live[None, :], qk, float("-inf"))
            t_ptrs, t_mask = t_base + offs_g[:, None] * capacity + offs[None, :], g_mask[:, None] & n_mask[None, :]
            if STAT != 0 and T_EARLY:  # the logit alone (norms cached or none): stored before the softmax update
                if T_ASM:  # from the dot's register layout: tl.store would convert it through shared memory
                    _st_global_f32(t_ptrs, qk, t_mask, T_ASM == 2)
                else:
                    tl.store(t_ptrs, qk, mask=t_mask, eviction_policy=T_EVICT)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            e = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(e, 1)
            v = tl.load(v_base + offs[:, None] * stride_vc + offs_d[None, :], mask=n_mask[:, None], other=0.0,
                        eviction_policy=KV_EVICT)
            acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision=DOT_PREC)
            m_i = m_new
            if STAT != 0 and not T_EARLY:
                t = qk  # fold log2 ||v_i||_1 into the logit (VNORM 1, 2): alpha_i * |v_i| = exp2(t_i - M) / L
                if VNORM == 1:  # ones @ |V|^T on the tensor cores: every row is ||v_i||_1, in qk's layout
                    ones = tl.full([GROUP_PAD, HEAD_DIM], 1.0, v.dtype)
                    t = t + tl.log2(tl.dot(ones, tl.trans(tl.abs(v)), input_precision=DOT_PREC))
                if VNORM == 2:
                    t = t + tl.log2(tl.sum(tl.abs(v.to(tl.float32)), 1))[None, :]
                tl.store(t_ptrs, t, mask=t_mask, eviction_policy=T_EVICT)
        if SPLIT or (STAT != 0 and not (EARLY and FINISH == 1)):  # EARLY's FINISH 1 keeps them in registers
            ml = part_ml_ptr + ((s * num_kv_heads + h) * num_splits + c) * 2 * GROUP_PAD
            tl.store(ml + offs_g, m_i)
            tl.store(ml + GROUP_PAD + offs_g, l_i)
        if SPLIT:
            po = part_o_ptr + (((s * num_kv_heads + h) * num_splits + c) * GROUP_PAD) * HEAD_DIM
            tl.store(po + offs_g[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + s * stride_os + (h * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        if FINISH != 0:
            tl.debug_barrier()  # every thread's stores above are done before the row is finished (or released)
            if FINISH == 1 and EARLY:  # the normalisers from the registers, every load of the finish at once
                offs_r = tl.arange(0, GROUP_P2)
                sel = offs_r[:, None] == offs_g[None, :]  # [GROUP_P2, GROUP_PAD]: m_i's rows in the logits' order
                m_row = tl.max(tl.where(sel, m_i[None, :], float("-inf")), 1)
                l_row = tl.sum(tl.where(sel, l_i[None, :], 0.0), 1)
                # as _final_norm of one split: exp2(m - m_safe) is exactly 1 (or 0 with l = 0)
                _finish_early(s, h, n_live, cur, tl.where(m_row == float("-inf"), 0.0, m_row),
                              tl.where(l_row > 0, 1.0 / l_row, 0.0), out_ptr, part_o_ptr, part_ml_ptr, t_ptr,
                              vn_ptr, stat_ptr, pos_ptr, evict_ptr, stride_os, stride_oh, stride_ps, stride_ph,
                              stride_ns, stride_nh, num_kv_heads, capacity, num_splits, sinks, window, GROUP,
                              GROUP_PAD, HEAD_DIM, SPLITS_PAD, BLOCK_E, SPLIT, STAT, VNORM == 3, WRITE_STAT, ARGMIN,
                              DISCARD, GROUP_P2, MERGE_SB, EVICT_WRITE, MERGE_ONE, True)
            if FINISH == 1 and not EARLY:  # this program owns the whole row: finish it; its logits are re-read from L2
                _finish(s, h, out_ptr, part_o_ptr, part_ml_ptr, t_ptr, vn_ptr, stat_ptr, pos_ptr, len_ptr,
                        cur_pos_ptr, evict_ptr, stride_os, stride_oh, stride_ps, stride_ph, stride_ns, stride_nh,
                        num_kv_heads, capacity, num_splits, sinks, window, GROUP, GROUP_PAD, HEAD_DIM,
                        SPLITS_PAD, 1, BLOCK_E, SPLIT, STAT, VNORM == 3, WRITE_STAT, ARGMIN, HAS_LEN,
                        DISCARD, GROUP_P2, MERGE_SB, EVICT_WRITE, MERGE_ONE)
            if FINISH == 2:  # the last program to arrive at the row (all its heads, all splits) finishes it
                if HEADS == 1:
                    lock, arrivals, h0 = lock_ptr + s * num_kv_heads + h, num_splits, h
                else:
                    lock, arrivals, h0 = lock_ptr + s, num_kv_heads * num_splits, 0
                if tl.atomic_add(lock, 1, sem="acq_rel") == arrivals - 1:
                    tl.atomic_xchg(lock, 0)  # self-resetting: the counters stay zero between launches
                    if EARLY and HEADS == 1:
                        _finish_early(s, h, n_live, cur, 0.0, 0.0, out_ptr, part_o_ptr, part_ml_ptr, t_ptr, vn_ptr,
                                      stat_ptr, pos_ptr, evict_ptr, stride_os, stride_oh, stride_ps, stride_ph,
                                      stride_ns, stride_nh, num_kv_heads, capacity, num_splits, sinks, window,
                                      GROUP, GROUP_PAD, HEAD_DIM, SPLITS_PAD, BLOCK_E, SPLIT, STAT, VNORM == 3,
                                      WRITE_STAT, ARGMIN, DISCARD, GROUP_P2, MERGE_SB, EVICT_WRITE, MERGE_ONE,
                                      False)
                    else:
                        _finish(s, h0, out_ptr, part_o_ptr, part_ml_ptr, t_ptr, vn_ptr, stat_ptr, pos_ptr,
                                len_ptr, cur_pos_ptr, evict_ptr, stride_os, stride_oh, stride_ps, stride_ph,
                                stride_ns, stride_nh, num_kv_heads, capacity, num_splits, sinks, window, GROUP,
                                GROUP_PAD, HEAD_DIM, SPLITS_PAD, HEADS, BLOCK_E, SPLIT, STAT, VNORM == 3,
                                WRITE_STAT, ARGMIN, HAS_LEN, DISCARD, GROUP_P2, MERGE_SB, EVICT_WRITE, MERGE_ONE)

    @triton.jit
    def _st_global_f32(ptrs, vals, mask, EVICT_LAST: tl.constexpr):
        """fp32 ``vals`` stored at ``ptrs`` where ``mask``, element by element in the values' own register layout
        (PTX st.global, with an L2 evict-last policy if EVICT_LAST; CUDA only, not the interpreter)."""
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "setp.ne.b32 p, $3, 0; @p st.global.L2::cache_hint.b32 [$1], $2, pol; mov.u32 $0, 0; }",
                "=r,l,r,r", [ptrs, vals.to(tl.int32, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
                is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b32 [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r,r", [ptrs, vals.to(tl.int32, bitcast=True), mask.to(tl.int32)], dtype=tl.int32,
                is_pure=False, pack=1)

    @triton.jit
    def _discard_l2(ptrs, dep, mask):
        """Drop the 128-byte L2 lines at ``ptrs`` where ``mask`` without writing them back (PTX discard.global.L2,
        sm_80+; a later read of them is undefined). ``dep`` orders it after the reads it depends on."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p discard.global.L2 [$1], 128; mov.u32 $0, $2; }",
            "=r,l,r,r", [ptrs, dep, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _store_evict(evict_ptr, s, h0, idx, len_ptr, num_kv_heads, capacity, HEADS: tl.constexpr,
                     EVICT_WRITE: tl.constexpr):
        """The argmin of KV heads h0 .. h0 + HEADS - 1 of slot s. ``EVICT_WRITE``: evict_ptr is the cache's next
        write index [S, Hkv] instead, and each head gets its live count while it is below capacity (the next
        token appends), else the argmin (it replaces the evicted token): the cache's ``torch.where`` in-kernel."""
        if EVICT_WRITE:
            for hh in range(HEADS):
                n = tl.load(len_ptr + s * num_kv_heads + h0 + hh)
                tl.store(evict_ptr + s * num_kv_heads + h0 + hh, tl.where(n < capacity, n, idx.to(n.dtype)))
        else:
            tl.store(evict_ptr + s * (num_kv_heads // HEADS) + h0 // HEADS, idx.to(tl.int64))

    @triton.jit
    def _decode_merge_kernel(
        out_ptr, part_o_ptr, part_ml_ptr, t_ptr, vn_ptr, stat_ptr, pos_ptr, len_ptr, cur_pos_ptr, evict_ptr,
        part_ev_ptr, lock_ptr, stride_os, stride_oh, stride_ps, stride_ph, stride_ns, stride_nh, num_kv_heads,
        capacity, num_splits, sinks, window, chunk_e, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, HEADS: tl.constexpr, BLOCK_E: tl.constexpr,
        MERGE_OUT: tl.constexpr, STAT: tl.constexpr, VN_CACHED: tl.constexpr, WRITE_STAT: tl.constexpr,
        ARGMIN: tl.constexpr, HAS_LEN: tl.constexpr, CHUNKS_PAD: tl.constexpr, DISCARD: tl.constexpr,
        GROUP_P2: tl.constexpr, MERGE_SB: tl.constexpr, MERGE_E: tl.constexpr, EVICT_WRITE: tl.constexpr,
        PDL: tl.constexpr = False, N_STAT: tl.constexpr = 0, MERGE_ONE: tl.constexpr = False,
    ):
        """One program per (slot, head group, chunk): chunk c merges the splits' outputs of the c-th MERGE_E
        (query head, dim) elements of the heads (all of them in chunk 0 unless the rows are few) and finishes the
        statistic and partial argmin of tokens [c * chunk_e, (c + 1) * chunk_e); with several chunks the last to
        arrive at the row reduces the partial argmins (self-resetting arrival counters). ``N_STAT`` > 0: chunks
        0 .. N_STAT - 1 finish the statistic only and the chunks after them merge only (``MERGE_APART``), so that
        no program has both chains of loads. ``MERGE_ONE``: each merge in one pass (every split in one load)."""
        s, hg, ch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        h0 = hg * HEADS
        if PDL:  # launched early (programmatic dependent launch): the split kernel's writes are visible past this
            gdc_wait()
        if MERGE_OUT:
            e_ch = ch - N_STAT
            if (e_ch >= 0) & (e_ch * MERGE_E < GROUP_P2 * HEAD_DIM):
                _merge_out(s, h0, e_ch * MERGE_E, out_ptr, part_o_ptr, part_ml_ptr, stride_os, stride_oh,
                           num_kv_heads, num_splits, GROUP, GROUP_PAD, HEAD_DIM, HEADS, MERGE_E, MERGE_SB,
                           MERGE_ONE)
        if STAT != 0 and (N_STAT == 0 or ch < N_STAT):
            best, idx = _stat_argmin(s, h0, ch * chunk_e, ch * chunk_e + chunk_e, part_ml_ptr, t_ptr, vn_ptr,
                                     stat_ptr, pos_ptr, len_ptr, cur_pos_ptr, stride_ps, stride_ph, stride_ns,
                                     stride_nh, num_kv_heads, capacity, num_splits, sinks, window, GROUP, GROUP_PAD,
                                     SPLITS_PAD, HEADS, BLOCK_E, STAT, VN_CACHED, WRITE_STAT, ARGMIN, HAS_LEN,
                                     DISCARD, GROUP_P2)
            if ARGMIN:
                row = s * (num_kv_heads // HEADS) + hg
                n_chunks = tl.num_programs(2) if N_STAT == 0 else N_STAT
                if CHUNKS_PAD == 1:
                    _store_evict(evict_ptr, s, h0, idx, len_ptr, num_kv_heads, capacity, HEADS, EVICT_WRITE)
                else:
                    tl.store(part_ev_ptr + row * 2 * CHUNKS_PAD + ch, best)
                    tl.store(part_ev_ptr + row * 2 * CHUNKS_PAD + CHUNKS_PAD + ch, idx.to(tl.float32, bitcast=True))
                    tl.debug_barrier()
                    if tl.atomic_add(lock_ptr + row, 1, sem="acq_rel") == n_chunks - 1:
                        tl.atomic_xchg(lock_ptr + row, 0)
                        offs_c = tl.arange(0, CHUNKS_PAD)
                        c_mask = offs_c < n_chunks
                        mins = tl.load(part_ev_ptr + row * 2 * CHUNKS_PAD + offs_c, mask=c_mask,
                                       other=float("inf"), cache_modifier=".cg")
                        idxs = tl.load(part_ev_ptr + row * 2 * CHUNKS_PAD + CHUNKS_PAD + offs_c, mask=c_mask,
                                       other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
                        low = tl.min(mins, 0)  # all inf (nothing evictable): every chunk's index is 0
                        pick = tl.min(tl.where(c_mask & (mins == low), idxs, capacity), 0)
                        _store_evict(evict_ptr, s, h0, pick, len_ptr, num_kv_heads, capacity, HEADS, EVICT_WRITE)

    @triton.jit
    def _finish(s, h0, out_ptr, part_o_ptr, part_ml_ptr, t_ptr, vn_ptr, stat_ptr, pos_ptr, len_ptr, cur_pos_ptr,
                evict_ptr, stride_os, stride_oh, stride_ps, stride_ph, stride_ns, stride_nh, num_kv_heads,
                capacity, num_splits, sinks, window, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, HEADS: tl.constexpr, BLOCK_E: tl.constexpr,
                MERGE_OUT: tl.constexpr, STAT: tl.constexpr, VN_CACHED: tl.constexpr, WRITE_STAT: tl.constexpr,
                ARGMIN: tl.constexpr, HAS_LEN: tl.constexpr, DISCARD: tl.constexpr, GROUP_P2: tl.constexpr,
                MERGE_SB: tl.constexpr, EVICT_WRITE: tl.constexpr, MERGE_ONE: tl.constexpr):
        """Finish KV heads h0 .. h0 + HEADS - 1 of slot s in one program: merge the splits' outputs (in one load
        with ``MERGE_ONE``), then the statistic (summed over those heads) and its argmin over head h0's evictable
        slots."""
        if MERGE_OUT:
            _merge_out(s, h0, 0, out_ptr, part_o_ptr, part_ml_ptr, stride_os, stride_oh, num_kv_heads, num_splits,
                       GROUP, GROUP_PAD, HEAD_DIM, HEADS, GROUP_P2 * HEAD_DIM, MERGE_SB, MERGE_ONE)
        if STAT != 0:
            _, idx = _stat_argmin(s, h0, 0, capacity, part_ml_ptr, t_ptr, vn_ptr, stat_ptr, pos_ptr, len_ptr,
                                  cur_pos_ptr, stride_ps, stride_ph, stride_ns, stride_nh, num_kv_heads, capacity,
                                  num_splits, sinks, window, GROUP, GROUP_PAD, SPLITS_PAD, HEADS, BLOCK_E, STAT,
                                  VN_CACHED, WRITE_STAT, ARGMIN, HAS_LEN, DISCARD, GROUP_P2)
            if ARGMIN:
                _store_evict(evict_ptr, s, h0, idx, len_ptr, num_kv_heads, capacity, HEADS, EVICT_WRITE)

    @triton.jit
    def _merge_out(s, h0, e0, out_ptr, part_o_ptr, part_ml_ptr, stride_os, stride_oh, num_kv_heads, num_splits,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS: tl.constexpr,
                   E_BLOCK: tl.constexpr, MERGE_SB: tl.constexpr, ONE_PASS: tl.constexpr):
        """Elements e0 .. e0 + E_BLOCK - 1 of the output of KV heads h0 .. h0 + HEADS - 1 of slot s, from the
        splits' partial outputs: a head's (query head, dim) elements are one flat axis and MERGE_SB splits are
        loaded per step, so a row of many splits (the long tail's grids) is a few wide loads, not a chain of small
        ones. ``ONE_PASS`` (every split in one step): the maxima, sums and outputs in one load, not a pass for the
        maxima and another for the rest. Loads bypass L1 (``.cg``): other programs wrote these rows."""
        offs_e = e0 + tl.arange(0, E_BLOCK)  # (g, d) flat, as a split's partial output lies in memory
        e_g = offs_e // HEAD_DIM
        e_mask = e_g < GROUP
        offs_b = tl.arange(0, MERGE_SB)
        for hh in range(HEADS):
            h = h0 + hh
            if ONE_PASS:
                m, l_part, part, g_one, mask_one, offs_one = _merge_load(s, h, e0, part_o_ptr, part_ml_ptr,
                                                                         num_kv_heads, num_splits, GROUP, GROUP_PAD,
                                                                         HEAD_DIM, E_BLOCK, MERGE_SB)
                _merge_store(s, h, m, l_part, part, g_one, mask_one, offs_one, out_ptr, stride_os, stride_oh, GROUP,
                             HEAD_DIM)
            else:
                po = part_o_ptr + (s * num_kv_heads + h) * num_splits * GROUP_PAD * HEAD_DIM
                ml = part_ml_ptr + (s * num_kv_heads + h) * num_splits * 2 * GROUP_PAD
                m_max = tl.full([E_BLOCK], float("-inf"), tl.float32)
                for sp0 in range(0, num_splits, MERGE_SB):
                    sp = sp0 + offs_b
                    mask = (sp < num_splits)[:, None] & e_mask[None, :]
                    m = tl.load(ml + sp[:, None] * 2 * GROUP_PAD + e_g[None, :], mask=mask, other=float("-inf"),
                                cache_modifier=".cg")
                    m_max = tl.maximum(m_max, tl.max(m, 0))
                m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
                acc = tl.zeros([E_BLOCK], tl.float32)
                total = tl.zeros([E_BLOCK], tl.float32)
                for sp0 in range(0, num_splits, MERGE_SB):
                    sp = sp0 + offs_b
                    mask = (sp < num_splits)[:, None] & e_mask[None, :]
                    m_ptrs = ml + sp[:, None] * 2 * GROUP_PAD + e_g[None, :]
                    w = tl.exp2(tl.load(m_ptrs, mask=mask, other=float("-inf"), cache_modifier=".cg")
                                - m_safe[None, :])
                    l_part = tl.load(m_ptrs + GROUP_PAD, mask=mask, other=0.0, cache_modifier=".cg")
                    part = tl.load(po + sp[:, None] * GROUP_PAD * HEAD_DIM + offs_e[None, :], mask=mask, other=0.0,
                                   cache_modifier=".cg")
                    acc += tl.sum(part * w, 0)
                    total += tl.sum(l_part * w, 0)
                _merge_write(s, h, acc, total, e_g, e_mask, offs_e, out_ptr, stride_os, stride_oh, GROUP, HEAD_DIM)

    @triton.jit
    def _stat_argmin(s, h0, lo, hi, part_ml_ptr, t_ptr, vn_ptr, stat_ptr, pos_ptr, len_ptr, cur_pos_ptr,
                     stride_ps, stride_ps_h, stride_ns, stride_nh, num_kv_heads, capacity, num_splits, sinks, window,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, HEADS: tl.constexpr,
                     BLOCK_E: tl.constexpr, STAT: tl.constexpr, VN_CACHED: tl.constexpr, WRITE_STAT: tl.constexpr,
                     ARGMIN: tl.constexpr, HAS_LEN: tl.constexpr, DISCARD: tl.constexpr, GROUP_P2: tl.constexpr):
        """Slots lo .. hi - 1 of slot s, KV heads h0 .. h0 + HEADS - 1: the statistic (written per head with
        WRITE_STAT, or added into stat_ptr's running sum with WRITE_STAT == 2; summed over the heads) and (min,
        first index of the min) over head h0's evictable slots;
        (inf, 0) when none is evictable, as torch.argmin of all-inf. Loads bypass L1 (``.cg``): other programs
        wrote these rows."""
        offs_e = tl.arange(0, BLOCK_E)
        stop = tl.minimum(hi, capacity)
        len0 = capacity
        if HAS_LEN:
            len0 = tl.minimum(tl.load(len_ptr + s * num_kv_heads + h0).to(tl.int32), capacity)
            if not WRITE_STAT:  # nothing past head h0's live length is evictable
                stop = tl.minimum(stop, len0)
        cur = tl.load(cur_pos_ptr + s)
        run_min = tl.full([BLOCK_E], float("inf"), tl.float32)
        run_idx = tl.full([BLOCK_E], capacity, tl.int32)
        offs_r = tl.arange(0, GROUP_P2)  # the group's query heads as the rows of one [GROUP_P2, BLOCK_E] load
        r_mask = offs_r < GROUP
        for c0 in range(lo, stop, BLOCK_E):
            offs = c0 + offs_e
            in_range = offs < stop
            if ARGMIN:  # issued first: independent of the logits
                p = tl.load(pos_ptr + s * stride_ps + h0 * stride_ps_h + offs, mask=in_range & (offs < len0),
                            other=-1)
            score = tl.zeros([BLOCK_E], tl.float32)
            for hh in range(HEADS):
                h = h0 + hh
                live_end = capacity
                if HAS_LEN:
                    live_end = tl.minimum(tl.load(len_ptr + s * num_kv_heads + h).to(tl.int32), capacity)
                live = in_range & (offs < live_end)
                if VN_CACHED:
                    vn = tl.load(vn_ptr + s * stride_ns + h * stride_nh + offs, mask=live, other=0.0)
                m_safe, inv = _final_norm(part_ml_ptr, s, h, num_kv_heads, num_splits, GROUP_PAD, SPLITS_PAD,
                                          GROUP_P2)
                t_row = t_ptr + (s * num_kv_heads + h) * GROUP * capacity
                # stat_i = sum_g exp2(t_gi - M_g) / L_g: every query head's logits in one load (a load per head
                # was a chain of dependent round trips: the finishing pass's latency at batch 1)
                t = tl.load(t_row + offs_r[:, None] * capacity + offs[None, :], mask=r_mask[:, None] & live[None, :],
                            other=float("-inf"), cache_modifier=".cg")
                head_score = tl.sum(tl.exp2(t - m_safe[:, None]) * inv[:, None], 0)
                if VN_CACHED:  # ||alpha_i v_i||_1 = alpha_i ||v_i||_1 with the norm cached at write time
                    head_score *= vn
                if WRITE_STAT == 2:  # added into the caller's running sum (``stat_into``: Hard-KV's votes)
                    stat_row = stat_ptr + (s * num_kv_heads + h) * capacity + offs
                    tl.store(stat_row, tl.load(stat_row, mask=in_range, other=0.0) + head_score, mask=in_range)
                elif WRITE_STAT:
                    tl.store(stat_ptr + (s * num_kv_heads + h) * capacity + offs, head_score, mask=in_range)
                score += head_score
            if ARGMIN:
                run_min, run_idx = _argmin_step(score, p, offs, run_min, run_idx, sinks, cur, window)
        best = tl.min(run_min, 0)
        idx = tl.min(tl.where(run_min == best, run_idx, capacity), 0)
        if DISCARD:  # the logits are consumed: drop their L2 lines unwritten (the CTA-wide min needed them all)
            for hh in range(HEADS):
                _discard_logits(t_ptr + (s * num_kv_heads + h0 + hh) * GROUP * capacity, lo, tl.minimum(hi, capacity),
                                capacity, best, GROUP, BLOCK_E)
        return best, tl.where(idx == capacity, 0, idx)

    @triton.jit
    def _argmin_step(score, p, offs, run_min, run_idx, sinks, cur, window):
        """One chunk of the running argmin over the evictable slots (position ``p`` past the sinks, outside the
        window): (min, index) per lane; strict, so the earlier index wins ties, as torch.argmin."""
        evictable = (p >= sinks) & (p.to(tl.int64) <= cur - window)
        cand = tl.where(evictable, score, float("inf"))
        better = cand < run_min
        run_idx = tl.where(better, offs, run_idx)
        return tl.where(better, cand, run_min), run_idx

    @triton.jit
    def _discard_logits(t_row, lo, end, capacity, best, GROUP: tl.constexpr, BLOCK_E: tl.constexpr):
        """Drop the L2 lines of one KV head's logits, slots lo .. end - 1 of each query head, unwritten (``best``,
        the CTA-wide min, orders the drop after every read of them)."""
        offs_l = tl.arange(0, BLOCK_E // 32) * 32
        dep = tl.zeros([BLOCK_E // 32], tl.int32) + (best < 0).to(tl.int32)
        for g in tl.static_range(GROUP):
            for c0 in range(lo, end, BLOCK_E):
                _discard_l2(t_row + g * capacity + c0 + offs_l, dep, c0 + offs_l < end)

    @triton.jit
    def _finish_early(s, h, n_live, cur, m_reg, inv_reg, out_ptr, part_o_ptr, part_ml_ptr, t_ptr, vn_ptr, stat_ptr,
                      pos_ptr, evict_ptr, stride_os, stride_oh, stride_ps, stride_ph, stride_ns, stride_nh,
                      num_kv_heads, capacity, num_splits, sinks, window, GROUP: tl.constexpr,
                      GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                      BLOCK_E: tl.constexpr, MERGE_OUT: tl.constexpr, STAT: tl.constexpr, VN_CACHED: tl.constexpr,
                      WRITE_STAT: tl.constexpr, ARGMIN: tl.constexpr, DISCARD: tl.constexpr,
                      GROUP_P2: tl.constexpr, MERGE_SB: tl.constexpr, EVICT_WRITE: tl.constexpr,
                      MERGE_ONE: tl.constexpr, NORM_REGS: tl.constexpr):
        """``_finish`` of one KV head (``EARLY``) whose live slots ``n_live`` (min(length, capacity)) and ``cur``
        the program already holds: no length is loaded again, the one-pass merge's loads are issued before the
        statistic's, and each chunk's logits, positions and norms are asked for before the normalisers are formed
        (from the registers with ``NORM_REGS``: the row's only split), so that the finish waits on L2 about once
        where ``_finish`` waited three or four times. The same values as ``_finish``, bit for bit."""
        if MERGE_OUT:
            if MERGE_ONE:
                m, l_part, part, e_g, e_mask, m_offs = _merge_load(s, h, 0, part_o_ptr, part_ml_ptr, num_kv_heads,
                                                                   num_splits, GROUP, GROUP_PAD, HEAD_DIM,
                                                                   GROUP_P2 * HEAD_DIM, MERGE_SB)
            else:
                _merge_out(s, h, 0, out_ptr, part_o_ptr, part_ml_ptr, stride_os, stride_oh, num_kv_heads,
                           num_splits, GROUP, GROUP_PAD, HEAD_DIM, 1, GROUP_P2 * HEAD_DIM, MERGE_SB, False)
        if STAT != 0:
            offs_e = tl.arange(0, BLOCK_E)
            stop = capacity
            if not WRITE_STAT:  # nothing past the live length is evictable
                stop = tl.minimum(stop, n_live)
            run_min = tl.full([BLOCK_E], float("inf"), tl.float32)
            run_idx = tl.full([BLOCK_E], capacity, tl.int32)
            offs_r = tl.arange(0, GROUP_P2)
            r_mask = offs_r < GROUP
            t_row = t_ptr + (s * num_kv_heads + h) * GROUP * capacity
            for c0 in range(0, stop, BLOCK_E):
                offs = c0 + offs_e
                in_range = offs < stop
                live = in_range & (offs < n_live)
                t = tl.load(t_row + offs_r[:, None] * capacity + offs[None, :], mask=r_mask[:, None] & live[None, :],
                            other=float("-inf"), cache_modifier=".cg")
                if ARGMIN:
                    p = tl.load(pos_ptr + s * stride_ps + h * stride_ph + offs, mask=live, other=-1)
                if VN_CACHED:
                    vn = tl.load(vn_ptr + s * stride_ns + h * stride_nh + offs, mask=live, other=0.0)
                stat_row = stat_ptr + (s * num_kv_heads + h) * capacity + offs
                if WRITE_STAT == 2:
                    votes = tl.load(stat_row, mask=in_range, other=0.0)
                if NORM_REGS:
                    m_safe, inv = m_reg, inv_reg
                else:
                    m_safe, inv = _final_norm(part_ml_ptr, s, h, num_kv_heads, num_splits, GROUP_PAD, SPLITS_PAD,
                                              GROUP_P2)
                score = tl.sum(tl.exp2(t - m_safe[:, None]) * inv[:, None], 0)
                if VN_CACHED:
                    score *= vn
                if WRITE_STAT == 2:
                    tl.store(stat_row, votes + score, mask=in_range)
                elif WRITE_STAT:
                    tl.store(stat_row, score, mask=in_range)
                if ARGMIN:
                    run_min, run_idx = _argmin_step(score, p, offs, run_min, run_idx, sinks, cur, window)
            best = tl.min(run_min, 0)
            idx = tl.min(tl.where(run_min == best, run_idx, capacity), 0)
            if DISCARD:  # as _stat_argmin's
                _discard_logits(t_row, 0, capacity, capacity, best, GROUP, BLOCK_E)
            idx = tl.where(idx == capacity, 0, idx)
        if MERGE_OUT:
            if MERGE_ONE:
                _merge_store(s, h, m, l_part, part, e_g, e_mask, m_offs, out_ptr, stride_os, stride_oh, GROUP,
                             HEAD_DIM)
        if STAT != 0:
            if ARGMIN:
                if EVICT_WRITE:  # the cache's next write index: the live count below capacity, else the argmin
                    tl.store(evict_ptr + s * num_kv_heads + h, tl.where(n_live < capacity, n_live, idx).to(tl.int64))
                else:
                    tl.store(evict_ptr + s * num_kv_heads + h, idx.to(tl.int64))

    @triton.jit
    def _merge_load(s, h, e0, part_o_ptr, part_ml_ptr, num_kv_heads, num_splits, GROUP: tl.constexpr,
                    GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, E_BLOCK: tl.constexpr, MERGE_SB: tl.constexpr):
        """The one-pass merge's loads of elements e0 .. e0 + E_BLOCK - 1 of KV head h of slot s (every split's
        maxima, sums and outputs), issued now and reduced by ``_merge_store``."""
        offs_e = e0 + tl.arange(0, E_BLOCK)
        e_g = offs_e // HEAD_DIM
        e_mask = e_g < GROUP
        offs_b = tl.arange(0, MERGE_SB)
        po = part_o_ptr + (s * num_kv_heads + h) * num_splits * GROUP_PAD * HEAD_DIM
        ml = part_ml_ptr + (s * num_kv_heads + h) * num_splits * 2 * GROUP_PAD
        mask = (offs_b < num_splits)[:, None] & e_mask[None, :]
        m_ptrs = ml + offs_b[:, None] * 2 * GROUP_PAD + e_g[None, :]
        m = tl.load(m_ptrs, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_part = tl.load(m_ptrs + GROUP_PAD, mask=mask, other=0.0, cache_modifier=".cg")
        part = tl.load(po + offs_b[:, None] * GROUP_PAD * HEAD_DIM + offs_e[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
        return m, l_part, part, e_g, e_mask, offs_e

    @triton.jit
    def _merge_store(s, h, m, l_part, part, e_g, e_mask, offs_e, out_ptr, stride_os, stride_oh, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
        """``_merge_out``'s one pass on the loads of ``_merge_load``: the same arithmetic, the output stored."""
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.exp2(m - m_safe[None, :])
        _merge_write(s, h, tl.sum(part * w, 0), tl.sum(l_part * w, 0), e_g, e_mask, offs_e, out_ptr, stride_os,
                     stride_oh, GROUP, HEAD_DIM)

    @triton.jit
    def _merge_write(s, h, acc, total, e_g, e_mask, offs_e, out_ptr, stride_os, stride_oh, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr):
        """The merged output of KV head h of slot s: the splits' weighted outputs over their weighted sums, stored."""
        acc = acc * tl.where(total > 0, 1.0 / total, 0.0)
        tl.store(out_ptr + s * stride_os + (h * GROUP + e_g) * stride_oh + offs_e % HEAD_DIM,
                 acc.to(out_ptr.dtype.element_ty), mask=e_mask)

    @triton.jit
    def _final_norm(part_ml_ptr, s, h, num_kv_heads, num_splits, GROUP_PAD: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, ROWS: tl.constexpr):
        """Merged (max, 1/sum) over the splits of the first ROWS (<= GROUP_PAD) query heads of (s, h)."""
        offs_sp = tl.arange(0, SPLITS_PAD)
        offs_g = tl.arange(0, ROWS)
        base = part_ml_ptr + (s * num_kv_heads + h) * num_splits * 2 * GROUP_PAD
        ptrs = base + offs_sp[:, None] * 2 * GROUP_PAD + offs_g[None, :]
        sp_mask = (offs_sp < num_splits)[:, None]
        m = tl.load(ptrs, mask=sp_mask, other=float("-inf"), cache_modifier=".cg")
        l_part = tl.load(ptrs + GROUP_PAD, mask=sp_mask, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 0)
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        total = tl.sum(l_part * tl.exp2(m - m_safe[None, :]), 0)
        return m_safe, tl.where(total > 0, 1.0 / total, 0.0)


_ARRIVALS: dict = {}
_OUTGROWN: list = []  # counters replaced by larger ones stay allocated: captured CUDA graphs may point at them


def _arrival_counters(device, n: int) -> torch.Tensor:
    """Per-row int32 arrival counters (``finish="last"``, chunked merge): zeroed once, reset by the kernel after
    each use."""
    buf = _ARRIVALS.get(str(device))
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _ARRIVALS[str(device)] = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
    return buf


def decode_attention(q, k_cache, v_cache, pos, cur_pos, scale, stat=None, argmin=False, sinks=0, window=1,
                     layer_shared=False, length=None, return_stat=True, vnorm=None, dense=False, finish=None,
                     num_splits=None, block_n=None, block_stat=None, num_warps=None, num_stages=None,
                     vnorm_dot=True, finish_chunk=None, cache_hints=None, logit_store=None, logit_discard=None,
                     write_idx=None, pdl=None, stat_into=None, chain_pdl=False):
    """Fused decode attention (+ statistic, + its masked argmin) for one layer; see the module docstring.

    ``vnorm`` [S, Hkv, C] fp32 (``stat="contrib"`` only): cached ||v_i||_1 of every slot, used instead of
    reducing |V| in the hot loop; it must equal ``v_cache.float().abs().sum(-1)`` on the live slots.
    ``dense``: the caller promises pos >= 0 on every slot below ``length`` (below capacity without it), so the
    attention pass reads no positions (the argmin still reads them for sinks and the window).
    ``finish``: who turns the logits into the statistic and argmin (and merges the splits): "merge" a second
    kernel; "epilogue" the program itself when one split owns the row (else as "merge"); "last" the last
    program to arrive at each row (or, ``layer_shared``, at each slot), through self-resetting arrival counters
    (one launch on one stream at a time); None: "last" with a statistic, "merge" for attention alone.
    ``finish_chunk``: tokens per program of the merge kernel (None: the whole row, one program per row; smaller
    chunks run in parallel, the last to arrive at a row reduces their partial argmins). ``cache_hints``: K/V
    tiles are loaded ``evict_first`` and the logits stored ``evict_last``, so that the finishing pass finds them
    in L2 (None: on with a statistic). ``logit_store``: "early" stores each tile's logits right after q.K (norms
    cached or no statistic), "late" after the tile's softmax update, "asm" as "early" through inline PTX stores
    from the dot's register layout (``tl.store`` converts the tile's layout through shared memory first; NVIDIA
    GPUs only: elsewhere "early"). ``logit_discard``: the finishing pass drops the logits' L2 lines once read
    (PTX discard.global.L2), so that they are never written back to memory (NVIDIA GPUs, capacity a multiple of
    32; elsewhere ignored). None for either: "asm" with the discard where ``stat_two_stages`` takes the call
    (with ``num_stages`` None too), else ``logit_defaults`` ("asm" and no discard for fewer (slot, head) rows
    than SMs with 2+ query heads per KV head on an NVIDIA GPU, else "late" with discard); the rules named here are
    in ``decode_launch``. ``vnorm_dot`` computes
    an uncached ||v_i||_1 on the tensor cores. ``block_stat``: tokens per step of the finishing pass (None: about
    8k logits per step, at most 4096 tokens).
    ``pdl``: the merge kernel is launched as a programmatic dependent launch (Hopper and later, NVIDIA): its
    programs start while the split kernel runs and wait for its end in the kernel (``griddepcontrol.wait``),
    hiding the second launch's latency (None: on where the GPU and Triton support it; elsewhere off).
    ``num_splits`` None: ``default_splits``; ``num_warps`` / ``num_stages`` None: ``launch_config``'s (2 stages
    where ``stat_two_stages`` takes the call).
    ``write_idx`` [S, Hkv] int64 (with ``argmin`` and ``length``): the cache's next write index, set in the
    kernel to ``where(length < capacity, length, evict)`` (per head; the layer's one argmin for every head with
    ``layer_shared``) in place of returning ``evict``.
    ``chain_pdl``: the split kernel is a programmatic dependent launch itself, in the decode layer's chain of them
    (``kvroll.kernels.pdl_gemm``): it waits for the previous kernel first and lets the next one launch at once,
    but in the long tail (``long_tail``), whose splits are sized to run in one wave (its merge kernel, a PDL
    launch of its own, still may): there the next kernel's programs, launched early, would take SMs from it
    (LongFlow's step at batches 16 and 32 took 4.0% and 5.8% longer, session 24's c7). NVIDIA GPUs that take PDL;
    elsewhere ignored.
    All but ``vnorm``, ``dense`` and ``write_idx`` are tuning switches that leave results unchanged (timed in the
    benchmark).

    ``stat_into`` [S, Hkv, C] fp32, contiguous: the statistic is added into it in the finishing pass (a running
    sum, Hard-KV's votes: ``stat_into += stat`` without a kernel of its own) and not returned.

    Returns (out [S, Hq, D] in q's dtype, stat [S, Hkv, C] fp32 or None (None with ``stat_into``), evict [S, Hkv]
    / [S, 1] int64 or None; None with ``write_idx``).
    """
    assert triton is not None, "decode_attention needs Triton; use decode_attention_ref on CPU"
    assert stat in STATS, stat
    assert not argmin or stat is not None, "the argmin is taken over a statistic: pass stat='contrib'|'mass'"
    code = _STAT_CODE[stat]
    slots, num_q_heads, head_dim = q.shape
    _, num_kv_heads, capacity, _ = k_cache.shape
    given_block_n = block_n
    block_n = block_n or (64 if head_dim <= 128 else 32)
    few_rows = slots * num_kv_heads < launch.sm_count(q.device)  # fewer (slot, head) rows than SMs
    group = num_q_heads // num_kv_heads
    nvidia = q.is_cuda and torch.version.hip is None and not _INTERPRET
    vnorm_code = 0 if stat != "contrib" else 3 if vnorm is not None else 1 if vnorm_dot else 2
    if code and nvidia and num_stages is None and logit_store is None \
            and launch.stat_two_stages(slots * num_kv_heads, head_dim, capacity, group, q.device, q.element_size(),
                                given_block_n, early_store=vnorm_code in (0, 3)):
        num_stages, logit_store = 2, "asm"  # the early store from the dot's registers, 3 programs per SM
    if num_warps is None or num_stages is None:
        warps, stages = launch.launch_config(slots * num_kv_heads, head_dim, bool(code), q.device,
                                      q.element_size(), given_block_n)
        num_warps, num_stages = num_warps or warps, num_stages or stages
    tail = launch.long_tail(slots, num_kv_heads, capacity, block_n, q.device, stat=bool(code))
    if tail and not given_block_n:
        block_n = launch.tail_block_n(head_dim, capacity, q.dtype, q.device, num_stages) or block_n
    short = launch.short_tail(slots * num_kv_heads, num_q_heads // num_kv_heads, capacity) \
        if code and tail and finish is None else None
    if short is not None:  # short rows: the last program to arrive finishes, no second kernel
        finish, num_splits = "last", num_splits or short
    elif code and finish is None and tail:  # the merge kernel finishes the rows in parallel chunks
        finish, finish_chunk = "merge", 1024 if finish_chunk is None else finish_chunk
    finish = finish or ("last" if code else "merge")  # attention alone: session 4's measured configuration
    cache_hints = bool(code) if cache_hints is None else cache_hints
    assert finish in ("merge", "epilogue", "last"), finish
    assert finish_chunk is None or (isinstance(finish_chunk, int) and finish_chunk > 0), \
        f"finish_chunk={finish_chunk!r}: use None (one program per row) or a positive number of tokens"
    logit_store, logit_discard = launch.logit_defaults(few_rows, group, nvidia, logit_store, logit_discard)
    assert logit_store in ("early", "late", "asm"), f"logit_store={logit_store!r}: use 'late', 'early' or 'asm'"
    assert k_cache.shape == v_cache.shape == (slots, num_kv_heads, capacity, head_dim), (k_cache.shape, q.shape)
    assert num_q_heads == group * num_kv_heads, "Hq must be a multiple of Hkv"
    assert head_dim in (16, 32, 64, 128, 256), f"head_dim {head_dim} must be a power of two in [16, 256]"
    assert q.dtype == k_cache.dtype == v_cache.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    assert q.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1, "the head dim must be contiguous"
    assert pos.shape == (slots, num_kv_heads, capacity) and pos.dtype == torch.int32 and pos.stride(-1) == 1
    assert cur_pos.shape == (slots,) and cur_pos.dtype == torch.int64 and cur_pos.is_contiguous()
    assert slots < 65536, f"slots={slots}: at most 65535 per call (a grid dimension); split the batch"
    if length is not None:
        assert length.shape == (slots, num_kv_heads) and length.is_contiguous(), length.shape
    if write_idx is not None:
        assert argmin and length is not None, "write_idx is set from the argmin and the live length: pass both"
        assert write_idx.shape == (slots, num_kv_heads) and write_idx.dtype == torch.int64 \
            and write_idx.is_contiguous(), (write_idx.shape, write_idx.dtype)
    if vnorm is not None:
        assert stat == "contrib", "vnorm (cached ||v||_1) only enters the 'contrib' statistic"
        assert vnorm.shape == pos.shape and vnorm.dtype == torch.float32 and vnorm.stride(-1) == 1, vnorm.shape
    splits = num_splits or launch.default_splits(slots, num_kv_heads, capacity, block_n, q.device, stat=bool(code),
                                          tail=tail, head_dim=head_dim, elem_size=q.element_size(),
                                          num_stages=num_stages, group=group)
    chunk = -(-(-(-capacity // splits)) // block_n) * block_n  # ceil(capacity / splits), rounded up to block_n
    splits = -(-capacity // chunk)
    group_pad, dev, f32 = max(16, launch.pow2(group)), q.device, torch.float32
    out = torch.empty_like(q)
    part_o = torch.empty((slots, num_kv_heads, splits, group_pad, head_dim), dtype=f32, device=dev) \
        if splits > 1 else out
    part_ml = torch.empty((slots, num_kv_heads, splits, 2, group_pad), dtype=f32, device=dev) \
        if splits > 1 or code else out
    t = torch.empty((slots, num_kv_heads, group, capacity), dtype=f32, device=dev) if code else out
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    len_arg = length if length is not None else pos
    vn_arg = vnorm if vnorm is not None else pos
    write_stat = bool(code) and return_stat
    heads = num_kv_heads if layer_shared else 1
    if stat_into is not None:
        assert code and return_stat, "stat_into: a statistic to add (stat='contrib'|'mass', return_stat=True)"
        assert stat_into.shape == (slots, num_kv_heads, capacity) and stat_into.dtype == f32 \
            and stat_into.is_contiguous(), (stat_into.shape, stat_into.dtype)
        stat_out, write_stat = stat_into, 2
    else:
        stat_out = torch.empty((slots, num_kv_heads, capacity), dtype=f32, device=dev) if write_stat else out
    evict = write_idx if write_idx is not None else \
        torch.empty((slots, num_kv_heads // heads), dtype=torch.int64, device=dev) if argmin else out
    finish_code = 0  # 0: merge kernel, 1: in-program epilogue (one split, one head), 2: last arrival finishes
    if splits > 1 or code:
        if finish in ("epilogue", "last") and splits == 1 and heads == 1:
            finish_code = 1
        elif finish == "last":
            finish_code = 2
    block_stat = block_stat or min(4096, max(256, 8192 // launch.pow2(group)))  # ~8k logits per step of the finish
    block_e = min(block_stat, max(16, launch.pow2(capacity)))
    chunk_e = capacity if not finish_chunk else -(-min(finish_chunk, capacity) // block_e) * block_e
    n_chunks = -(-capacity // chunk_e) if code and finish_code == 0 else 1
    flat = launch.pow2(group) * head_dim  # a head's (query head, dim) elements, padded
    merge_e = flat
    if splits > 1 and finish_code == 0 and few_rows:  # the merge in slices of >= 64 elements: ~a program per SM
        merge_e = max(min(64, flat), flat // launch.pow2(-(-launch.sm_count(dev) // (slots * num_kv_heads // heads))))
    n_stat = 0  # launch.MERGE_APART: the statistic's chunks first, then programs that only merge
    if code and splits > 1 and finish_code == 0 and launch.merge_apart(slots * num_kv_heads, group, capacity):
        n_stat, n_chunks = n_chunks, n_chunks + flat // merge_e
    else:
        n_chunks = max(n_chunks, flat // merge_e)  # programs past the last token only merge (or past the slices, score)
    arrivals = n_stat or n_chunks  # the programs that reduce the partial argmins
    chunks_pad = launch.pow2(arrivals) if arrivals > 1 else 1
    locks = _arrival_counters(dev, slots * num_kv_heads) if finish_code == 2 or n_chunks > 1 else out
    part_ev = torch.empty((slots * num_kv_heads // heads, 2 * chunks_pad), dtype=f32, device=dev) \
        if n_chunks > 1 and argmin else out
    merge = (splits > 1 or code) and finish_code == 0  # a second kernel merges the splits / finishes the rows
    pdl = launch.pdl_ok(dev) if pdl is None else bool(pdl) and launch.pdl_ok(dev)
    chain = bool(chain_pdl) and launch.pdl_ok(dev)
    discard = bool(logit_discard) and nvidia and code != 0 and capacity % 32 == 0 and block_e >= 32 \
        and chunk_e % 32 == 0  # whole 128-byte lines of one row and chunk
    common = dict(GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, SPLITS_PAD=max(2, launch.pow2(splits)),
                  HEADS=heads, BLOCK_E=block_e, STAT=code, WRITE_STAT=write_stat, ARGMIN=bool(argmin),
                  HAS_LEN=length is not None, DISCARD=discard, GROUP_P2=launch.pow2(group),
                  MERGE_SB=launch.merge_sb(splits, flat), EVICT_WRITE=write_idx is not None)
    _decode_split_kernel[(splits, num_kv_heads, slots)](
        q, k_cache, v_cache, pos, len_arg, vn_arg, out, part_o, part_ml, t, stat_out, cur_pos, evict, locks,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], pos.stride(0), pos.stride(1),
        vn_arg.stride(0), vn_arg.stride(1), out.stride(0), out.stride(1), num_kv_heads, capacity, chunk, splits,
        scale * _LOG2E, sinks, window, BLOCK_N=block_n, VNORM=vnorm_code, DENSE=bool(dense), SPLIT=splits > 1,
        DOT_PREC=dot_prec, FINISH=finish_code, KV_EVICT="evict_first" if cache_hints else "",
        T_EVICT="evict_last" if cache_hints else "", T_EARLY=logit_store != "late" and vnorm_code in (0, 3),
        T_ASM=(2 if cache_hints else 1) if logit_store == "asm" and nvidia else 0,
        num_warps=num_warps, num_stages=num_stages, PDL=(pdl and merge) or (chain and not tail), PDL_WAIT=chain,
        MERGE_ONE=finish_code != 0 and launch.merge_one_pass(splits, common["MERGE_SB"], flat, few_rows),
        EARLY=launch.FINISH_EARLY and finish_code != 0, **common,
        **({"launch_pdl": True} if chain else {}),
    )
    if merge:
        _decode_merge_kernel[(slots, num_kv_heads // heads, n_chunks)](
            out, part_o, part_ml, t, vn_arg, stat_out, pos, len_arg, cur_pos, evict, part_ev, locks,
            out.stride(0), out.stride(1), pos.stride(0), pos.stride(1), vn_arg.stride(0), vn_arg.stride(1),
            num_kv_heads, capacity, splits, sinks, window, chunk_e, MERGE_OUT=splits > 1,
            VN_CACHED=vnorm is not None, CHUNKS_PAD=chunks_pad, num_warps=launch.MERGE_WARPS, MERGE_E=merge_e,
            N_STAT=n_stat,
            MERGE_ONE=launch.merge_one_pass(splits, launch.merge_sb(splits, merge_e), flat, few_rows),
            **{**common, "MERGE_SB": launch.merge_sb(splits, merge_e)},
            **({"PDL": True, "launch_pdl": True} if pdl else {}),
        )
    return out, (stat_out if write_stat == 1 else None), (evict if argmin and write_idx is None else None)
