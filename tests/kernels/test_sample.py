"""The fused sampler (``kvroll/kernels/sample.py``) against its fp64 reference and the engine's torch sampler.

CPU (CI): under ``TRITON_INTERPRET=1``, on odd vocabularies (one entry, one block +- 1, several chunks), 1-7 rows,
fp32 / bf16 / fp16 logits, strided rows, greedy and three temperatures. Tokens: the reference's, except where the
two candidates' scores agree to fp32 rounding (checked, not assumed); logprobs within 2e-6 of log_softmax; ties go
to the first index (across chunks, across blocks of a chunk, within one lane); a non-finite logit is reported for
its row alone. With the torch sampler's noise given, the draw is the torch sampler's. The noise drawn inside the
kernel (``rng=``): exactly the draw with ``exp_noise``'s tensor (so the reference checks cover it; one-block and
several-block chunks), the uniform transform exact and inside (0, 1) on the extreme bit patterns, Exponential(1) by
its CDF, fresh at every step, and the draws follow softmax(z) (a chi-square test). That is the Gumbel arm
(``INVERSE_CDF = False``); the default in-kernel draw, the inverse CDF at one uniform per row: each token's fp64 CDF
interval holds ``row_uniforms``' u (within the fp32 rounding of the parts' sums), most rows equal
``inverse_cdf_ref`` exactly, over parts, loads and chunks of several sizes; an entry of probability 0 is never
drawn; the uniforms are uniform, 52-bit exact, fresh at every step and reproducible. In the engine:
``fused_sampling=True`` gives the torch sampler's greedy completions; sampled ones are reproducible from the seed
and their logprobs are the model's (teacher-forced). GPU (``gpu``): the same against a real vocabulary (151,936).
"""
import os

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import sample as ks
from kvroll.rollout.sampling import sample
from tests.conftest import tiny_model

triton_ok = ks.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not triton_ok, reason="needs Triton on a GPU or TRITON_INTERPRET=1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def draw(rows, vocab, dtype, seed, scale=3.0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * scale).to(device=device, dtype=dtype)
    noise = torch.empty(rows, vocab).exponential_(1.0, generator=gen).to(device)
    return logits, noise


def assert_same_draw(tokens, expected, logits, noise, temperature):
    """``tokens`` equal ``expected`` except where their fp64 scores agree to fp32 rounding (a near-tie)."""
    z = logits.double() / (temperature if noise is not None else 1.0)
    score = z if noise is None else z - noise.double().log()
    rows = torch.arange(len(tokens), device=tokens.device)
    differ = tokens != expected
    gap = (score[rows, tokens] - score[rows, expected]).abs()
    assert (gap[differ] <= 1e-5 * score[rows, expected].abs()[differ].clamp(min=1)).all(), (tokens, expected)
    assert differ.float().mean() <= 0.05  # near-ties are rare: most rows agree exactly


@needs_triton
@pytest.mark.parametrize("vocab", [1, 1023, 1025, 5000])
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [None, 0.6, 1.0, 1.3])  # None: greedy
def test_matches_the_fp64_reference(vocab, rows, dtype, temperature):
    logits, noise = draw(rows, vocab, dtype, seed=vocab + rows)
    noise = None if temperature is None else noise
    tokens, logprobs, finite = ks.fused_sample(logits, noise, temperature or 1.0)
    ref_tokens, ref_logprobs, ref_finite = ks.fused_sample_ref(logits, noise, temperature or 1.0)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and finite.dtype == torch.bool
    assert_same_draw(tokens, ref_tokens, logits, noise, temperature)
    z = logits.float() / (temperature or 1.0)
    expected = z.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]  # the logprob of the token drawn
    torch.testing.assert_close(logprobs, expected, atol=2e-6, rtol=2e-6)
    assert torch.equal(finite, ref_finite) and finite.all()


