"""Sampling in two kernels: the draw, the sampled token's logprob and the finite check of a decode step's logits.

The engine's sampler (``kvroll/rollout/sampling.py``) without processors (no top-k / top-p / min-p, no repetition
penalty: TRL's GRPO default) runs ~12 kernels over the [batch, vocab] logits per step: the fp32 copy, the division
by the temperature, softmax, the exponential noise, the division by it, argmax, log_softmax, gather and the finite
check, each a pass over batch x vocab fp32 values. Here one kernel reads the logits once in their own dtype, in
vocabulary chunks spread over the GPU, keeping per lane of a chunk the running max and sum of exp (online softmax),
the best Gumbel score and its index, and whether every logit was finite (the lanes are reduced once, at the chunk's
end); a second kernel merges the chunks of each row:

    tokens, logprobs, finite = fused_sample(logits, None, temperature, rng=state)  # drawn in the kernels (below)
    tokens, logprobs, finite = fused_sample(logits, noise, temperature)  # the noise given [rows, vocab] fp32
    tokens, logprobs, finite = fused_sample(logits, None, 1.0)           # greedy
    ref = fused_sample_ref(logits, noise, temperature)                   # fp64 torch (the tests' oracle)
    tokens, logprobs, finite = head_sample(hidden, head_weight, temperature, rng=state)  # the head's matmul too

``head_sample`` (session 21) takes the model's output head into the first kernel: each program multiplies a
[rows, 64-128] tile of the head's weight with the final hidden states on the tensor cores (fp32 products for an
fp32 model), rounds the tile of logits to the model's dtype as the head's matmul would, and reduces it at once into
its part (max, sum of exp, best score, that entry's z and index, finite); the [rows, vocab] logits are never
written. The merge kernel is the same. The engine's step takes it for a half-precision Llama / Qwen2 / Qwen3 /
Mistral head (``graphs.plain_head``) at up to ``HEAD_MAX_ROWS`` = 64 rows, where an H100 measured it faster than
cuBLAS's head and ``fused_sample`` (above that the tiles' epilogues no longer hide under the weight's stream;
``head_config``, which also gives way where the tiles do not fit the device's shared memory; on an H200 up to 32 rows
in 128-wide tiles, session 42). On tiles of 64
entries or fewer its noise is ``exp_noise``'s entry for entry, so it draws what ``fused_sample``'s Gumbel arm
(``INVERSE_CDF = False``) draws on the same logits. On wider tiles (``tile_draw``: 128 at the rule's 33-48 rows;
session 38) it draws per tile instead (``TILE_DRAW``): in each tile one entry by the inverse CDF of the tile's
softmax at a uniform u, and the tile's score its log-sum-exp plus Gumbel noise (-log(-log v)); the merge's best
score then picks a tile with probability proportional to its mass, so the token is drawn exactly from softmax(z)
up to the uniforms' 23 bits and the tile's fp32 cumulative sum (an entry with less than 2^-24 of its tile's mass
is never drawn; the Gumbel arm never draws one ~19.4 nats below the row's top entry), with two uniforms per (row,
tile) (``tile_uniforms``) instead of a Philox draw and two logs per entry.
``head_tile_draw_ref`` is its fp64 reference at those uniforms.

The draw from ``rng`` (session 34; ``INVERSE_CDF``, on): the inverse CDF at one uniform per row, not Gumbel-max.
The first kernel (``_mass_kernel``) keeps no noise: per ``ICDF_PART`` (1,024) entries of a row it stores their max
and sum of exp(z - max), and program (row, 0) draws the row's uniform u (``_row_uniform``: Philox4x32-10 from the
same [seed, step] state, 52 bits, fp64, exactly inside (0, 1)). The second (``_pick_kernel``, one program per row)
adds the parts up in fp64, takes the first part whose cumulative mass passes u * total, reads that part's logits
again and takes the first entry whose cumulative mass passes the rest; logprob = z - logsumexp(z) as below. Both
are exact samplers of softmax(z); in fp32 the parts' sums move the CDF's edges by about 1e-7 of the total, so the
draw equals the fp64 inverse CDF at that u (``row_uniforms``, ``inverse_cdf_ref``: the tests' bridge) except on the
rare rows whose u falls that close to an edge. An entry of probability 0 (underflowed) is never drawn (the clamps).
The Gumbel arm's Philox draw per entry and its two logs made its kernel ALU-bound: on an H100, 139 us at 256 rows of
151,936 bf16 logits against the inverse CDF's 46 us (the logits' floor 26 us; ``benchmarks/sample_icdf_ab.py``).
``head_sample`` (batches <= 64, where its epilogue hides under the head's weight stream) keeps Gumbel-max (or the
tile draw on its 128-wide tiles), so the engine's draws at up to 64 rows are those where it takes ``head_sample``
(``graphs.plain_head``), above it, and at every batch size for other heads (fp32 on CUDA, other architectures), the
inverse CDF's: one distribution, three draws.

The Gumbel arm's noise (``INVERSE_CDF = False``, and ``head_sample``): the engine's step (``graphs.DecodeRunner``)
draws it inside the kernel with Philox4x32-10 (Triton's ``tl.philox``, the generator of cuRAND and torch's CUDA
RNG) from a device state [seed, step] (``new_rng_state``:
the seed drawn from the engine's generator at each ``generate``, so a seeded call is reproducible; the merge kernel
advances the step, so CUDA-graph replays draw anew). That writes and reads no [rows, vocab] fp32 noise tensor (156
MB per step at 256 rows of a 151,936-entry vocabulary), and ``exp_noise`` returns exactly the noise a call draws,
so ``fused_sample(logits, exp_noise(rows, vocab, state), T)`` is that call's draw token for token: the tests check
the in-kernel path through the same fp64 reference as the given-noise one. It is the torch sampler's distribution,
not its draws (sessions 11-18 drew the noise with torch's ``exponential_`` and matched them): ``fused_sampling=False``
gives torch's draws.

Draw: ``sample`` takes argmax(softmax(z) / E) with z = logits / T and E ~ Exponential(1); this takes
argmax(z - log E), the same token (softmax's normaliser is one constant per row), up to rounding: the two can pick
different tokens only where two candidates' scores agree to fp32 rounding. On an NVIDIA GPU that log E is the SFU's
``lg2.approx`` (absolute error ~2^-22 near E = 1, ~2^-22 relative elsewhere: about the score's own fp32 rounding
where |score| >= 1, so it can only reorder near-ties), the noise's log (E = -log u) the accurate one; at T = 1 z is
the logits, with no division. Greedy: argmax(logits). Ties resolve to
the lowest index, as ``torch.argmax``. Logprob: log_softmax(z)[token] = z[token] - logsumexp(z), as ``sample``.
A row with a NaN or an infinite logit is reported in ``finite`` (its token and logprob are then meaningless), as
the engine's ``isfinite(logits).all(-1)``.
"""
from __future__ import annotations

