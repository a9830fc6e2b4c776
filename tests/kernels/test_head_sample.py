"""The output head fused with the draw (``kvroll/kernels/sample.py``: ``head_sample``) against its fp64 reference,
the fused sampler and the engine.

CPU (CI), under ``TRITON_INTERPRET=1``: odd vocabularies (one entry, one tile +- 1, several tiles), hidden sizes
that the K tile does (64, 96) and does not (40, 80) divide, 1-70 rows (each of ``head_config``'s row tiles, several
row blocks), fp32 / fp16 weights, greedy and three temperatures. Tokens: the reference's, except where two
candidates' scores agree to rounding (``assert_same_draw``); logprobs within 2e-5 of log_softmax of the reference
logits (5e-4 in fp16: the kernel rounds its fp32 sum, the reference its fp64 one, so a few logits may round to the
neighbouring value and move the log-sum-exp; on these seeds no drawn token's own logit does). With ``rng``: on
tiles narrower than ``TILE_DRAW_MIN_BN`` the draw of ``fused_sample`` on those logits with ``exp_noise``'s tensor
(its Gumbel arm), on wider ones (and on every width with the threshold at 0) the tile draw's fp64 reference at
``tile_uniforms``' uniforms except at a rounding from an edge, and the tile draws follow softmax(z) (a chi-square
test); the state advanced once. A
non-finite hidden row is reported for its row alone, and a row of NaN logits still draws an index of the vocabulary. The
rule's tiles fit the device's shared memory or give way to cuBLAS. In the engine: sampled completions with the fused
head equal the fused sampler's Gumbel arm (the same noise), greedy ones the torch sampler's; the tile draw's are
reproducible from the seed and their logprobs the model's (teacher-forced); ``plain_head`` takes
only a bias-free, hook-free head of the four families in the model's dtype. GPU (``gpu``): Qwen3-1.7B's head (2,048
x 151,936, bf16).
"""
import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.kernels import sample as ks
from kvroll.rollout import graphs
from tests.conftest import tiny_model
from tests.kernels.test_sample import DEVICE, assert_same_draw, needs_triton


def head(rows, vocab, hidden, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) * (3.0 / hidden ** 0.5)  # logits of std ~3
    return h.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def reference_logits(h, w):
    return (h.double() @ w.double().T).to(w.dtype)


def assert_same_tile_draw(tokens, logits, temperature, uv, bn):
    """``tokens`` equal ``head_tile_draw_ref``'s except at a rounding from its edges: where the two tiles' fp64
    scores agree to 1e-5 (relative), or, in the same tile, where u times the tile's mass lies within 1e-5 of it
    from the kernel's token's CDF interval."""
    ref, score, cdf, target = ks.head_tile_draw_ref(logits, temperature, uv, bn)
    rows = torch.arange(len(tokens), device=tokens.device)
    tile, ref_tile = tokens // bn, ref // bn
    c = cdf[rows, tile]  # the kernel's tile's cumulative masses, fp64
    j = tokens % bn
    upper, lower = c[rows, j], torch.where(j > 0, c[rows, (j - 1).clamp(min=0)], torch.zeros_like(c[:, 0]))
    t = target[rows, tile]
    edge = torch.maximum(lower - t, t - upper).clamp(min=0) <= 1e-5 * c[:, -1]
    near_tie = (score[rows, tile] - score[rows, ref_tile]).abs() <= 1e-5 * score[rows, ref_tile].abs().clamp(min=1)
    differ = tokens != ref
    assert (edge & ((tile == ref_tile) | near_tie))[differ].all(), (tokens, ref)
    assert differ.float().mean() <= 0.05  # edges are rare: most rows agree exactly
    return ref