@needs_triton
@pytest.mark.parametrize("temperature", [None, 0.7])
def test_draws_what_the_engines_torch_sampler_draws(temperature):
    logits, _ = draw(5, 3001, torch.float32, seed=4)
    params = SamplingParams(temperature=temperature or 0.0)
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    want_tokens, want_logprobs = sample(logits, params, gen)
    gen = torch.Generator(device=DEVICE).manual_seed(9)  # the same draws: the torch sampler's noise, given
    noise = None if params.greedy else torch.empty(logits.shape, device=DEVICE).exponential_(1.0, generator=gen)
    tokens, logprobs, _ = ks.fused_sample(logits, noise, params.temperature)
    assert_same_draw(tokens, want_tokens, logits, noise, temperature)
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-6, rtol=2e-6)


@needs_triton
def test_ties_go_to_the_first_index_across_chunks_and_strided_rows_are_read():
    vocab = 4000  # several chunks of 1024 on a CPU's 8 "SMs" at one row
    wide = torch.zeros(3, vocab + 37, device=DEVICE)  # rows strided by vocab + 37
    logits = wide[:, :vocab]
    logits[0, 5] = logits[0, 3500] = 2.0  # a tie across chunks
    logits[1, 2048] = logits[1, 2049] = 1.0  # a tie inside a block
    tokens, logprobs, _ = ks.fused_sample(logits, None, 1.0)
    assert tokens.tolist() == [5, 2048, 0]  # row 2: all equal, the first
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0], atol=2e-6, rtol=2e-6)
    assert ks._chunking(1, vocab, logits.device)[1] > 1


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [None, 0.9])
def test_chunks_of_several_blocks_rescale_and_keep_the_first_of_a_tie(monkeypatch, dtype, temperature):
    # few chunks, each of several BLOCKs: the block loop's rescaling (chunks of 3 BLOCKs whatever the SM count)
    monkeypatch.setattr(ks, "_chunking", lambda rows, vocab, device: (3 * ks.BLOCK, -(-vocab // (3 * ks.BLOCK))))
    logits, noise = draw(3, 9001, dtype, seed=3)
    assert ks._chunking(3, 9001, logits.device)[0] >= 3 * ks.BLOCK
    noise = None if temperature is None else noise
    logits[0, 100] = logits[0, 1500] = 50.0  # a tie between two blocks of one chunk (greedy: the first)
    logits[1, 100] = logits[1, 100 + ks.BLOCK] = 50.0  # the same lane of two blocks: the lane keeps the first
    tokens, logprobs, _ = ks.fused_sample(logits, noise, temperature or 1.0)
    ref_tokens, _, _ = ks.fused_sample_ref(logits, noise, temperature or 1.0)
    assert_same_draw(tokens, ref_tokens, logits, noise, temperature)
    if temperature is None:
        assert tokens[0].item() == 100 and tokens[1].item() == 100
    expected = (logits.float() / (temperature or 1.0)).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected, atol=2e-6, rtol=2e-6)


@needs_triton
def test_a_non_finite_logit_is_reported_for_its_row_only():
    logits, noise = draw(4, 2000, torch.float32, seed=1)
    logits[1, 1500] = float("nan")
    logits[3, 7] = float("inf")
    _, _, finite = ks.fused_sample(logits, noise, 1.0)
    assert finite.tolist() == [True, False, True, False]


def test_the_switch_is_on_by_default_for_cuda_only_and_checked():
    from kvroll.kernels.fusions import resolve_fusions

    assert resolve_fusions({"fused_sampling": None}, "cuda") == {"fused_sampling": True}  # measured (session 12)
    assert resolve_fusions({"fused_sampling": None}, "cpu") == {"fused_sampling": False}
    with pytest.raises(ValueError, match="RolloutEngine.fused_sampling='on' is invalid"):
        RolloutEngine(tiny_model("llama"), fused_sampling="on")
    assert ks.plain(SamplingParams()) and not ks.plain(SamplingParams(top_p=0.9))
    assert not ks.plain(SamplingParams(repetition_penalty=1.1)) and not ks.plain(SamplingParams(top_k=5))
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fused_sampling=True but the model is on cpu"):
            RolloutEngine(tiny_model("llama"), fused_sampling=True)


@needs_triton
@pytest.mark.parametrize("vocab", [1, 1023, 1025, 5000])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.6, 1.3])
def test_noise_drawn_in_the_kernel_is_the_exp_noise_draw(vocab, rows, dtype, temperature, monkeypatch):
    monkeypatch.setattr(ks, "INVERSE_CDF", False)  # the Gumbel-max arm of the in-kernel draw
    logits, _ = draw(rows, vocab, dtype, seed=vocab + rows)
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(vocab))
    rng[1] = 41  # a later step
    noise = ks.exp_noise(rows, vocab, rng)
    tokens, logprobs, finite = ks.fused_sample(logits, None, temperature, rng=rng)
    assert rng[1].item() == 42  # the step advanced, the seed kept
    want_tokens, want_logprobs, _ = ks.fused_sample(logits, noise, temperature)
    assert torch.equal(tokens, want_tokens)  # the same fp32 noise, the same scores: exactly the same draw
    torch.testing.assert_close(logprobs, want_logprobs, atol=0, rtol=0)
    ref_tokens, _, _ = ks.fused_sample_ref(logits, noise, temperature)
    assert_same_draw(tokens, ref_tokens, logits, noise, temperature)
    assert finite.all()