import os

import torch

from kvroll.kernels.decode_launch import block_shared_memory

try:  # Triton is optional on CPU-only installs; the torch sampler is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCK = 1024  # vocabulary entries per load
CHUNKS_PER_SM = 16  # chunk programs per SM over the whole batch (at least one chunk of BLOCK per program)
MAX_CHUNKS = 256  # chunks of one row (the merge kernel reads them in one block)
INVERSE_CDF = True  # the in-kernel draw as the inverse CDF at one uniform per row (else Gumbel-max, Philox per entry)
TILE_DRAW = True  # head_sample's draw per vocabulary tile (one entry by its inverse CDF, Gumbel-max over the tiles)
TILE_DRAW_MIN_BN = 128  # ... where its tiles are at least this wide (``tile_draw``; session 38's H100 A/B)
ICDF_PART, ICDF_UNROLL, ICDF_WARPS, ICDF_CHUNKS_PER_SM = 1024, 1, 2, 48  # the mass kernel (H100 sweep, session 34)


def fused_sample_ref(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float):
    """The kernel's math in fp64 torch: (tokens int64, logprobs fp32, finite bool), each [rows]."""
    x = logits.double()
    z = x / (temperature if noise is not None else 1.0)
    score = z if noise is None else z - noise.double().log()
    tokens = score.argmax(dim=-1)
    logprobs = (z.gather(-1, tokens[:, None])[:, 0] - z.logsumexp(dim=-1)).float()
    return tokens, logprobs, torch.isfinite(x).all(dim=-1)