def check(h, w, temperature, rng):
    bn = ks.head_tiles(h.shape[0], h.dtype, h.device)[1]
    tile_draw = rng is not None and ks.tile_draw(bn)
    noise = ks.exp_noise(h.shape[0], w.shape[0], rng) if rng is not None and not tile_draw else None
    uv = ks.tile_uniforms(h.shape[0], -(-w.shape[0] // bn), rng) if tile_draw else None
    step = None if rng is None else rng[1].item()
    tokens, logprobs, finite = ks.head_sample(h, w, temperature or 1.0, rng=rng)
    logits = reference_logits(h, w)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and finite.all()
    if tile_draw:
        assert_same_tile_draw(tokens, logits, temperature, uv, bn)
    else:
        ref_tokens, _, _ = ks.fused_sample_ref(logits, noise, temperature or 1.0)
        assert_same_draw(tokens, ref_tokens, logits, noise, temperature)
    z = logits.float() / (temperature or 1.0)
    expected = z.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    # fp32: the sum's order alone; in half precision a few logits may round to the neighbour of the reference's
    atol = 2e-5 if w.dtype == torch.float32 else 5e-4
    torch.testing.assert_close(logprobs, expected, atol=atol, rtol=0)
    if rng is not None:
        assert rng[1].item() == step + 1  # the next step draws anew
    return tokens


@needs_triton
@pytest.mark.parametrize("vocab", [1, 63, 65, 1000])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (3, 40), (17, 96), (40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("temperature", [None, 0.7, 1.0])  # None: greedy
def test_matches_the_fp64_reference(vocab, rows, hidden, dtype, temperature):
    h, w = head(rows, vocab, hidden, dtype, seed=vocab + rows)
    rng = None if temperature is None else ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(rows))
    check(h, w, temperature, rng)


@needs_triton
@pytest.mark.parametrize("vocab", [63, 1000])
@pytest.mark.parametrize("rows, hidden", [(1, 64), (17, 96), (40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_tile_draw_matches_its_fp64_reference(vocab, rows, hidden, dtype, temperature, monkeypatch):
    """The tile draw on every tile width (``TILE_DRAW_MIN_BN`` 0), against ``head_tile_draw_ref`` at the same
    uniforms."""
    monkeypatch.setattr(ks, "TILE_DRAW_MIN_BN", 0)
    h, w = head(rows, vocab, hidden, dtype, seed=vocab + rows + 1)
    check(h, w, temperature, ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(rows + 5)))


def test_the_tile_draw_takes_the_wide_tiles_only(monkeypatch):
    assert ks.tile_draw(128) and ks.tile_draw(256) and not ks.tile_draw(64) and not ks.tile_draw(32)
    assert ks.head_config(48)[1] == 128 and ks.head_config(64)[1] == 64  # the rule's: 33-48 rows draw per tile
    monkeypatch.setattr(ks, "TILE_DRAW", False)
    assert not ks.tile_draw(128)


@needs_triton
@pytest.mark.parametrize("config", [(16, 32, 32, 4, 2), (32, 256, 32, 4, 2), (64, 128, 128, 4, 3)])
@pytest.mark.parametrize("min_bn", [0, 1 << 30])  # the tile draw, the Gumbel arm
def test_every_tile_shape_gives_the_reference_draw(config, min_bn, monkeypatch):
    """Tiles other than the rule's (BN 32-256, BK 32-128): tile edges, the noise's counters inside a BLOCK."""
    monkeypatch.setattr(ks, "HEAD_CONFIG", {1: config})
    monkeypatch.setattr(ks, "TILE_DRAW_MIN_BN", min_bn)
    h, w = head(5, 1100, 96, torch.float32, seed=1)
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(2))
    check(h, w, 0.8, rng)
    check(h, w, None, None)


@needs_triton
@pytest.mark.parametrize("temperature", [0.9, 1.0])
def test_the_tile_draws_follow_the_softmax(temperature, monkeypatch):
    """The tile draw is exact: 1,500 rows of one set of 40 logits, in tiles of 16 (the last one half full), drawn
    in proportion to softmax(z) (a chi-square test over the 40 entries); the uniforms lie inside (0, 1)."""
    monkeypatch.setattr(ks, "HEAD_CONFIG", {1: (64, 16, 16, 4, 2)})
    monkeypatch.setattr(ks, "TILE_DRAW_MIN_BN", 0)
    rows, vocab = 1500, 40
    base = torch.linspace(-1.6, 1.4, vocab)[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))]
    w = torch.zeros(vocab, 16)
    w[:, 0] = base  # h = e0: the logits are the base, exactly
    h = torch.zeros(rows, 16)
    h[:, 0] = 1.0
    rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(12))
    uv = ks.tile_uniforms(rows, 3, rng)
    assert ((uv > 0) & (uv < 1)).all()
    tokens, _, _ = ks.head_sample(h.to(DEVICE), w.to(DEVICE), temperature, rng=rng)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    expected = (base.double() / temperature).softmax(-1) * rows  # every expected count >= 4.5
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 80.9, (counts.tolist(), expected.tolist())  # 39 degrees of freedom: p = 1e-4