@needs_triton
def test_noise_drawn_in_several_block_chunks_is_the_exp_noise_draw(monkeypatch):
    # chunks of several BLOCKs (3, whatever the SM count): the per-block counters of one program
    monkeypatch.setattr(ks, "INVERSE_CDF", False)
    monkeypatch.setattr(ks, "_chunking", lambda rows, vocab, device: (3 * ks.BLOCK, -(-vocab // (3 * ks.BLOCK))))
    logits, _ = draw(3, 9001, torch.bfloat16, seed=8)
    assert ks._chunking(3, 9001, logits.device)[0] >= 3 * ks.BLOCK
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(8))
    noise = ks.exp_noise(3, 9001, rng)
    tokens, logprobs, _ = ks.fused_sample(logits, None, 0.9, rng=rng)
    want_tokens, want_logprobs, _ = ks.fused_sample(logits, noise, 0.9)
    assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)


if ks.triton is not None:
    import triton
    import triton.language as tl

    @triton.jit
    def _uniform_kernel(bits_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(out_ptr + offs, ks._uniform(tl.load(bits_ptr + offs).to(tl.uint32, bitcast=True)))


@needs_triton
def test_the_uniform_is_exact_and_never_zero_or_one():
    bits = [0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1]  # the extreme and the rounding-edge patterns
    words = torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32, device=DEVICE)
    out = torch.empty(len(bits), dtype=torch.float32, device=DEVICE)
    _uniform_kernel[(1,)](words, out, N=len(bits))
    want = torch.tensor([((b >> 9) + 0.5) / 2**23 for b in bits], dtype=torch.float64)  # exact in fp64
    assert torch.equal(out.cpu().double(), want)  # so exact in fp32 too: no rounding up to 1
    assert out.min().item() == 2.0**-24 and out.max().item() == 1 - 2.0**-24
    assert ((out > 0) & (out < 1)).all() and torch.isfinite(-torch.log(-torch.log(out.double()))).all()


@needs_triton
def test_exp_noise_is_exponential_fresh_each_step_and_reproducible():
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    rng = ks.new_rng_state(DEVICE, gen)
    first = ks.exp_noise(48, 5000, rng)
    assert torch.equal(ks.exp_noise(48, 5000, rng), first)  # the state alone decides the draw
    x = first.flatten().double()
    assert (x > 0).all() and torch.isfinite(x).all()
    n = x.numel()
    for q in (0.05, 0.3, 1.0, 2.0, 5.0):  # the empirical CDF against 1 - exp(-q), within 5 standard errors
        p = 1 - torch.exp(torch.tensor(-q, dtype=torch.float64))
        assert abs((x <= q).double().mean() - p) < 5 * (p * (1 - p) / n).sqrt(), q
    rng[1] += 1
    second = ks.exp_noise(48, 5000, rng).flatten().double()
    assert (second != x).float().mean() > 0.999
    assert abs(torch.corrcoef(torch.stack([x, second]))[0, 1]) < 0.02  # the next step's noise is not this one's
    rows = first.double()
    assert abs(torch.corrcoef(rows[:2])[0, 1]) < 0.05  # nor is the next row's
    gen.manual_seed(7)
    ks.reseed(rng, gen)  # the same generator seed: the same state again
    assert rng[1].item() == 0 and torch.equal(ks.exp_noise(48, 5000, rng), first)


def assert_inverse_cdf(tokens, logits, temperature, u):
    """Each token is the one whose CDF interval holds u * total (fp64), within 1e-6 of the total at its edges (the
    fp32 rounding of the kernel's partial sums moves the edges by about that much), and most rows are exactly the
    reference's."""
    slack, exact = ks.inverse_cdf_slack(tokens, logits, temperature, u)
    assert slack <= 1e-6, (slack, tokens, u)
    assert exact >= 0.9, (exact, tokens)


@needs_triton
@pytest.mark.parametrize("vocab", [1, 1023, 1025, 5000])
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3])
def test_the_inverse_cdf_draw_is_the_fp64_inverse_cdf_at_its_uniform(vocab, rows, dtype, temperature):
    logits, _ = draw(rows, vocab, dtype, seed=vocab + rows + 1)
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(vocab + rows))
    rng[1] = 17  # a later step
    u = ks.row_uniforms(rows, rng)
    assert u.dtype == torch.float64 and rng[1].item() == 17  # not advanced by row_uniforms
    tokens, logprobs, finite = ks.fused_sample(logits, None, temperature, rng=rng)
    assert rng[1].item() == 18 and finite.all()
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert_inverse_cdf(tokens, logits, temperature, u)
    expected = (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=4e-6, rtol=0)


