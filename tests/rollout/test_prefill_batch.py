"""The batched prefill (``engine._prefill_many``, taken by ``_prefill_ahead`` when several free slots need new prompts):
right-padded rows give each prompt the cache entries and last-position logits of its own prefill, prompts compressed
at prefill still go alone, and whole generations are the one-by-one path's."""
import pytest
import torch

import kvroll.rollout.engine as engine_module
from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from tests.conftest import tiny_model
from tests.rollout.test_engine import GREEDY, hf_greedy, random_prompts


def count_prefill_forwards(engine):
    """Wrap the model's forward: the list gets each prefill forward's batch size."""
    calls, forward = [], engine.model.forward

    def counted(*args, **kwargs):
        if engine.cache is not None and engine.cache.mode == "prefill":
            calls.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    engine.model.forward = counted
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_each_row_is_its_own_prefill(family):
    model = tiny_model(family)
    engine = RolloutEngine(model, compression=CompressionConfig("longflow", 64), max_batch=4)
    prompts = random_prompts(5, 256, 2, 30, seed=1)
    prompts[2] = prompts[2][:1]  # a one-token prompt beside longer ones
    batched = engine._prefill_many(prompts)
    assert engine.cache.prompt_lengths is None and all(p is None for p in engine.cache._prompt)
    for ids, (prompt, logits) in zip(prompts, batched):
        alone, alone_logits = engine._prefill(ids)
        assert prompt.length == alone.length == len(ids)
        assert prompt.k.shape == alone.k.shape == (2, 2, len(ids), 16)
        torch.testing.assert_close(prompt.k, alone.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prompt.v, alone.v, rtol=1e-5, atol=1e-5)
        assert torch.equal(prompt.pos, alone.pos)
        torch.testing.assert_close(logits, alone_logits, rtol=1e-5, atol=1e-5)
        # and against HF's own forward of the prompt alone (fp32 reference)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_full_greedy_still_equals_hf_generate_with_mixed_lengths(tiny_llama):
    prompts = random_prompts(6, 256, 1, 20, seed=2)
    engine = RolloutEngine(tiny_llama, max_batch=4)
    forwards = count_prefill_forwards(engine)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, **GREEDY))
    assert [r.prompt_index for r in results] == list(range(6))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(tiny_llama, prompt, 24)
    assert forwards == [4, 2]  # the first four in one forward, then the two refills in one
    assert engine.stats["prefills"] == 6


@pytest.mark.parametrize("policy,budget,n", [("full", None, 1), ("longflow", 32, 2), ("rkv", 24, 1),
                                              ("snapkv", 40, 3), ("random", 24, 1)])
def test_generations_equal_the_one_by_one_path(monkeypatch, policy, budget, n):
    # Prompts up to 60 tokens: over the compressing policies' limit some go alone (compressed at prefill),
    # the others in batches. Sampled at T = 1 with a seed: the same draws, tokens and logprobs.
    model = tiny_model()
    prompts = random_prompts(7, 256, 3, 60, seed=3)
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=11)
    compression = CompressionConfig(policy, budget) if budget else None

    def run(batched):
        monkeypatch.setattr(engine_module, "PREFILL_TOKENS", 8192 if batched else 0)
        engine = RolloutEngine(model, compression=compression, max_batch=6)
        forwards = count_prefill_forwards(engine)
        return engine.generate(prompts, params, n=n), forwards, engine

    (one, one_forwards, _), (many, many_forwards, engine) = run(False), run(True)
    assert max(one_forwards) == 1 and max(many_forwards) > 1  # the batched path ran
    assert len(many_forwards) < len(one_forwards) and sum(many_forwards) == len(prompts)
    if budget:
        limit = engine.cache.prefill_limit()
        assert any(len(p) > limit for p in prompts) and any(len(p) <= limit for p in prompts)
    assert [(r.prompt_index, r.sample_index) for r in many] == [(r.prompt_index, r.sample_index) for r in one]
    for a, b in zip(one, many):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_the_token_cap_splits_a_batch(monkeypatch, tiny_llama):
    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", 40)
    prompts = [[5] * 10, [6] * 12, [7] * 9, [8] * 3, [9] * 20]
    engine = RolloutEngine(tiny_llama, max_batch=5)
    forwards = count_prefill_forwards(engine)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=4, **GREEDY))
    # rows x the longest prompt <= 40: [10, 12, 9] (3 x 12 = 36), then [3, 20] (2 x 20 = 40)
    assert forwards == [3, 2]
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(tiny_llama, prompt, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("policy,budget", [("full", None), ("longflow", 32)])
def test_on_cuda_the_batched_prefill_gives_the_one_by_one_generations(monkeypatch, policy, budget):
    # fp32 on the GPU (CUDA graphs, the fused kernels where they apply): cuBLAS may pick other algorithms for the
    # batched rows, so the prefill is compared within fp32 roundings and the greedy tokens exactly.
    model = tiny_model("qwen3").cuda()
    prompts = random_prompts(9, 256, 3, 60, seed=5)
    compression = CompressionConfig(policy, budget) if budget else None
    engine = RolloutEngine(model, compression=compression, max_batch=8)
    if engine.cache is None:  # full sizes its cache per generate call
        engine._allocate(128)
    short = [p for p in prompts if len(p) <= engine.cache.prefill_limit()][:4]
    for ids, (prompt, logits) in zip(short, engine._prefill_many(short)):
        alone, alone_logits = engine._prefill(ids)
        torch.testing.assert_close(prompt.k, alone.k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, alone_logits, rtol=1e-4, atol=1e-4)
    runs = []
    for cap in (0, 8192):
        monkeypatch.setattr(engine_module, "PREFILL_TOKENS", cap)
        runs.append(RolloutEngine(model, compression=compression, max_batch=8).generate(
            prompts, SamplingParams(max_new_tokens=32, **GREEDY), n=2))
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