@needs_triton
def test_the_gumbel_arm_is_the_fused_samplers_on_the_same_logits(monkeypatch):
    """With ``TILE_DRAW`` off the noise of entry (row, column) is ``exp_noise``'s, whatever the tile: token for token
    the draw of ``fused_sample``'s Gumbel arm (its chunks of 1,024) on the reference logits, the logprob within
    rounding."""
    monkeypatch.setattr(ks, "TILE_DRAW", False)
    monkeypatch.setattr(ks, "INVERSE_CDF", False)  # fused_sample's default is the CDF
    h, w = head(6, 3000, 64, torch.float32, seed=3)
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    rng = ks.new_rng_state(DEVICE, gen)
    want_tokens, want_logprobs, _ = ks.fused_sample(reference_logits(h, w), None, 1.0, rng=rng.clone())
    tokens, logprobs, _ = ks.head_sample(h, w, 1.0, rng=rng)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logprobs, want_logprobs, atol=2e-5, rtol=0)


@needs_triton
def test_a_non_finite_hidden_row_is_reported_for_its_row_only():
    h, w = head(4, 300, 64, torch.float32, seed=5)
    h[1, 3] = float("inf")
    h[2, 0] = float("nan")
    _, _, finite = ks.head_sample(h, w, 1.0)
    assert finite.tolist() == [True, False, False, True]


def test_the_rule_fuses_up_to_64_rows_in_the_shared_memory_it_has(monkeypatch):
    assert all(ks.head_config(rows)[0] >= min(rows, 64) for rows in (1, 16, 17, 32, 33, 48, 49, 64))
    assert ks.head_config(65) is None and ks.head_config(256) is None
    monkeypatch.setattr(ks, "HEAD_CONFIG", {1: (16, 64, 64, 4, 2)})  # a benchmark's tiles: not the engine's rule
    assert ks.head_config(128) is None
    monkeypatch.setattr(ks, "block_shared_memory", lambda device: 64 * 1024)  # a T4's: fewer stages, or none
    bm, bn, bk, _, stages = ks.head_config(16, torch.float16)  # 4 stages of its tiles: 80 KB
    assert 2 <= stages < 4 and stages * (bm * bk + bk * bn) * 2 <= 64 * 1024
    assert ks.head_config(8, torch.float32) is None and ks.head_config(64, torch.float32)[4] == 2  # 64 KB