@needs_triton
@pytest.mark.parametrize("part, unroll, chunk_parts", [(256, 1, 1), (256, 2, 3), (128, 4, 2)])
def test_the_inverse_cdf_over_parts_loads_and_chunks(part, unroll, chunk_parts, monkeypatch):
    # several parts per load and several loads per chunk program; vocabularies that end inside a load and a part
    monkeypatch.setattr(ks, "ICDF_PART", part)
    monkeypatch.setattr(ks, "ICDF_UNROLL", unroll)
    size = part * unroll * chunk_parts
    monkeypatch.setattr(ks, "_icdf_chunking", lambda rows, vocab, device: (size, -(-vocab // size)))
    for vocab in (part * unroll * 5 + 3, 4097):
        logits, _ = draw(4, vocab, torch.bfloat16, seed=vocab)
        rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(vocab))
        u = ks.row_uniforms(4, rng)
        tokens, logprobs, finite = ks.fused_sample(logits, None, 0.9, rng=rng)
        assert finite.all()
        assert_inverse_cdf(tokens, logits, 0.9, u)
        expected = (logits.double() / 0.9).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logprobs.double(), expected, atol=4e-6, rtol=0)


@needs_triton
def test_the_inverse_cdf_never_draws_a_zero_probability_entry():
    # the mass in the first entry, the last entry, or a few in the middle (the rest underflow to probability 0):
    # whatever u is, the clamps keep the draw inside the entries with mass
    vocab, rows = 3000, 64
    cases = {"first": [0], "last": [vocab - 1], "middle": [1030, 1031, 2047, 2048]}
    for name, live in cases.items():
        logits = torch.full((rows, vocab), -1e4, device=DEVICE)
        logits[:, live] = 0.0
        rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(len(live)))
        tokens, logprobs, finite = ks.fused_sample(logits, None, 1.0, rng=rng)
        assert finite.all() and set(tokens.tolist()) <= set(live), (name, tokens.tolist())
        torch.testing.assert_close(logprobs, torch.full_like(logprobs, -float(torch.tensor(len(live)).log())),
                                   atol=1e-6, rtol=0)
    logits = torch.randn(3, vocab, device=DEVICE)
    logits[1, 5] = float("nan")
    tokens, _, finite = ks.fused_sample(logits, None, 1.0, rng=ks.new_rng_state(DEVICE))
    assert finite.tolist() == [True, False, True] and ((tokens >= 0) & (tokens < vocab)).all()