if triton is not None:

    @triton.jit
    def _uniform(r):
        """u in [2^-24, 1 - 2^-24] from 32 random bits, exactly: the top 23 bits x give x * 2^-23 + 2^-24 (no
        rounding in fp32, so never 0 nor 1: a u of 1 would make E = 0 and that entry's score +inf)."""
        return (r >> 9).to(tl.float32) * (1.0 / 8388608.0) + (1.0 / 16777216.0)

    @triton.jit
    def _log_of_noise(e, FAST: tl.constexpr):
        """log(E) for the score: on a GPU through ``lg2.approx.f32`` (the SFU's log2, absolute error ~2^-22 near 1,
        relative elsewhere: about the score's own fp32 rounding; E >= ~6e-8 is never subnormal, so never -inf),
        under the interpreter NumPy's exact log. The noise itself (``_exp_noise``) keeps the accurate log: a u near
        1 needs it to give an E > 0."""
        if FAST:
            lg2 = tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [e], dtype=tl.float32, is_pure=True,
                                            pack=1)
            return lg2 * 0.6931471805599453
        else:
            return tl.log(e)

    @triton.jit
    def _exp_noise(rng_ptr, row, col0, vocab_blocks, BLOCK: tl.constexpr):
        """E ~ Exponential(1) for the BLOCK entries of ``row`` from column ``col0`` (a multiple of BLOCK) at the
        step in ``rng_ptr`` [seed, step]: Philox4x32-10 (``tl.philox``) keyed by the seed, one 32-bit counter per
        four entries, row * vocab_blocks * BLOCK / 4 + col0 / 4 + i, the step in the second counter word; each
        output gives u = ``_uniform`` and E = -log(u)."""
        seed = tl.load(rng_ptr)
        step = tl.load(rng_ptr + 1).to(tl.uint32)
        quarter: tl.constexpr = BLOCK // 4
        counter = ((row * vocab_blocks + col0 // BLOCK) * quarter + tl.arange(0, quarter)).to(tl.uint32)
        zero = counter * 0
        r0, r1, r2, r3 = tl.philox(seed, counter, zero + step, zero, zero)
        r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
        return -tl.log(_uniform(r))

    @triton.jit
    def _noise_kernel(rng_ptr, out_ptr, stride_o, vocab, vocab_blocks, BLOCK: tl.constexpr):
        """The noise ``_chunk_kernel`` draws with NOISE == 2, written out (``exp_noise``: the tests' bridge)."""
        row = tl.program_id(0).to(tl.int64)
        col0 = tl.program_id(1) * BLOCK
        idx = col0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * stride_o + idx, _exp_noise(rng_ptr, row, col0, vocab_blocks, BLOCK),
                 mask=idx < vocab)

    @triton.jit
    def _chunk_kernel(logits_ptr, noise_ptr, rng_ptr, part_f_ptr, part_i_ptr, stride_l, stride_n, vocab, chunks,
                      chunk_size, vocab_blocks, temp, BLOCK: tl.constexpr, NOISE: tl.constexpr,
                      UNIT_T: tl.constexpr, FAST_LOG: tl.constexpr):
        # NOISE: 0 greedy, 1 the noise tensor, 2 drawn here (``_exp_noise``). Each lane keeps its own running max,
        # sum of exp, best score and its index over the chunk's blocks; the lanes are reduced once, at the end.
        # UNIT_T: T = 1, so z = x with no division (x / 1 is x). FAST_LOG: ``_log_of_noise`` on the SFU.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        neg_inf = float("-inf")
        m_vec = tl.full([BLOCK], neg_inf, tl.float32)
        s_vec = tl.zeros([BLOCK], tl.float32)
        best_vec = tl.full([BLOCK], neg_inf, tl.float32)
        idx_vec = tl.zeros([BLOCK], tl.int32)
        bad_vec = tl.zeros([BLOCK], tl.int32)
        for start in range(0, chunk_size, BLOCK):  # a runtime loop: one compiled kernel for every batch size
            col0 = chunk * chunk_size + start
            idx = col0 + tl.arange(0, BLOCK)
            mask = idx < vocab
            x = tl.load(logits_ptr + row * stride_l + idx, mask=mask, other=0.0).to(tl.float32)
            bad_vec = tl.maximum(bad_vec, tl.where(mask & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0))
            if NOISE == 0 or UNIT_T:  # greedy or T = 1: z = x
                z = tl.where(mask, x, neg_inf)
            else:
                z = tl.where(mask, x / temp, neg_inf)  # divided, as torch's sampler: the same fp32 z
            # one exp per entry: the larger of (lane max, z) is the new max, the other scales by exp(-|gap|)
            e_gap = tl.exp(-tl.abs(tl.where(z == neg_inf, 0.0, m_vec - z)))  # (a masked entry leaves s as is)
            s_vec = tl.where(z == neg_inf, s_vec, tl.where(z > m_vec, s_vec * e_gap + 1.0, s_vec + e_gap))
            m_vec = tl.maximum(m_vec, z)
            if NOISE == 0:
                score = z
            else:
                if NOISE == 1:
                    e = tl.load(noise_ptr + row * stride_n + idx, mask=mask, other=1.0)
                else:
                    e = _exp_noise(rng_ptr, row, col0, vocab_blocks, BLOCK)
                score = tl.where(mask, z - _log_of_noise(e, FAST_LOG), neg_inf)
            take = score > best_vec  # strictly: a lane's earlier block keeps a tie
            idx_vec = tl.where(take, idx, idx_vec)
            best_vec = tl.where(take, score, best_vec)
        run_max = tl.max(m_vec, axis=0)
        top = tl.where(run_max == neg_inf, 0.0, run_max)
        run_sum = tl.sum(s_vec * tl.exp(m_vec - top), axis=0)
        best = tl.max(best_vec, axis=0)
        best_idx = tl.min(tl.where(best_vec == best, idx_vec, 2147483647), axis=0)  # the first maximum
        at = row * chunks + chunk
        tl.store(part_f_ptr + at * 3 + 0, run_max)
        tl.store(part_f_ptr + at * 3 + 1, run_sum)
        tl.store(part_f_ptr + at * 3 + 2, best)
        tl.store(part_i_ptr + at * 2 + 0, best_idx)
        tl.store(part_i_ptr + at * 2 + 1, tl.max(bad_vec, axis=0))

    @triton.jit
    def _exp_noise_tile(rng_ptr, rows, col0, vocab_blocks, BM: tl.constexpr, BN: tl.constexpr, BLOCK: tl.constexpr):
        """``_exp_noise``'s E for the [len(rows), BN] tile of ``rows`` (int64 [BM]) from column ``col0`` (BN divides
        BLOCK and col0 is a multiple of BN, so the tile lies in one BLOCK): the same counters and the same order of
        Philox's four outputs, so entry (row, column) draws the same E in both."""
        seed = tl.load(rng_ptr)
        step = tl.load(rng_ptr + 1).to(tl.uint32)
        quarter: tl.constexpr = BLOCK // 4
        first = (col0 % BLOCK) // 4
        counter = ((rows[:, None] * vocab_blocks + col0 // BLOCK) * quarter + first
                   + tl.arange(0, BN // 4)[None, :]).to(tl.uint32)
        zero = counter * 0
        r0, r1, r2, r3 = tl.philox(seed, counter, zero + step, zero, zero)
        r = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BM, BN])
        return -tl.log(_uniform(r))

    @triton.jit
    def _tile_uniforms(rng_ptr, rows, tile):
        """(u, v) in (0, 1) for each of ``rows`` (int64 [BM]) in vocabulary tile ``tile`` at the state's step:
        Philox4x32-10 keyed by the seed, counter (row, step, 2, tile) (the Gumbel arm's counters hold 0 in their
        third word, the inverse CDF's 1), its first two words as ``_uniform``s. ``_head_kernel``'s tile draw: u picks
        the entry inside the tile, v gives the tile's Gumbel noise."""
        seed = tl.load(rng_ptr)
        step = tl.load(rng_ptr + 1).to(tl.uint32)
        c0 = rows.to(tl.uint32)
        zero = c0 * 0
        r0, r1, r2, r3 = tl.philox(seed, c0, zero + step, zero + 2, zero + tile.to(tl.uint32))
        return _uniform(r0), _uniform(r1)

    @triton.jit
    def _tile_uniform_kernel(rng_ptr, out_ptr, n_rows, tiles, BM: tl.constexpr):
        """``_tile_uniforms`` written out [rows, tiles, 2] (``tile_uniforms``: the tests' bridge)."""
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        tile = tl.program_id(1)
        u, v = _tile_uniforms(rng_ptr, rows.to(tl.int64), tile)
        at = (rows.to(tl.int64) * tiles + tile) * 2
        tl.store(out_ptr + at, u, mask=rows < n_rows)
        tl.store(out_ptr + at + 1, v, mask=rows < n_rows)

    @triton.jit
    def _head_kernel(h_ptr, w_ptr, rng_ptr, part_f_ptr, part_i_ptr, n_rows, vocab, hidden, stride_h, stride_w,
                     tiles, vocab_blocks, temp, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     EVEN_K: tl.constexpr, ROUND: tl.constexpr, NOISE: tl.constexpr, UNIT_T: tl.constexpr,
                     FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
        # One [BM rows, BN vocabulary entries] tile of logits = hidden @ weight^T, accumulated in fp32 and rounded to
        # the model's dtype (ROUND: 0 none, 1 bf16, 2 fp16: the logits the model's own head would give), then the
        # tile's part for ``_merge_kernel`` (PART_Z): per row its max and sum of exp(z - max), its best score, that
        # entry's z and index, and whether every logit was finite. The row blocks of one tile are adjacent
        # programs, so the weight tile is read from HBM once. NOISE: 0 greedy, 2 Gumbel noise per entry drawn here
        # (``_exp_noise_tile``), 3 the tile draw (``TILE_DRAW``): per row one entry of the tile drawn from the tile's
        # softmax by its inverse CDF at u, and the tile's score its log-sum-exp plus Gumbel noise from v
        # (``_tile_uniforms``), so the merge's best score picks a tile with probability proportional to its mass.
        block = tl.program_id(0)
        tile = tl.program_id(1)
        neg_inf = float("-inf")
        rows = block * BM + tl.arange(0, BM)
        cols = tile * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        # out-of-range rows and columns load the last ones (no masks in the loop); their results are dropped
        a_ptrs = h_ptr + tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None] * stride_h + ks[None, :]
        b_ptrs = w_ptr + tl.minimum(cols, vocab - 1).to(tl.int64)[None, :] * stride_w + ks[:, None]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k in range(0, tl.cdiv(hidden, BK)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                a = tl.load(a_ptrs, mask=ks[None, :] < hidden - k * BK, other=0.0)
                b = tl.load(b_ptrs, mask=ks[:, None] < hidden - k * BK, other=0.0)
            if ROUND == 0:  # fp32: the product in fp32, as torch's matmul (Triton's default would be TF32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK
        if ROUND == 1:
            x = acc.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            x = acc.to(tl.float16).to(tl.float32)
        else:
            x = acc
        valid = (cols < vocab)[None, :]
        bad = tl.max(tl.where(valid & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0), axis=1)
        if NOISE == 0 or UNIT_T:
            z = tl.where(valid, x, neg_inf)
        else:
            z = tl.where(valid, x / temp, neg_inf)
        m = tl.max(z, axis=1)
        p = tl.exp(z - m[:, None])
        s = tl.sum(p, axis=1)
        if NOISE == 3:
            u, v = _tile_uniforms(rng_ptr, rows.to(tl.int64), tile)
            # p is 0 where z is -inf (padding, underflow) and NaN where z is: neither is ever drawn. A live tile's
            # mass is >= 1 (its max entry's) and u <= 1 - 2^-24, so u * total rounds below the total: some entry
            # passes it, and the first to pass is live (an entry of mass 0 repeats its predecessor's sum)
            c = tl.cumsum(tl.where(p > 0, p, 0.0), axis=1)
            hit = c > (u * tl.max(c, axis=1))[:, None]  # the first entry whose cumulative mass passes u
            pick = tl.min(tl.where(hit, cols[None, :], 2147483647), axis=1)
            best_idx = tl.where(pick == 2147483647, tile * BN, pick)  # no live entry: a vocabulary index, never wins
            best = m + tl.log(s) - tl.log(-tl.log(v))  # the tile's log-sum-exp + Gumbel(0, 1) noise
            best = tl.where(best != best, neg_inf, best)  # a NaN (or all -inf) tile never wins
        else:
            if NOISE == 0:
                score = z
            else:
                e = _exp_noise_tile(rng_ptr, rows.to(tl.int64), tile * BN, vocab_blocks, BM, BN, BLOCK)
                score = tl.where(valid, z - _log_of_noise(e, FAST_LOG), neg_inf)
            score = tl.where(score != score, neg_inf, score)  # a NaN never wins (its row is reported not finite)
            best = tl.max(score, axis=1)
            best_idx = tl.min(tl.where(score == best[:, None], cols[None, :], 2147483647), axis=1)  # first maximum
        best_z = tl.max(tl.where(cols[None, :] == best_idx[:, None], z, neg_inf), axis=1)
        at = rows.to(tl.int64) * tiles + tile
        live = rows < n_rows
        tl.store(part_f_ptr + at * 4 + 0, m, mask=live)
        tl.store(part_f_ptr + at * 4 + 1, s, mask=live)
        tl.store(part_f_ptr + at * 4 + 2, best, mask=live)
        tl.store(part_f_ptr + at * 4 + 3, best_z, mask=live)
        tl.store(part_i_ptr + at * 2 + 0, best_idx, mask=live)
        tl.store(part_i_ptr + at * 2 + 1, bad, mask=live)

    @triton.jit
    def _merge_kernel(logits_ptr, part_f_ptr, part_i_ptr, tokens_ptr, logprobs_ptr, finite_ptr, rng_ptr, stride_l,
                      chunks, temp, CHUNKS: tl.constexpr, ADVANCE: tl.constexpr, PART_Z: tl.constexpr):
        # PART_Z: the parts hold a 4th float, z at the part's best entry (``_head_kernel``: no logits in memory)
        row = tl.program_id(0).to(tl.int64)
        NF: tl.constexpr = 4 if PART_Z else 3
        if ADVANCE:  # the next step draws new noise (every chunk program has read this step's counter)
            if row == 0:
                tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)
        c = tl.arange(0, CHUNKS)
        mask = c < chunks
        at = row * chunks + c
        m = tl.load(part_f_ptr + at * NF + 0, mask=mask, other=float("-inf"))
        s = tl.load(part_f_ptr + at * NF + 1, mask=mask, other=0.0)
        best = tl.load(part_f_ptr + at * NF + 2, mask=mask, other=float("-inf"))
        idx = tl.load(part_i_ptr + at * 2 + 0, mask=mask, other=0)
        bad = tl.load(part_i_ptr + at * 2 + 1, mask=mask, other=0)
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
        lse = top + tl.log(total)
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(best == winner, idx, 2147483647), axis=0)  # chunks are in index order
        token = tl.where(token == 2147483647, 0, token)  # no part won (a NaN best): an index, never the sentinel
        if PART_Z:
            z_part = tl.load(part_f_ptr + at * NF + 3, mask=mask, other=float("-inf"))
            z = tl.max(tl.where(idx == token, z_part, float("-inf")), axis=0)  # the winning part's entry
        else:
            z = tl.load(logits_ptr + row * stride_l + token).to(tl.float32) / temp
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, z - lse)
        tl.store(finite_ptr + row, (tl.max(bad, axis=0) == 0).to(tl.int8))


    @triton.jit
    def _tempered(x, mask, temp, UNIT_T: tl.constexpr):
        """z = x / T (fp32, as torch's sampler divides; at T = 1 no division), -inf where ``mask`` is False."""
        if UNIT_T:
            return tl.where(mask, x, float("-inf"))
        else:
            return tl.where(mask, x / temp, float("-inf"))

    @triton.jit
    def _mass_kernel(logits_ptr, rng_ptr, blk_ptr, bad_ptr, u_ptr, stride_l, vocab, chunks, chunk_size, temp,
                     PART: tl.constexpr, UNROLL: tl.constexpr, UNIT_T: tl.constexpr):
        # The inverse-CDF draw's pass over the logits: per PART entries of a row their max and sum of exp(z - max)
        # (``blk_ptr`` [rows, parts, 2] fp32), UNROLL parts per load; per chunk whether every logit was finite;
        # program (row, 0) draws the row's uniform (``_row_uniform``). No noise per entry.
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        neg_inf = float("-inf")
        parts = tl.cdiv(vocab, PART)
        offs = tl.arange(0, UNROLL)[:, None] * PART + tl.arange(0, PART)[None, :]
        bad_vec = tl.zeros([UNROLL, PART], tl.int32)
        for start in range(0, chunk_size, PART * UNROLL):
            col0 = chunk * chunk_size + start
            idx = col0 + offs
            mask = idx < vocab
            x = tl.load(logits_ptr + row * stride_l + idx, mask=mask, other=0.0).to(tl.float32)
            bad_vec = tl.maximum(bad_vec, tl.where(mask & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0))
            z = _tempered(x, mask, temp, UNIT_T)
            m = tl.max(z, axis=1)
            top = tl.where(m == neg_inf, 0.0, m)
            s = tl.sum(tl.exp(z - top[:, None]), axis=1)
            part = col0 // PART + tl.arange(0, UNROLL)
            at = row * parts + part
            tl.store(blk_ptr + at * 2 + 0, m, mask=part < parts)
            tl.store(blk_ptr + at * 2 + 1, s, mask=part < parts)
        tl.store(bad_ptr + row * chunks + chunk, tl.max(tl.max(bad_vec, axis=1), axis=0))
        if chunk == 0:
            tl.store(u_ptr + row, _row_uniform(rng_ptr, row))

    @triton.jit
    def _row_uniform(rng_ptr, row):
        """u in (0, 1), fp64, for ``row`` at the state's step: Philox4x32-10 keyed by the seed, counter (row, step,
        1) (the Gumbel arm's counters have a 0 there); the top 25 + 27 bits of its first two words as k, u =
        (k + 1/2) * 2^-52, exact in fp64, so never 0 nor 1."""
        seed = tl.load(rng_ptr)
        step = tl.load(rng_ptr + 1).to(tl.uint32)
        c0 = row.to(tl.uint32)
        zero = c0 * 0
        r0, r1, r2, r3 = tl.philox(seed, c0, zero + step, zero + 1, zero)
        bits = ((r0 >> 7).to(tl.uint64) << 27) | (r1 >> 5).to(tl.uint64)
        return bits.to(tl.float64) * (1.0 / 4503599627370496.0) + (1.0 / 9007199254740992.0)

    @triton.jit
    def _uniform_kernel(rng_ptr, out_ptr):
        row = tl.program_id(0).to(tl.int64)
        tl.store(out_ptr + row, _row_uniform(rng_ptr, row))

    @triton.jit
    def _pick_kernel(logits_ptr, blk_ptr, bad_ptr, u_ptr, tokens_ptr, logprobs_ptr, finite_ptr, rng_ptr, stride_l,
                     vocab, chunks, temp, BLOCKS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK: tl.constexpr,
                     UNIT_T: tl.constexpr):
        # BLOCK: the mass kernel's PART (entries per partial)
        # The inverse CDF at the row's uniform u: the block whose cumulative mass (fp64) first passes u * total,
        # then the entry in it whose cumulative mass first passes the rest. The logprob is z - logsumexp(z).
        row = tl.program_id(0).to(tl.int64)
        if row == 0:  # the next step draws anew (every row's uniform was drawn by the mass kernel)
            tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)
        neg_inf = float("-inf")
        nb = tl.cdiv(vocab, BLOCK)
        b = tl.arange(0, BLOCKS)
        bmask = b < nb
        m = tl.load(blk_ptr + (row * nb + b) * 2 + 0, mask=bmask, other=neg_inf)
        s = tl.load(blk_ptr + (row * nb + b) * 2 + 1, mask=bmask, other=0.0)
        top = tl.max(m, axis=0)
        w = tl.where(m == neg_inf, 0.0, s * tl.exp(m - top))
        lse = top + tl.log(tl.sum(w, axis=0))
        w64 = w.to(tl.float64)
        cw = tl.cumsum(w64, axis=0)
        target = tl.load(u_ptr + row) * tl.sum(w64, axis=0)
        last_b = tl.max(tl.where(w > 0, b, 0), axis=0)
        blk = tl.minimum(tl.sum(tl.where(bmask & (cw <= target), 1, 0), axis=0), last_b)
        before = tl.sum(tl.where(b == blk - 1, cw, 0.0), axis=0)
        m_blk = tl.sum(tl.where(b == blk, m, 0.0), axis=0)
        scale = tl.exp(m_blk - top).to(tl.float64)
        j = tl.arange(0, BLOCK)
        idx = blk * BLOCK + j
        jmask = idx < vocab
        x = tl.load(logits_ptr + row * stride_l + idx, mask=jmask, other=0.0).to(tl.float32)
        z = _tempered(x, jmask, temp, UNIT_T)
        p = tl.where(z == neg_inf, 0.0, tl.exp(z - m_blk)).to(tl.float64) * scale
        cp = tl.cumsum(p, axis=0)
        last_j = tl.max(tl.where(p > 0, j, 0), axis=0)
        pick = tl.minimum(tl.sum(tl.where(cp <= target - before, 1, 0), axis=0), last_j)
        token = tl.minimum(blk * BLOCK + pick, vocab - 1)
        z_tok = tl.sum(tl.where(j == pick, z, 0.0), axis=0)
        c = tl.arange(0, CHUNKS)
        bad = tl.load(bad_ptr + row * chunks + c, mask=c < chunks, other=0)
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, z_tok - lse)
        tl.store(finite_ptr + row, (tl.max(bad, axis=0) == 0).to(tl.int8))