def test_the_h200_rule(monkeypatch):
    """On an H200 (its name; session 42): ``head_sample`` up to ``H200_HEAD_MAX_ROWS`` rows in 128-wide tiles (so the
    tile draw), cuBLAS's head and ``fused_sample`` above; another GPU, no device or ``DEVICE_HEAD`` off keep the
    H100's rule."""
    from kvroll.kernels import pdl_gemm
    names = {0: "NVIDIA H200", 1: "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(pdl_gemm, "_is_h200", lambda index: "H200" in names[index])
    monkeypatch.setattr(ks, "block_shared_memory", lambda device: 227 * 1024)
    h200, h100 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert ks.H200_HEAD_MAX_ROWS == 32
    for rows in (1, 16):
        assert ks.head_config(rows, device=h200) == (16, 128, 128, 4, 3)
    for rows in (17, 32):
        assert ks.head_config(rows, device=h200) == (32, 128, 128, 4, 3)
    assert all(ks.tile_draw(ks.head_config(rows, device=h200)[1]) for rows in (1, 32))
    assert all(ks.head_config(rows, device=h200) is None for rows in (33, 48, 64, 65))
    for rows in (1, 16, 17, 32, 33, 48, 49, 64, 65):
        assert ks.head_config(rows, device=h100) == ks.head_config(rows) == ks.head_config(rows, device="cpu")
    assert ks.head_config(48, device=h100) == (64, 128, 64, 4, 4)
    monkeypatch.setattr(ks, "DEVICE_HEAD", False)
    assert ks.head_config(64, device=h200) == ks.head_config(64) == (64, 64, 64, 4, 4)


@needs_triton
def test_rows_past_one_row_tile(monkeypatch):
    """70 rows in tiles of 16 and 32 (several row blocks, the last partial), K in partial tiles."""
    for config in ((16, 64, 64, 4, 2), (32, 128, 32, 4, 2)):
        monkeypatch.setattr(ks, "HEAD_CONFIG", {1: config})
        h, w = head(70, 700, 80, torch.float32, seed=8)
        rng = ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(9))
        check(h, w, 0.9, rng)


@needs_triton
@pytest.mark.parametrize("rng_seed", [None, 3])  # greedy, sampled
@pytest.mark.parametrize("min_bn", [0, 1 << 30])  # the tile draw, the Gumbel arm (the rule's 64-wide tiles)
def test_a_row_of_nan_logits_draws_an_index_of_the_vocabulary(rng_seed, min_bn, monkeypatch):
    """All its logits NaN, the row is reported and its token is still an index (the next step embeds it); with a
    power-of-two number of tiles (4 of 64) no padding part of the merge supplies one."""
    monkeypatch.setattr(ks, "TILE_DRAW_MIN_BN", min_bn)
    h, w = head(3, 256, 64, torch.float32, seed=10)
    w[:, 5] = float("nan")  # every logit of a row with h[row, 5] != 0
    h[0, 5], h[2, 5] = 0.0, 0.0
    rng = None if rng_seed is None else ks.new_rng_state(DEVICE, torch.Generator(device=DEVICE).manual_seed(rng_seed))
    tokens, _, finite = ks.head_sample(h, w, 1.0, rng=rng)
    assert finite.tolist() == [False, False, False]  # 0 * NaN is NaN: every row
    assert ((tokens >= 0) & (tokens < 256)).all(), tokens


def test_plain_head_takes_a_bias_free_head_of_the_four_families_only():
    assert graphs.plain_head(tiny_model("qwen3")) is not None
    llama = tiny_model("llama")
    assert graphs.plain_head(llama) is llama.lm_head.weight
    llama.lm_head.bias = torch.nn.Parameter(torch.zeros(llama.config.vocab_size))
    assert graphs.plain_head(llama) is None  # logits = h @ W^T + b: not the kernel's
    assert graphs.plain_head(llama.model) is None  # no head at all
    qwen = tiny_model("qwen3")
    handle = qwen.lm_head.register_forward_pre_hook(lambda module, args: None)  # e.g. a cast to fp32: skipped
    assert graphs.plain_head(qwen) is None
    handle.remove()
    assert graphs.plain_head(qwen) is not None
    qwen.lm_head.to(torch.bfloat16)  # a head in another dtype than the model's hidden states
    assert graphs.plain_head(qwen) is None