@needs_triton
def test_row_uniforms_are_uniform_fresh_each_step_and_reproducible():
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    rng = ks.new_rng_state(DEVICE, gen)
    first = ks.row_uniforms(1000, rng)
    assert torch.equal(ks.row_uniforms(1000, rng), first)  # the state alone decides the draw
    x = first.cpu()
    assert ((x > 0) & (x < 1)).all() and len(set(x.tolist())) == len(x)
    for q in (0.01, 0.25, 0.5, 0.9, 0.999):  # the empirical CDF against q, within 5 standard errors
        assert abs((x <= q).double().mean() - q) < 5 * (q * (1 - q) / len(x)) ** 0.5, q
    assert abs(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1]) < 0.15  # the next row's is not this one's (5 sd)
    rng[1] += 1
    second = ks.row_uniforms(1000, rng).cpu()
    assert abs(torch.corrcoef(torch.stack([x, second]))[0, 1]) < 0.15  # nor the next step's
    assert (x * 2**52).frac().eq(0.5).all()  # 52 bits: (k + 1/2) * 2^-52, exact


@needs_triton
@pytest.mark.parametrize("inverse_cdf", [True, False])
def test_in_kernel_draws_follow_the_softmax(inverse_cdf, monkeypatch):
    monkeypatch.setattr(ks, "INVERSE_CDF", inverse_cdf)
    rows, vocab, temperature = 800, 6, 0.7  # every expected count >= 12
    base = torch.tensor([1.0, 0.2, -0.5, 1.5, 0.0, -1.0])
    logits = base.repeat(rows, 1).to(DEVICE)
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(11))
    tokens, _, _ = ks.fused_sample(logits, None, temperature, rng=rng)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    expected = (base.double() / temperature).softmax(-1) * rows
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.7, (counts.tolist(), expected.tolist())  # 5 degrees of freedom: p = 1e-4


@needs_triton
@pytest.mark.parametrize("policy, temperature", [("full", 0.0), ("longflow", 0.0), ("full", 0.8), ("longflow", 0.8),
                                                 ("rkv", 1.0)])
