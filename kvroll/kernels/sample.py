"""Sampling in two kernels: the draw, the sampled token's logprob and the finite check of a decode step's logits.

The engine's sampler (``kvroll/rollout/sampling.py``) without processors (no top-k / top-p / min-p, no repetition
penalty: TRL's GRPO default) runs ~12 kernels over the [batch, vocab] logits per step: the fp32 copy, the division
by the temperature, softmax, the exponential noise, the division by it, argmax, log_softmax, gather and the finite
check, each a pass over batch x vocab fp32 values. Here the noise is still drawn by torch (same generator, same
draws), and one kernel reads the logits in their own dtype and the noise once, in vocabulary chunks spread over
the GPU, keeping per chunk the running max and sum of exp (online softmax), the best Gumbel score and its index,
and whether every logit was finite; a second kernel merges the chunks of each row:

    tokens, logprobs, finite = fused_sample(logits, noise, temperature)   # noise None: greedy
    ref = fused_sample_ref(logits, noise, temperature)                    # the same in fp64 torch (the tests' oracle)

Draw: ``sample`` takes argmax(softmax(z) / E) with z = logits / T and E ~ Exponential(1); this takes
argmax(z - log E), the same token (softmax's normaliser is one constant per row), up to rounding: the two can pick
different tokens only where two candidates' scores agree to fp32 rounding. Greedy: argmax(logits). Ties resolve to
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
CHUNKS_PER_SM = 4  # chunk programs per SM over the whole batch (at least one chunk of BLOCK per program)
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
    def _chunk_kernel(logits_ptr, noise_ptr, part_f_ptr, part_i_ptr, stride_l, stride_n, vocab, chunks, chunk_size,
                      temp, BLOCK: tl.constexpr, GREEDY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        neg_inf = float("-inf")
        run_max = tl.full([], neg_inf, tl.float32)
        run_sum = tl.zeros([], tl.float32)
        best = tl.full([], neg_inf, tl.float32)
        best_idx = tl.zeros([], tl.int32)
        bad = tl.zeros([], tl.int32)
        for start in range(0, chunk_size, BLOCK):  # a runtime loop: one compiled kernel for every batch size
            idx = chunk * chunk_size + start + tl.arange(0, BLOCK)
            mask = idx < vocab
            x = tl.load(logits_ptr + row * stride_l + idx, mask=mask, other=0.0).to(tl.float32)
            bad = tl.maximum(bad, tl.max(tl.where(mask & ((x != x) | (tl.abs(x) == float("inf"))), 1, 0), axis=0))
            z = tl.where(mask, x / temp, neg_inf)  # divided, as torch's sampler: the same fp32 z
            block_max = tl.max(z, axis=0)
            new_max = tl.maximum(run_max, block_max)
            scale = tl.where(run_max == new_max, 1.0, tl.exp(run_max - new_max))
            terms = tl.where(z == neg_inf, 0.0, tl.exp(z - new_max))
            run_sum = run_sum * scale + tl.sum(terms, axis=0)
            run_max = new_max
            if GREEDY:
                score = z
            else:
                e = tl.load(noise_ptr + row * stride_n + idx, mask=mask, other=1.0)
                score = tl.where(mask, z - tl.log(e), neg_inf)
            block_best = tl.max(score, axis=0)
            block_idx = tl.min(tl.where(score == block_best, idx, 2147483647), axis=0)  # the first maximum
            take = block_best > best  # strictly: an earlier block keeps a tie
            best_idx = tl.where(take, block_idx, best_idx)
            best = tl.where(take, block_best, best)
        at = row * chunks + chunk
        tl.store(part_f_ptr + at * 3 + 0, run_max)
        tl.store(part_f_ptr + at * 3 + 1, run_sum)
        tl.store(part_f_ptr + at * 3 + 2, best)
        tl.store(part_i_ptr + at * 2 + 0, best_idx)
        tl.store(part_i_ptr + at * 2 + 1, bad)

    @triton.jit
    def _merge_kernel(logits_ptr, part_f_ptr, part_i_ptr, tokens_ptr, logprobs_ptr, finite_ptr, stride_l, chunks,
                      temp, CHUNKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
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


def fused_sample(logits: torch.Tensor, noise: torch.Tensor | None, temperature: float):
    """Draw one token per row of ``logits`` [rows, vocab] (any float dtype, last dim contiguous) from
    softmax(logits / T) with the Exponential(1) ``noise`` [rows, vocab] fp32 (None: greedy, T ignored).

    Returns (tokens int64 [rows], logprobs fp32 [rows], finite bool [rows]); no host synchronisation.
    """
    assert triton is not None, "fused_sample needs Triton; use kvroll.rollout.sampling.sample on CPU"
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and logits.dtype in (torch.float16, torch.bfloat16, torch.float32), logits.dtype
    greedy = noise is None
    if not greedy:
        assert noise.shape == logits.shape and noise.dtype == torch.float32 and noise.stride(-1) == 1, noise.shape
    assert greedy or temperature > 0, f"temperature={temperature}: sampling needs T > 0 (greedy: noise=None)"
    temp = 1.0 if greedy else float(temperature)
    chunk, chunks = _chunking(rows, vocab, logits.device)
    part_f = torch.empty(rows * chunks * 3, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(rows * chunks * 2, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    finite = torch.empty(rows, dtype=torch.int8, device=logits.device)
    noise_arg = logits if greedy else noise  # not read when greedy
    _chunk_kernel[(rows, chunks)](logits, noise_arg, part_f, part_i, logits.stride(0), noise_arg.stride(0), vocab,
                                  chunks, chunk, temp, BLOCK=BLOCK, GREEDY=greedy)
    _merge_kernel[(rows,)](logits, part_f, part_i, tokens, logprobs, finite, logits.stride(0), chunks, temp,
                           CHUNKS=max(2, triton.next_power_of_2(chunks)))
    return tokens, logprobs, finite.bool()