@needs_triton
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_engine_completions_with_the_fused_head_are_the_fused_samplers(temperature, monkeypatch):
    """The same seed, with and without the head in the kernel (``HEAD_MAX_ROWS`` 0, ``fused_sample``'s Gumbel arm;
    ``TILE_DRAW`` off, so the head draws with the same noise): the same tokens, logprobs within rounding; the head
    path ran."""
    monkeypatch.setattr(ks, "INVERSE_CDF", False)
    monkeypatch.setattr(ks, "TILE_DRAW", False)
    calls = []
    monkeypatch.setattr(graphs, "head_sample", lambda *a, **k: calls.append(a[0].shape) or ks.head_sample(*a, **k))
    # the tiny model is fp32, whose head stays with cuBLAS on a GPU (plain_head): taken here on every device
    monkeypatch.setattr(graphs, "plain_head", lambda model: model.lm_head.weight)
    model = tiny_model("qwen3").to(DEVICE)
    prompts = [[5, 9, 33, 7, 81], [2, 200, 14], [40, 41]]
    runs = {}
    for max_rows in (64, 0):
        monkeypatch.setattr(ks, "HEAD_MAX_ROWS", max_rows)
        params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=7, ignore_eos=True)
        engine = RolloutEngine(model, compression=CompressionConfig("longflow", 24), max_batch=4, fused_sampling=True)
        runs[max_rows] = engine.generate(prompts, params, n=2)
        engine.close()
        if max_rows:
            assert calls and all(shape[1] == model.config.hidden_size for shape in calls)
            calls.clear()
        else:
            assert not calls
    for got, want in zip(runs[64], runs[0]):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=2e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 32, 48, 64])  # 48: the tile draw (128-wide tiles), the others Gumbel-max
def test_gpu_qwen3_head(rows):
    """Qwen3-1.7B's head in bf16 at the rule's tiles: the reference draw (the logits rounded to bf16 from fp64 may
    differ from the kernel's fp32 sum by a rounding: near-ties only), the fused sampler's noise."""
    h, w = head(rows, 151936, 2048, torch.bfloat16, seed=rows, device="cuda")
    rng = ks.new_rng_state("cuda", torch.Generator(device="cuda").manual_seed(rows))
    tokens = check(h, w, 1.0, rng)
    check(h, w, None, None)
    assert tokens.min() >= 0 and tokens.max() < 151936


@needs_triton
def test_engine_tile_draws_are_seeded_and_their_logprobs_the_models(monkeypatch):
    """The engine's default draw through the fused head (``TILE_DRAW``): a seed reproduces the completions, another
    seed gives others, and each logprob is log_softmax(logits / T) of one full forward of the model over the prompt
    and completion (teacher-forced) at the token drawn. (The tiny model's rows take 64-wide tiles: the tile draw
    forced on them.)"""
    monkeypatch.setattr(ks, "TILE_DRAW_MIN_BN", 0)
    calls = []
    monkeypatch.setattr(graphs, "head_sample", lambda *a, **k: calls.append(1) or ks.head_sample(*a, **k))
    monkeypatch.setattr(graphs, "plain_head", lambda model: model.lm_head.weight)
    model = tiny_model("qwen3").to(DEVICE)
    prompts = [[5, 9, 33, 7, 81], [2, 200, 14]]
    temperature = 0.8
    engine = RolloutEngine(model, compression=CompressionConfig("full"), max_batch=4, fused_sampling=True)
    runs = [engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=temperature, seed=seed,
                                                    ignore_eos=True), n=2) for seed in (7, 7, 8)]
    engine.close()
    assert calls
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert [r.token_ids for r in runs[0]] != [r.token_ids for r in runs[2]]
    for i, result in enumerate(runs[0]):
        prompt = prompts[i // 2]
        ids = torch.tensor([prompt + result.token_ids], device=DEVICE)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        want = (logits / temperature).log_softmax(-1).gather(-1, ids[0, len(prompt):, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs, device=DEVICE), want, atol=1e-4, rtol=0)
