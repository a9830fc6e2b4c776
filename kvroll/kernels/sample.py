"""Sampling in two kernels: the draw, the sampled token's logprob and the finite check of a decode step's logits.

The engine's sampler (``kvroll/rollout/sampling.py``) without processors (no top-k / top-p / min-p, no repetition
penalty: TRL's GRPO default) runs ~12 kernels over the [batch, vocab] logits per step: the fp32 copy, the division
by the temperature, softmax, the exponential noise, the division by it, argmax, log_softmax, gather and the finite
check, each a pass over batch x vocab fp32 values. Here one kernel reads the logits once in their own dtype, in
vocabulary chunks spread over the GPU, keeping per lane of a chunk the running max and sum of exp (online softmax),
the best Gumbel score and its index, and whether every logit was finite (the lanes are reduced once, at the chunk's
end); a second kernel merges the chunks of each row:

    tokens, logprobs, finite = fused_sample(logits, None, temperature, rng=state)  # noise drawn in the kernel
    tokens, logprobs, finite = fused_sample(logits, noise, temperature)  # the noise given [rows, vocab] fp32
    tokens, logprobs, finite = fused_sample(logits, None, 1.0)           # greedy
    ref = fused_sample_ref(logits, noise, temperature)                   # fp64 torch (the tests' oracle)

The noise: the engine's step (``graphs.DecodeRunner``) draws it inside the kernel with Philox4x32-10 (Triton's
``tl.philox``, the generator of cuRAND and torch's CUDA RNG) from a device state [seed, step] (``new_rng_state``:
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

try:  # Triton is optional on CPU-only installs; the torch sampler is the CPU path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

BLOCK = 1024  # vocabulary entries per load
CHUNKS_PER_SM = 16  # chunk programs per SM over the whole batch (at least one chunk of BLOCK per program)
MAX_CHUNKS = 256  # chunks of one row (the merge kernel reads them in one block)


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
    def _merge_kernel(logits_ptr, part_f_ptr, part_i_ptr, tokens_ptr, logprobs_ptr, finite_ptr, rng_ptr, stride_l,
                      chunks, temp, CHUNKS: tl.constexpr, ADVANCE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        if ADVANCE:  # the next step draws new noise (every chunk program has read this step's counter)
            if row == 0:
                tl.store(rng_ptr + 1, tl.load(rng_ptr + 1) + 1)
        c = tl.arange(0, CHUNKS)
        mask = c < chunks
        at = row * chunks + c
        m = tl.load(part_f_ptr + at * 3 + 0, mask=mask, other=float("-inf"))
        s = tl.load(part_f_ptr + at * 3 + 1, mask=mask, other=0.0)
        best = tl.load(part_f_ptr + at * 3 + 2, mask=mask, other=float("-inf"))
        idx = tl.load(part_i_ptr + at * 2 + 0, mask=mask, other=0)
        bad = tl.load(part_i_ptr + at * 2 + 1, mask=mask, other=0)
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
        lse = top + tl.log(total)
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(best == winner, idx, 2147483647), axis=0)  # chunks are in index order
        z = tl.load(logits_ptr + row * stride_l + token).to(tl.float32) / temp
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, z - lse)
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


def _chunking(rows: int, vocab: int, device) -> tuple[int, int]:
    """(chunk size, chunks per row): about CHUNKS_PER_SM programs per SM over the batch, whole BLOCKs each."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, min(MAX_CHUNKS, -(-CHUNKS_PER_SM * sms // rows)))
    chunk = max(BLOCK, -(-(-(-vocab // want)) // BLOCK) * BLOCK)  # ceil(vocab / want), rounded up to BLOCK
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
    """The Exponential(1) noise [rows, vocab] fp32 that ``fused_sample(..., rng=rng)`` draws at the state ``rng``
    holds now (the state is not advanced): ``fused_sample(logits, exp_noise(rows, vocab, rng), T)`` is that call's
    draw, token for token."""
    assert triton is not None, "exp_noise needs Triton"
    _check_rng(rng, rows, vocab)
    out = torch.empty(rows, vocab, dtype=torch.float32, device=rng.device)
    if rows and vocab:
        blocks = triton.cdiv(vocab, BLOCK)
        _noise_kernel[(rows, blocks)](rng, out, out.stride(0), vocab, blocks, BLOCK=BLOCK)
    return out


def _check_rng(rng: torch.Tensor, rows: int, vocab: int) -> None:
    assert rng.dtype == torch.int64 and rng.shape == (2,) and rng.is_contiguous(), (rng.dtype, rng.shape)
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
                           CHUNKS=max(2, triton.next_power_of_2(chunks)), ADVANCE=mode == 2)
    return tokens, logprobs, finite.bool()
