"""The batched prefill (``engine._prefill_many``, taken by ``_prefill_ahead`` when several free slots need new prompts):
right-padded rows give each prompt the cache entries and last-position logits of its own prefill, prompts compressed
at prefill still go alone, and whole generations are the one-by-one path's."""
import pytest
import torch

import kvroll.rollout.scheduler as scheduler_module
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
        monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS", 8192 if batched else 0)
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
    monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS", 40)
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
        monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS", cap)
        runs.append(RolloutEngine(model, compression=compression, max_batch=8).generate(
            prompts, SamplingParams(max_new_tokens=32, **GREEDY), n=2))
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


def test_a_non_finite_pad_does_not_reach_the_prompts(monkeypatch):
    # the pad id's embedding non-finite (no prompt holds it): the padded rows' keys and values at the pads must not
    # reach the prompt's positions through their zero attention weights (0 x inf = NaN)
    model = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[0] = float("inf")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    engine = RolloutEngine(model, max_batch=4)
    engine._allocate(32)
    for ids, (prompt, logits) in zip(prompts, engine._prefill_many(prompts)):
        alone, alone_logits = engine._prefill(ids)
        assert torch.isfinite(logits).all() and torch.isfinite(prompt.k).all() and torch.isfinite(prompt.v).all()
        torch.testing.assert_close(logits, alone_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(prompt.v, alone.v, rtol=1e-5, atol=1e-5)


def test_a_prompt_over_the_limit_goes_alone_and_those_behind_it_are_batched(monkeypatch):
    model = tiny_model()
    short, long = random_prompts(6, 256, 5, 10, seed=1), random_prompts(2, 256, 40, 50, seed=2)
    prompts = [long[0]] + short[:3] + [long[1]] + short[3:]  # random at 32 keeps 31 prompt tokens whole
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=4)

    def run(batched):
        monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS", 8192 if batched else 0)
        engine = RolloutEngine(model, compression=CompressionConfig("random", 32), max_batch=8)
        forwards = count_prefill_forwards(engine)
        return engine.generate(prompts, params), forwards

    (one, _), (many, forwards) = run(False), run(True)
    assert forwards == [1, 3, 1, 3]  # in order: the long one alone (its draws first), then the three behind it
    for a, b in zip(one, many):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_failed_batched_forward_leaves_the_cache_and_head_clean(tiny_llama):
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("longflow", 64), max_batch=4)
    prompts = random_prompts(4, 256, 2, 20, seed=6)

    def fail(module, args, output):
        raise RuntimeError("out of memory")

    hook = tiny_llama.model.layers[1].register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine._prefill_many(prompts)
    hook.remove()
    cache = engine.cache
    assert cache.mode == "decode" and cache.prompt_lengths is None and cache.prompt_pad is None
    assert all(p is None for p in cache._prompt)  # no layer's padded K/V held past the failure
    assert not tiny_llama.get_output_embeddings()._forward_pre_hooks
    params = SamplingParams(max_new_tokens=5, **GREEDY)
    assert [r.token_ids for r in engine.generate(prompts, params)] == \
        [hf_greedy(tiny_llama, p, 5) for p in prompts]


def test_samples_of_several_prompts_share_a_forward_when_n_does_not_divide_the_slots(tiny_llama):
    engine = RolloutEngine(tiny_llama, max_batch=4)
    forwards = count_prefill_forwards(engine)
    engine.generate(random_prompts(4, 256, 2, 9, seed=7), SamplingParams(max_new_tokens=3, **GREEDY), n=3)
    assert forwards[0] == 2  # 4 slots, 3 samples a prompt: two prompts at once


def test_prompts_at_the_limit_and_one_past_it(monkeypatch):
    # longflow at 32 keeps 31 prompt tokens whole: 31 goes in a batch, 32 (compressed at prefill) alone
    model = tiny_model()
    base = random_prompts(6, 256, 40, 40, seed=8)
    prompts = [base[0][:31], base[1][:31], base[2][:32], base[3][:31], base[4][:5], base[5][:32]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2)
    runs = []
    for cap in (0, 8192):
        monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS", cap)
        engine = RolloutEngine(model, compression=CompressionConfig("longflow", 32), max_batch=6)
        assert engine.cache.prefill_limit() == 31
        forwards = count_prefill_forwards(engine)
        runs.append(engine.generate(prompts, params))
    assert 2 in forwards
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids


def test_a_ring_cache_batches_only_prompts_shorter_than_the_window(monkeypatch):
    # Mistral with a 16-token window, full: past it a ring of 16 slots keeps the last 15 prompt tokens
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=16, sliding_window=16, eos_token_id=None)).eval()
    model.generation_config.eos_token_id = None
    prompts = [p[:n] for p, n in zip(random_prompts(6, 256, 20, 20, seed=9), (15, 16, 3, 16, 15, 9))]
    engine = RolloutEngine(model, max_batch=2)
    forwards = count_prefill_forwards(engine)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8, **GREEDY))
    assert engine.cache.prefill_limit() == 15 and 2 in forwards
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model, prompt, 8)


def test_stats_count_prompt_tokens_not_padding(tiny_llama):
    prompts = random_prompts(6, 256, 1, 20, seed=10)
    engine = RolloutEngine(tiny_llama, max_batch=6)
    engine.generate(prompts, SamplingParams(max_new_tokens=2, **GREEDY))
    assert engine.stats["prefills"] == 6 and engine.stats["prefill_tokens"] == sum(map(len, prompts))


def test_non_finite_logits_name_their_row_of_the_batch():
    model = tiny_model()
    with torch.no_grad():
        model.model.embed_tokens.weight[7] = float("nan")
    prompts = [[t if t != 7 else 8 for t in p] for p in random_prompts(4, 256, 3, 10, seed=1)]
    prompts[2].append(7)
    engine = RolloutEngine(model, max_batch=4)
    forwards = count_prefill_forwards(engine)
    with pytest.raises(FloatingPointError, match="prefill of prompt 2;"):
        engine.generate(prompts, SamplingParams(max_new_tokens=2, **GREEDY))
    assert forwards == [4]


def test_prompts_are_prefilled_only_for_free_slots(tiny_llama):
    # 7 prompts, 4 slots: the last 3 are prefilled when slots free up, after some decode, not all up front
    engine = RolloutEngine(tiny_llama, max_batch=4)
    steps, forward = [], engine._prefill_many
    engine._prefill_many = lambda prompts: (steps.append(engine.stats["decode_steps"]), forward(prompts))[1]
    engine.generate(random_prompts(7, 256, 2, 9, seed=11), SamplingParams(max_new_tokens=3, **GREEDY))
    assert steps[0] == 0 and steps[1] > 0