def test_engine_with_the_fused_sampler(policy, temperature, monkeypatch):
    """Greedy: the torch sampler's completions. Sampled: reproducible from the seed, a new seed draws anew, and
    (``full``) each logprob is the model's log-softmax at T of the token, teacher-forced through HF's forward."""
    from kvroll.rollout import graphs

    calls = []  # the vocabulary of each fused call: the engine's batches of <= 64 rows take head_sample
    monkeypatch.setattr(graphs, "fused_sample", lambda *a, **k: calls.append(a[0].shape) or ks.fused_sample(*a, **k))
    monkeypatch.setattr(graphs, "head_sample", lambda *a, **k: calls.append(a[1].shape[:1]) or ks.head_sample(*a, **k))
    model = tiny_model("qwen3").to(DEVICE)
    compression = CompressionConfig(policy, None if policy == "full" else 24)
    prompts = [[5, 9, 33, 7, 81], [2, 200, 14], [40, 41]]
    runs = {}
    for fused, seed in ((False, 5), (True, 5), (True, 5), (True, 6)):
        params = SamplingParams(max_new_tokens=20, temperature=temperature, seed=seed, ignore_eos=True)
        engine = RolloutEngine(model, compression=compression, max_batch=4, fused_sampling=fused)
        assert engine.fused_sampling is fused
        runs.setdefault((fused, seed), []).append(engine.generate(prompts, params, n=2))
        engine.close()
    assert calls and calls[0][-1] == model.config.vocab_size  # the fused path ran (captured once, with graphs)
    ids = {key: [[c.token_ids for c in run] for run in value] for key, value in runs.items()}
    assert ids[(True, 5)][0] == ids[(True, 5)][1]  # the seed reproduces the run
    if temperature == 0.0:
        assert ids[(True, 5)][0] == ids[(False, 5)][0] == ids[(True, 6)][0]
        for got, want in zip(runs[(True, 5)][0], runs[(False, 5)][0]):
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=2e-5, rtol=0)
        return
    assert ids[(True, 6)][0] != ids[(True, 5)][0]  # another seed, other draws
    if policy != "full":
        return
    for comp in runs[(True, 5)][0]:  # the first token comes from the prefill's torch sampler, the rest from the kernel
        seq = torch.tensor([comp.prompt_ids + comp.token_ids], device=DEVICE)
        with torch.no_grad():
            logits = model(seq).logits[0, len(comp.prompt_ids) - 1 : -1].float()
        want = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(comp.token_ids, device=DEVICE)[:, None])
        torch.testing.assert_close(torch.tensor(comp.logprobs), want[:, 0].cpu(), atol=2e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_vocabulary(rows, dtype):
    logits, noise = draw(rows, 151936, dtype, seed=rows, device="cuda")
    for temperature, eps in ((1.0, noise), (None, None)):
        tokens, logprobs, finite = ks.fused_sample(logits, eps, temperature or 1.0)
        ref_tokens, _, _ = ks.fused_sample_ref(logits, eps, temperature or 1.0)
        assert_same_draw(tokens, ref_tokens, logits, eps, temperature)
        expected = (logits.float() / (temperature or 1.0)).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0)
        assert finite.all()
    rng = ks.new_rng_state("cuda", torch.Generator(device="cuda").manual_seed(rows))
    for temperature in (1.0, 0.7):  # the inverse CDF (the default in-kernel draw)
        u = ks.row_uniforms(rows, rng)
        tokens, logprobs, finite = ks.fused_sample(logits, None, temperature, rng=rng)
        assert_inverse_cdf(tokens, logits, temperature, u)
        expected = (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        torch.testing.assert_close(logprobs.double(), expected, atol=2e-5, rtol=0)
        assert finite.all()
    ks_inverse, ks.INVERSE_CDF = ks.INVERSE_CDF, False  # the Gumbel-max arm
    try:
        rng[1] = 0
        noise = ks.exp_noise(rows, 151936, rng)
        tokens, logprobs, _ = ks.fused_sample(logits, None, 1.0, rng=rng)
    finally:
        ks.INVERSE_CDF = ks_inverse
    assert (noise > 0).all() and torch.isfinite(noise).all()  # E = 0 would make an entry's score +inf
    want_tokens, want_logprobs, _ = ks.fused_sample(logits, noise, 1.0)
    assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs) and rng[1].item() == 1


@needs_triton
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_inverse_cdf_at_the_largest_uniform_stays_on_the_last_entry_with_mass(temperature):
    """u = 1 - 2^-53, the largest uniform ``_row_uniform`` draws: the block's fp32 partial sum may round above the
    fp64 sum of its entries, so that u * total passes every entry of the last block; the clamp keeps the draw on
    its last entry with mass, and the logprob is that entry's (fp64 log_softmax), never z = 0's."""
    rows, vocab = 16, 2 * ks.ICDF_PART + 300
    logits, _ = draw(rows, vocab, torch.float32, seed=77)
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(7))
    state = ks._icdf_mass(logits, temperature, rng)  # the sampler's own two kernels, u set in between
    state["u"].fill_(1.0 - 2.0 ** -53)
    tokens, logprobs, finite = ks._icdf_pick(logits, temperature, rng, state)
    parts, u = state["parts"], state["u"]
    assert finite.all() and (tokens < vocab).all() and (tokens >= (parts - 1) * ks.ICDF_PART).all()
    slack, _ = ks.inverse_cdf_slack(tokens, logits, temperature, u)  # the fp64 inverse CDF at u, up to rounding
    assert slack <= 1e-6, (slack, tokens)
    expected = (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs.double(), expected, atol=4e-6, rtol=0)