def _fast_log(device) -> bool:
    """``lg2.approx`` is PTX: NVIDIA's CUDA, compiled (not ROCm's "cuda" devices, not the interpreter)."""
    return device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def check_sampler_device(on: bool, device, owner: str = "RolloutEngine") -> None:
    """``fused_sampling=True`` needs Triton on the model's device: CUDA, or a CPU under ``TRITON_INTERPRET=1``."""
    if not on:
        return
    if triton is None:
        raise ValueError(f"{owner}.fused_sampling=True needs Triton, which is not installed; leave "
                         "fused_sampling=None (torch's sampler).")
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{owner}.fused_sampling=True but the model is on {device}: the fused sampler runs "
                         "on CUDA (on a CPU only under TRITON_INTERPRET=1, for tests); leave fused_sampling=None.")


def plain(sampling) -> bool:
    """Whether ``sampling`` sets no processor, so that the fused sampler can serve it."""
    return sampling.top_k == 0 and sampling.top_p == 1.0 and sampling.min_p == 0.0 \
        and sampling.repetition_penalty == 1.0


def _chunking(rows: int, vocab: int, device, per_sm: int | None = None, load: int = BLOCK) -> tuple[int, int]:
    """(chunk size, chunks per row): about ``per_sm`` (CHUNKS_PER_SM) programs per SM over the batch, whole loads
    of ``load`` entries each."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, min(MAX_CHUNKS, -(-(per_sm or CHUNKS_PER_SM) * sms // rows)))
    chunk = max(load, -(-(-(-vocab // want)) // load) * load)  # ceil(vocab / want), rounded up to a whole load
    return chunk, -(-vocab // chunk)


def new_rng_state(device, generator: torch.Generator | None = None) -> torch.Tensor:
    """A fresh [seed, step] int64 state for ``fused_sample(rng=)``: the seed drawn from ``generator`` on the
    device (no host sync; reproducible from the generator's seed), the step 0."""
    state = torch.zeros(2, dtype=torch.int64, device=device)
    reseed(state, generator)
    return state


def reseed(state: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Draw a new seed into ``state`` [seed, step] from ``generator`` and set its step to 0, on the device."""
    state[:1].random_(0, 2**62, generator=generator)
    state[1:].zero_()


def exp_noise(rows: int, vocab: int, rng: torch.Tensor) -> torch.Tensor:
    """The Exponential(1) noise [rows, vocab] fp32 that ``fused_sample(..., rng=rng)``'s Gumbel arm
    (``INVERSE_CDF = False``) and ``head_sample(..., rng=rng)`` draw at the state ``rng`` holds now (the state is not
    advanced): ``fused_sample(logits, exp_noise(rows, vocab, rng), T)`` is that call's draw, token for token. The
    default in-kernel draw (``INVERSE_CDF``) uses ``row_uniforms`` instead."""
    assert triton is not None, "exp_noise needs Triton"
    _check_rng(rng, rows, vocab)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=rng.device)
    if rows and vocab:
        blocks = triton.cdiv(vocab, BLOCK)
        _noise_kernel[(rows, blocks)](rng, out, out.stride(0), vocab, blocks, BLOCK=BLOCK)
    return out


def row_uniforms(rows: int, rng: torch.Tensor) -> torch.Tensor:
    """The uniforms u [rows] fp64 in (0, 1) at which ``fused_sample(..., rng=rng)`` inverts each row's CDF at the
    state ``rng`` holds now (not advanced): ``inverse_cdf_ref(logits, T, row_uniforms(rows, rng))`` is that call's
    draw, up to rounding at the boundaries between entries."""
    assert triton is not None, "row_uniforms needs Triton"
    _check_state(rng)
    out = torch.empty(rows, dtype=torch.float64, device=rng.device)
    if rows:
        _uniform_kernel[(rows,)](rng, out)
    return out


def inverse_cdf_ref(logits: torch.Tensor, temperature: float, u: torch.Tensor):
    """The inverse-CDF draw in fp64 torch: the first entry whose cumulative softmax(logits / T) passes u times the
    row's total; (tokens int64, logprobs fp32), each [rows]."""
    z, cdf = _cdf(logits, temperature)
    tokens = _invert(cdf, u)
    return tokens, (z.gather(-1, tokens[:, None])[:, 0] - z.logsumexp(dim=-1)).float()


def inverse_cdf_slack(tokens: torch.Tensor, logits: torch.Tensor, temperature: float, u: torch.Tensor):
    """How far ``tokens`` are from the fp64 inverse CDF at ``u``: (the largest distance of u * total outside a
    token's CDF interval, as a fraction of the total: 0 for an exact draw, ~1e-7 where the kernels' fp32 parts move
    an edge; the fraction of rows equal to ``inverse_cdf_ref``'s token). The tests' and benchmark's check."""
    _, cdf = _cdf(logits, temperature)
    rows = torch.arange(len(tokens), device=tokens.device)
    target, upper = u.double() * cdf[:, -1], cdf[rows, tokens]
    lower = torch.where(tokens > 0, cdf[rows, (tokens - 1).clamp(min=0)], torch.zeros_like(upper))
    slack = (torch.maximum(lower - target, target - upper).clamp(min=0) / cdf[:, -1]).max().item()
    return slack, (tokens == _invert(cdf, u)).float().mean().item()


def _cdf(logits: torch.Tensor, temperature: float):
    """(z = logits / T, the cumulative softmax(z)), fp64."""
    z = logits.double() / temperature
    return z, torch.softmax(z, dim=-1).cumsum(dim=-1)


def _invert(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    tokens = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    return tokens.clamp(max=cdf.shape[-1] - 1)


def _check_state(rng: torch.Tensor) -> None:
    assert rng.dtype == torch.int64 and rng.shape == (2,) and rng.is_contiguous(), (rng.dtype, rng.shape)


def _check_rng(rng: torch.Tensor, rows: int, vocab: int) -> None:
    _check_state(rng)
    blocks = -(-vocab // BLOCK)
    assert rows * blocks * (BLOCK // 4) < 2**32, f"{rows} rows x {vocab} entries: more than 2^32 Philox counters"


def fused_sample(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float, rng: torch.Tensor | None = None):
    """Draw one token per row of ``logits`` [rows, vocab] (any float dtype, last dim contiguous) from
    softmax(logits / T): with the Exponential(1) ``noise`` [rows, vocab] fp32, or with noise drawn inside the kernel
    from the state ``rng`` ([seed, step] int64 on the device, ``new_rng_state``; its step is advanced by one), or
    greedily when both are None (T ignored).

    Returns (tokens int64 [rows], logprobs fp32 [rows], finite bool [rows]); no host synchronisation.
    """
    assert triton is not None, "fused_sample needs Triton; use kvroll.rollout.sampling.sample on CPU"
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and logits.dtype in (torch.float16, torch.bfloat16, torch.float32), logits.dtype
    assert noise is None or rng is None, "pass the noise or the rng state, not both"
    greedy = noise is None and rng is None
    if noise is not None:
        assert noise.shape == logits.shape and noise.dtype == torch.float32 and noise.stride(-1) == 1, noise.shape
    if rng is not None:
        _check_rng(rng, rows, vocab)
        assert rng.device == logits.device, (rng.device, logits.device)
    assert greedy or temperature > 0, f"temperature={temperature}: sampling needs T > 0 (greedy: no noise, no rng)"
    temp = 1.0 if greedy else float(temperature)
    if rows == 0:  # nothing to draw, no launch (``_chunking`` divides by the rows), as ``head_sample``'s
        empty = torch.empty(0, dtype=torch.int64, device=logits.device)
        return empty, empty.float(), empty.bool()
    if rng is not None and INVERSE_CDF:
        return _inverse_cdf_sample(logits, temp, rng)
    chunk, chunks = _chunking(rows, vocab, logits.device)
    part_f = torch.empty(rows * chunks * 3, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows * chunks * 2, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    finite = torch.empty(rows, dtype=torch.int8, device=logits.device)
    noise_arg = noise if noise is not None else logits  # not read without noise
    rng_arg = rng if rng is not None else tokens  # not read without rng
    mode = 0 if greedy else (1 if noise is not None else 2)
    _chunk_kernel[(rows, chunks)](logits, noise_arg, rng_arg, part_f, part_i, logits.stride(0), noise_arg.stride(0),
                                  vocab, chunks, chunk, -(-vocab // BLOCK), temp, BLOCK=BLOCK, NOISE=mode,
                                  UNIT_T=temp == 1.0, FAST_LOG=_fast_log(logits.device))
    _merge_kernel[(rows,)](logits, part_f, part_i, tokens, logprobs, finite, rng_arg, logits.stride(0), chunks, temp,
                           CHUNKS=max(2, triton.next_power_of_2(chunks)), ADVANCE=mode == 2, PART_Z=False)
    return tokens, logprobs, finite.bool()


def _icdf_chunking(rows: int, vocab: int, device) -> tuple[int, int]:
    """The mass kernel's ``_chunking``: ICDF_CHUNKS_PER_SM programs per SM, loads of ICDF_PART * ICDF_UNROLL."""
    return _chunking(rows, vocab, device, ICDF_CHUNKS_PER_SM, ICDF_PART * ICDF_UNROLL)


def _inverse_cdf_sample(logits: torch.Tensor, temp: float, rng: torch.Tensor):
    return _icdf_pick(logits, temp, rng, _icdf_mass(logits, temp, rng))


def _icdf_mass(logits: torch.Tensor, temp: float, rng: torch.Tensor) -> dict:
    """The inverse CDF's first kernel: each block's mass, the rows' non-finite flags and uniforms ``u``; the state
    ``_icdf_pick`` reads (its ``u`` may be set in between, as a test does)."""
    rows, vocab = logits.shape
    dev = logits.device
    chunk, chunks = _icdf_chunking(rows, vocab, dev)
    parts = -(-vocab // ICDF_PART)
    state = dict(blk=torch.empty(rows * parts * 2, dtype=torch.float32, device=dev),
                 bad=torch.empty(rows * chunks, dtype=torch.int32, device=dev),
                 u=torch.empty(rows, dtype=torch.float64, device=dev), chunks=chunks, parts=parts)
    _mass_kernel[(rows, chunks)](logits, rng, state["blk"], state["bad"], state["u"], logits.stride(0), vocab, chunks,
                                 chunk, temp, PART=ICDF_PART, UNROLL=ICDF_UNROLL, UNIT_T=temp == 1.0,
                                 num_warps=ICDF_WARPS)
    return state


def _icdf_pick(logits: torch.Tensor, temp: float, rng: torch.Tensor, state: dict):
    """The inverse CDF's second kernel: (tokens, logprobs, finite) of the draw at ``state["u"]``."""
    rows, vocab = logits.shape
    dev, chunks, parts = logits.device, state["chunks"], state["parts"]
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    finite = torch.empty(rows, dtype=torch.int8, device=dev)
    _pick_kernel[(rows,)](logits, state["blk"], state["bad"], state["u"], tokens, logprobs, finite, rng,
                          logits.stride(0), vocab, chunks, temp, BLOCKS=max(2, triton.next_power_of_2(parts)),
                          CHUNKS=max(2, triton.next_power_of_2(chunks)), BLOCK=ICDF_PART, UNIT_T=temp == 1.0,
                          num_warps=8)
    return tokens, logprobs, finite.bool()


# (BM, BN, BK, num_warps, num_stages) of ``head_sample`` by rows: the largest key <= rows (None: ``head_config``'s)
HEAD_CONFIG: dict[int, tuple[int, int, int, int, int]] | None = None
HEAD_MAX_ROWS = 64  # the engine takes ``head_sample`` up to this many rows (``head_config``)
# On an H200 (``DEVICE_HEAD`` on; ``pdl_gemm.h200_name``): ``head_sample`` up to ``H200_HEAD_MAX_ROWS`` rows, in
# (BM, 128, 128, 4, 3) tiles (so it draws per tile, ``tile_draw``), and cuBLAS's head with ``fused_sample`` above.
# Session 42's H200 sweep (``benchmarks/head_sample_ab.py --sweep``, Qwen3-1.7B's head, bf16, T = 1, floor ~146 us;
# docs/benchmarks/engine_throughput.md): at 33-64 rows the pair's inverse CDF took 180.6 / 176.5 us at 64 / 48
# rows against the H100 rule's tiles' 192.5 / 185.3 (and the sweep's best tile, 187.9 / 184.1); at 1-32 rows the
# 128-wide tiles took 159.3 / 152.1 / 160.9 us at 1 / 16 / 32 rows against the rule's 163.7 / 157.5 / 166.0 (the
# pair 160.2 / 167.3 / 172.0). An H100 keeps the rule above (not re-measured with these).
H200_HEAD_MAX_ROWS = 32
DEVICE_HEAD = True  # False: an H200 takes the H100's rule (the A/B's "old" of session 42)


def head_config(rows: int, dtype=torch.bfloat16, device=None) -> tuple[int, int, int, int, int] | None:
    """``head_sample``'s (BM, BN, BK, num_warps, num_stages) for ``rows`` of ``dtype``, or None where cuBLAS's head
    and ``fused_sample`` serve instead: above ``HEAD_MAX_ROWS`` rows, or where the tiles of two pipeline stages do
    not fit the device's shared memory (the stages are cut to fit, down to two). From an H100 sweep of Qwen3-1.7B's
    head (2,048 x 151,936, bf16, T = 1; ``benchmarks/head_sample_ab.py``, docs/benchmarks/engine_throughput.md,
    session 21), these tiles took 0.88-0.96x the pair's time at 1-64 rows (215 against 227 us at 1 row, 214
    against 240 at 16, 221 against 251 at 32, 251 against 262 at 48, 241 against 271 at 64; the weight's floor is
    207); at 96-256 rows the tiles' epilogues (Philox and the softmax's exps on every entry) no longer hide under
    the weight's stream and the pair is as fast or faster (the first rule's tiles took 1.44x its time at 256).
    On an H200 (``DEVICE_HEAD``) the rule is session 42's: 128-wide tiles up to ``H200_HEAD_MAX_ROWS`` rows, the
    pair above."""
    if rows > HEAD_MAX_ROWS:
        return None
    if _h200_head(device):
        if rows > H200_HEAD_MAX_ROWS:
            return None
        bm, bn, bk, warps, stages = (16 if rows <= 16 else 32), 128, 128, 4, 3
    elif rows <= 16:
        bm, bn, bk, warps, stages = 16, 64, 128, 4, 4
    elif rows <= 32:
        bm, bn, bk, warps, stages = 32, 64, 128, 4, 4
    else:
        bm, bn, bk, warps, stages = (64, 128, 64, 4, 4) if rows <= 48 else (64, 64, 64, 4, 4)
    have, size = block_shared_memory(device), dtype.itemsize
    while stages > 2 and stages * (bm * bk + bk * bn) * size > have:
        stages -= 1
    return (bm, bn, bk, warps, stages) if stages * (bm * bk + bk * bn) * size <= have else None


def _h200_head(device) -> bool:
    """Whether ``head_config`` takes the H200's rule: ``DEVICE_HEAD`` on and ``device`` an H200."""
    if not DEVICE_HEAD:
        return False
    from kvroll.kernels.pdl_gemm import on_h200  # the chain's H200 tiles' test

    return on_h200(device)


def head_tiles(rows: int, dtype=torch.bfloat16, device=None) -> tuple[int, int, int, int, int]:
    """The (BM, BN, BK, num_warps, num_stages) ``head_sample`` runs ``rows`` at: ``HEAD_CONFIG``'s (a benchmark's or
    test's tiles), else ``head_config``'s, else (above its rows, where the engine does not call it) two stages of
    64-row tiles. The tile draw (``TILE_DRAW``) depends on BN: ``head_tile_draw_ref`` takes it."""
    if HEAD_CONFIG is not None:
        return HEAD_CONFIG[max(k for k in HEAD_CONFIG if k <= max(rows, min(HEAD_CONFIG)))]
    return head_config(rows, dtype, device) or (64, 64, 64, 4, 2)


def tile_draw(bn: int) -> bool:
    """Whether ``head_sample`` on vocabulary tiles of ``bn`` entries draws per tile (``TILE_DRAW`` on, ``bn`` at
    least ``TILE_DRAW_MIN_BN``) instead of Gumbel-max over every entry. Session 38's H100 A/B
    (``benchmarks/head_tile_draw_ab.py``, Qwen3-1.7B's head, bf16, T = 1, ``raw/s38``): on the rule's 128-wide tiles
    of 33-48 rows 243.8 us against 259.7 (cuBLAS + the sampler 249.6; a second call 237.5 against 249.6, and
    LongFlow's step at batch 48 0.6% shorter), and at 80-128 rows on 128-wide tiles 0.89-1.00x the Gumbel arm's
    time; on 64-wide tiles (the rule's at 1-32 and 49-64 rows) within 1.4 us at 1-32 rows (215.9-221.9 us against
    215.3-222.0) and slower at 64 (250.2 against 241.6; LongFlow's and Hard-KV's steps at batch 64 0.1% longer):
    there the tile's scan costs more than the Philox draws and logs it saves."""
    return TILE_DRAW and bn >= TILE_DRAW_MIN_BN


def tile_uniforms(rows: int, tiles: int, rng: torch.Tensor) -> torch.Tensor:
    """The uniforms [rows, tiles, 2] fp32 (u, v) of ``head_sample(..., rng=rng)``'s tile draw (``TILE_DRAW``) at the
    state ``rng`` holds now (not advanced), for vocabulary tiles 0..tiles-1: ``head_tile_draw_ref`` of the logits at
    them is that call's draw, up to rounding at the edges."""
    assert triton is not None, "tile_uniforms needs Triton"
    _check_state(rng)
    out = torch.empty(rows, tiles, 2, dtype=torch.float32, device=rng.device)
    if rows and tiles:
        _tile_uniform_kernel[(triton.cdiv(rows, 16), tiles)](rng, out, rows, tiles, BM=16)
    return out


def head_tile_draw_ref(logits: torch.Tensor, temperature: float, uv: torch.Tensor, bn: int):
    """``head_sample``'s tile draw in fp64 torch, from the uniforms ``uv`` [rows, tiles, 2] (``tile_uniforms``) and
    the tiles of ``bn`` entries: in each tile the first entry whose cumulative softmax passes u times the tile's
    mass, the tile's score its log-sum-exp - log(-log v) (log-sum-exp plus Gumbel noise), the best tile's entry.
    Returns (tokens int64, the tiles' scores fp64 [rows, tiles], the tiles' cumulative masses fp64 [rows, tiles,
    bn], targets fp64 [rows, tiles]: u times each tile's mass)."""
    rows, vocab = logits.shape
    tiles = -(-vocab // bn)
    z = torch.full((rows, tiles * bn), float("-inf"), dtype=torch.float64, device=logits.device)
    z[:, :vocab] = logits.double() / temperature
    z = z.view(rows, tiles, bn)
    m = z.amax(-1, keepdim=True)
    p = torch.exp(z - m)
    c = p.cumsum(-1)
    u, v = uv[..., 0].double(), uv[..., 1].double()
    target = u * c[..., -1]
    pick = (c <= target[..., None]).sum(-1).clamp(max=bn - 1)
    score = m[..., 0] + c[..., -1].log() - (-v.log()).log()
    best = score.argmax(-1)
    tokens = best * bn + pick.gather(-1, best[:, None])[:, 0]
    return tokens, score, c, target


def head_sample(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, rng: torch.Tensor | None = None):
    """The model's output head and the draw in two kernels: ``fused_sample(hidden @ weight^T, None, temperature,
    rng=rng)`` with its Gumbel arm (``INVERSE_CDF = False``: the same distribution as the default inverse CDF, other
    draws) without the [rows, vocab] logits in memory. hidden [rows, H] and weight [vocab, H] in one dtype, each
    row contiguous. Each tile of logits is accumulated in fp32 and rounded to that dtype, as the head's matmul
    would give (the rounding of the sum may differ from cuBLAS's in the last bit). On tiles (``head_tiles``) of
    fewer than ``TILE_DRAW_MIN_BN`` entries the noise is ``exp_noise``'s: with ``rng`` the draw is
    ``fused_sample(logits, exp_noise(rows, vocab, rng), T)`` of these logits; on wider ones the tile draw
    (``tile_draw``), ``head_tile_draw_ref(logits, T, tile_uniforms(rows, tiles, rng), BN)``'s. Greedy when ``rng``
    is None. Returns (tokens int64, logprobs fp32, finite bool), each [rows]; no host sync."""
    assert triton is not None, "head_sample needs Triton"
    rows, hid = hidden.shape
    vocab = weight.shape[0]
    assert weight.shape[1] == hid and hidden.dtype == weight.dtype, (hidden.shape, hidden.dtype, weight.shape,
                                                                     weight.dtype)
    assert hidden.stride(-1) == 1 and weight.stride(-1) == 1, "rows must be contiguous"
    assert hidden.dtype in (torch.float16, torch.bfloat16, torch.float32), hidden.dtype
    greedy = rng is None
    if rng is not None:
        _check_rng(rng, rows, vocab)
    assert greedy or temperature > 0, f"temperature={temperature}: sampling needs T > 0 (greedy: no rng)"
    temp = 1.0 if greedy else float(temperature)
    bm, bn, bk, warps, stages = head_tiles(rows, hidden.dtype, hidden.device)
    assert BLOCK % bn == 0, f"BN={bn} must divide {BLOCK}"
    tiles = triton.cdiv(vocab, bn)
    dev = hidden.device
    part_f = torch.empty(rows * tiles * 4, dtype=torch.float32, device=dev)
    part_i = torch.empty(rows * tiles * 2, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    finite = torch.empty(rows, dtype=torch.int8, device=dev)
    rng_arg = rng if rng is not None else tokens  # not read without rng
    rnd = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}[hidden.dtype]
    _head_kernel[(triton.cdiv(rows, bm), tiles)](
        hidden, weight, rng_arg, part_f, part_i, rows, vocab, hid, hidden.stride(0), weight.stride(0), tiles,
        triton.cdiv(vocab, BLOCK), temp, BM=bm, BN=bn, BK=bk, EVEN_K=hid % bk == 0, ROUND=rnd,
        NOISE=0 if greedy else (3 if tile_draw(bn) else 2), UNIT_T=temp == 1.0, FAST_LOG=_fast_log(dev), BLOCK=BLOCK, num_warps=warps,
        num_stages=stages)
    _merge_kernel[(rows,)](hidden, part_f, part_i, tokens, logprobs, finite, rng_arg, 0, tiles, temp,
                           CHUNKS=max(2, triton.next_power_of_2(tiles)), ADVANCE=not greedy, PART_Z=True,
                           num_warps=8)
    return tokens, logprobs, finite.bool()