@needs_triton
@pytest.mark.parametrize("dead_tail", [ks.ICDF_PART + 300, 200])  # whole parts of -inf, or the last part's tail
def test_the_inverse_cdf_at_the_largest_uniform_never_draws_a_masked_tail(dead_tail):
    """u = 1 - 2^-53 with the vocabulary's last entries at -inf (zero mass; a masked or padded vocabulary): u * total
    may round to the total itself, so that every part and entry passes it; the clamps keep the draw on the last
    entry with mass, never in the -inf tail, and its logprob finite."""
    rows, vocab = 16, 3 * ks.ICDF_PART + 300
    logits, _ = draw(rows, vocab, torch.float32, seed=78)
    logits[:, vocab - dead_tail:] = float("-inf")
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(8))
    state = ks._icdf_mass(logits, 1.0, rng)
    state["u"].fill_(1.0 - 2.0 ** -53)
    tokens, logprobs, _ = ks._icdf_pick(logits, 1.0, rng, state)
    assert (tokens < vocab - dead_tail).all(), tokens
    assert torch.isfinite(logprobs).all(), logprobs
    slack, _ = ks.inverse_cdf_slack(tokens, logits, 1.0, state["u"])
    assert slack <= 1e-6, (slack, tokens)


@needs_triton
def test_the_inverse_cdf_clamps_to_the_last_part_with_mass_where_the_parts_total_rounds_above_their_cumsum():
    """Parts of mass 1, a, a, a (a = 0.75 * 2^-53) then four parts of -inf: the cumulative sum stays at 1 (each a is
    under half an ulp of 1) while a pairwise total takes 1 + 2a = 1 + 2^-52, so u * total at u = 1 - 2^-53 rounds to
    1 and every part, the -inf ones too, has cumulative mass at or below it: the clamp to the last part with mass
    keeps the draw there, never past the vocabulary's live entries."""
    part, rows = ks.ICDF_PART, 2
    vocab = 8 * part - 100
    logits = torch.full((rows, vocab), float("-inf"), device=DEVICE)
    logits[:, 0] = 0.0
    small = torch.tensor(0.75 * 2.0 ** -53, dtype=torch.float64).log().item()
    for p in (1, 2, 3):
        logits[:, p * part + 5] = small
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(9))
    state = ks._icdf_mass(logits, 1.0, rng)
    state["u"].fill_(1.0 - 2.0 ** -53)
    tokens, logprobs, _ = ks._icdf_pick(logits, 1.0, rng, state)
    assert torch.isfinite(logits.gather(-1, tokens[:, None])).all(), tokens
    assert torch.isfinite(logprobs).all(), logprobs


@needs_triton
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_the_inverse_cdf_draw_reports_a_non_finite_logit_for_its_row_only(bad):
    """The in-kernel draw (``rng=``, the inverse CDF's mass kernel) flags +-inf as NaN, in any chunk of its row."""
    logits, _ = draw(3, 2 * ks.ICDF_PART + 37, torch.float32, seed=5)
    logits[1, 2 * ks.ICDF_PART + 3] = bad
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(3))
    _, _, finite = ks.fused_sample(logits, None, 0.8, rng=rng)
    assert finite.tolist() == [True, False, True]


@needs_triton
def test_an_empty_batch_draws_nothing():
    """[0, vocab] logits: empty outputs, as head_sample's (the chunking divided by the row count)."""
    for kwargs in (dict(noise=None, temperature=1.0), dict(noise=torch.empty(0, 50), temperature=1.0),
                   dict(noise=None, temperature=0.7, rng=ks.new_rng_state("cpu"))):
        tokens, logps, finite = ks.fused_sample(torch.empty(0, 50), **kwargs)
        assert tokens.shape == logps.shape == finite.shape == (0,)
        assert (tokens.dtype, logps.dtype, finite.dtype) == (torch.int64, torch.float32, torch.bool)
