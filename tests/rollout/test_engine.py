"""RolloutEngine against independent references: HF generate, one full forward, the cache formula."""
import random

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from tests.conftest import tiny_model

GREEDY = dict(temperature=0.0)


def hf_greedy(model, prompt, max_new_tokens):
    """HF ``generate`` greedy with EOS ignored (the model's generation config is restored afterwards)."""
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt):].tolist()


def random_prompts(count, vocab, low, high, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def test_full_greedy_matches_hf_generate_on_embedded_model(smollm2, chat_prompts):
    model, tok = smollm2
    engine = RolloutEngine(model, compression=CompressionConfig("full"), max_batch=4, tokenizer=tok)
    prompts = chat_prompts[:3]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True, **GREEDY))
    for prompt, result in zip(prompts, results):
        ref = hf_greedy(model, prompt, 64)
        assert result.token_ids == ref, (tok.decode(result.token_ids), tok.decode(ref))
        assert result.finish_reason == "length" and len(result.token_ids) == 64


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_full_greedy_matches_hf_generate_on_tiny_models(family):
    model = tiny_model(family)
    prompts = random_prompts(3, 256, 3, 40, seed=1)
    engine = RolloutEngine(model, compression=CompressionConfig("full"), max_batch=3)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=48, **GREEDY))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(model, prompt, 48)


def test_mixed_length_batch_equals_one_prompt_at_a_time(tiny_llama):
    prompts = random_prompts(5, 256, 2, 60, seed=2)
    params = SamplingParams(max_new_tokens=40, **GREEDY)
    batched = RolloutEngine(tiny_llama, max_batch=5).generate(prompts, params)
    single = RolloutEngine(tiny_llama, max_batch=1)
    for prompt, result in zip(prompts, batched):
        assert single.generate([prompt], params)[0].token_ids == result.token_ids


@pytest.mark.parametrize("policy,kwargs", [
    ("longflow", {}), ("longflow", {"granularity": "layer"}), ("streaming", {}), ("random", {}),
])
def test_budget_covering_the_sequence_equals_full(tiny_llama, policy, kwargs):
    prompts = random_prompts(4, 256, 5, 30, seed=3)
    params = SamplingParams(max_new_tokens=50, temperature=0.9, seed=7)
    full = RolloutEngine(tiny_llama, max_batch=2).generate(prompts, params, n=2)
    # the budget covers prompt + max_new_tokens for every prompt: nothing is ever evicted
    compressed = RolloutEngine(tiny_llama, compression=CompressionConfig(policy, budget=81, **kwargs), max_batch=2)
    got = compressed.generate(prompts, params, n=2)
    assert [r.token_ids for r in got] == [r.token_ids for r in full]
    flat = [lp for r in full for lp in r.logprobs]
    assert [lp for r in got for lp in r.logprobs] == pytest.approx(flat, rel=1e-5)


def test_logprobs_match_one_full_forward(smollm2, chat_prompts):
    model, tok = smollm2
    engine = RolloutEngine(model, max_batch=2, tokenizer=tok)
    temperature = 0.7
    results = engine.generate(chat_prompts[:2], SamplingParams(max_new_tokens=40, temperature=temperature,
                                                               top_p=0.9, seed=3))
    for result in results:
        seq = torch.tensor([result.prompt_ids + result.token_ids])
        with torch.no_grad():
            logits = model(seq).logits[0].double()
        start = len(result.prompt_ids) - 1
        ref = (logits[start:start + len(result.token_ids)] / temperature).log_softmax(-1)
        ref = ref.gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
        got = torch.tensor(result.logprobs, dtype=torch.float64)
        # norm-wise relative error (elementwise relative error is ill-conditioned for logprobs near 0)
        rel = (torch.linalg.norm(got - ref) / torch.linalg.norm(ref)).item()
        assert rel <= 1e-4, rel
        assert (got - ref).abs().max().item() <= 1e-4


def _hf_processed_logprobs(model, result, temperature, **processors):
    """The log-probability of each sampled token under the distribution it was drawn from, rebuilt in fp64 by HF's
    own logits processors (repetition penalty over prompt + completion so far, then temperature, top-k, top-p,
    min-p, HF's order) on a teacher-forced forward: the reference of ``logprobs_mode="processed"``."""
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    steps = [RepetitionPenaltyLogitsProcessor(processors["repetition_penalty"])]
    if temperature > 0:
        steps += [TemperatureLogitsWarper(temperature), TopKLogitsWarper(processors["top_k"]),
                  TopPLogitsWarper(processors["top_p"]), MinPLogitsWarper(processors["min_p"])]
    seq = torch.tensor([result.prompt_ids + result.token_ids])
    with torch.no_grad():
        logits = model(seq).logits[0].double()
    start, out = len(result.prompt_ids) - 1, []
    for i, token in enumerate(result.token_ids):
        row = logits[start + i][None]
        for step in steps:
            row = step(seq[:, :start + i + 1], row)
        out.append(row.log_softmax(-1)[0, token].item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_processed_logprobs_are_those_of_the_distribution_drawn_from(tiny_llama, temperature):
    """``logprobs_mode="processed"`` (what the TRL adapter asks for, as TRL asks vLLM): each logprob is the token's
    under the processed distribution it was drawn from (HF's processors in fp64, teacher-forced); the draws are the
    raw mode's, and without a processor the two modes agree."""
    processors = dict(top_k=40, top_p=0.8, min_p=0.05, repetition_penalty=1.3)
    prompts = random_prompts(3, 256, 5, 20, seed=11)
    engine = RolloutEngine(tiny_llama, max_batch=3)
    runs = {mode: engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=temperature, seed=5,
                                                          ignore_eos=True, logprobs_mode=mode, **processors))
            for mode in ("raw", "processed")}
    assert [r.token_ids for r in runs["processed"]] == [r.token_ids for r in runs["raw"]]
    for raw, processed in zip(runs["raw"], runs["processed"]):
        ref = _hf_processed_logprobs(tiny_llama, processed, temperature, **processors)
        got = torch.tensor(processed.logprobs, dtype=torch.float64)
        assert (got - ref).abs().max().item() <= 1e-5
        assert (got - torch.tensor(raw.logprobs, dtype=torch.float64)).abs().max().item() > 1e-3  # they differ
    plain = {mode: engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.7, seed=5,
                                                           logprobs_mode=mode)) for mode in ("raw", "processed")}
    assert [r.logprobs for r in plain["processed"]] == [r.logprobs for r in plain["raw"]]


def test_kv_cache_bytes_fixed_and_equal_to_formula():
    model = tiny_model("llama")
    budget, slots = 64, 3
    engine = RolloutEngine(model, compression=CompressionConfig("longflow", budget=budget), max_batch=slots)
    cfg = model.config
    formula = slots * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * budget * cfg.head_dim * 4
    assert engine.kv_cache_bytes() == formula
    prompts = random_prompts(2, 256, 10, 20, seed=4)
    engine.generate(prompts, SamplingParams(max_new_tokens=128, ignore_eos=True, **GREEDY))
    after_128 = engine.kv_cache_bytes()
    results = engine.generate(prompts, SamplingParams(max_new_tokens=4096, ignore_eos=True, **GREEDY))
    assert [len(r.token_ids) for r in results] == [4096, 4096]
    assert after_128 == engine.kv_cache_bytes() == formula
    # stated metadata: int32 positions and fp32 ||v||_1 (LongFlow's statistic) per cache slot, int64 counts and
    # write indices, int64 current positions
    meta = slots * cfg.num_hidden_layers * cfg.num_key_value_heads * (budget * (4 + 4) + 2 * 8) + slots * 8
    assert engine.kv_metadata_bytes() == meta
    # the static buffers hold exactly `budget` live tokens per head after 4096 steps
    assert int((engine.cache.pos >= 0).sum(-1).max()) == budget


def test_prompt_longer_than_budget_is_compressed_and_generation_runs(tiny_llama):
    prompt = random_prompts(1, 256, 100, 100, seed=5)[0]
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("longflow", budget=32), max_batch=2)
    results = engine.generate([prompt], SamplingParams(max_new_tokens=20, **GREEDY), n=2)
    assert [len(r.token_ids) for r in results] == [20, 20]
    assert results[0].token_ids == results[1].token_ids  # greedy, same prompt cache
    live = (engine.cache.pos[:, :2] >= 0).sum(-1)
    assert int(live.max()) == 32


def test_periodic_policy_records_each_compression(tiny_llama):
    """``stats["policy_events"]``: one (decode steps before it, seconds) per window that compressed, in order;
    R-KV with budget 24 + buffer 8 and a 10-token prompt compresses after 22 steps, then every 8."""
    prompt = random_prompts(1, 256, 10, 10, seed=8)[0]
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("rkv", budget=24, buffer=8), max_batch=2)
    engine.generate([prompt], SamplingParams(max_new_tokens=60, **GREEDY), n=2)
    events = list(engine.stats["policy_events"])
    assert [st for st, _ in events] == [22, 30, 38, 46, 54]
    assert all(sec > 0 for _, sec in events)
    assert engine.stats["policy_seconds"] >= sum(sec for _, sec in events)


def test_n_samples_share_one_prefill(tiny_llama):
    prompts = random_prompts(3, 256, 7, 19, seed=6)
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("longflow", budget=48), max_batch=3)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0), n=4)
    assert engine.stats["prefills"] == 3
    assert engine.stats["prefill_tokens"] == sum(len(p) for p in prompts)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(p, s) for p in range(3) for s in range(4)]
    assert len({tuple(r.token_ids) for r in results[:4]}) > 1  # samples of one prompt differ


def test_continuous_batching_keeps_order_and_every_prompt(tiny_llama):
    stop = 7
    prompts = random_prompts(20, 256, 1, 50, seed=8)
    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("streaming", budget=40), max_batch=4)
    params = SamplingParams(max_new_tokens=30, temperature=1.2, stop_token_ids=(stop, 11, 13), seed=1)
    results = engine.generate(prompts, params)
    assert len(results) == 20
    assert [r.prompt_index for r in results] == list(range(20))
    assert [r.prompt_ids for r in results] == prompts
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}, reasons  # variable lengths exercise slot refills
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) <= 30
        stops = [t for t in r.token_ids if t in (stop, 11, 13)]
        assert (r.finish_reason == "stop") == (stops == [r.token_ids[-1]])
    again = engine.generate(prompts, params)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]
    other = engine.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 2}))
    assert [r.token_ids for r in other] != [r.token_ids for r in results]


@pytest.mark.parametrize("case", ["one token", "stop first"])
def test_sequences_ending_on_their_first_token_free_their_slot_for_the_next(tiny_llama, case):
    """More samples than slots, each ending at its first token (from its prefill): every one comes back, in order
    (the slots are refilled until a sequence lives in them or none waits; a run once ended with prompts waiting)."""
    prompts = random_prompts(5, 256, 3, 9, seed=12)
    engine = RolloutEngine(tiny_llama, max_batch=2)
    first = [r.token_ids[0] for r in engine.generate(prompts, SamplingParams(max_new_tokens=1, **GREEDY))]
    params = SamplingParams(max_new_tokens=1, **GREEDY) if case == "one token" else \
        SamplingParams(max_new_tokens=8, stop_token_ids=tuple(set(first)), **GREEDY)
    results = engine.generate(prompts, params, n=3)
    assert [(r.prompt_index, r.sample_index) for r in results] == [(p, s) for p in range(5) for s in range(3)]
    assert [r.token_ids for r in results] == [[t] for t in first for _ in range(3)]
    assert {r.finish_reason for r in results} == {"length" if case == "one token" else "stop"}


def test_repetition_penalty_sees_only_its_own_sequence_when_slots_are_reused(tiny_llama):
    """Greedy with a repetition penalty, more prompts than slots (each slot reused): every completion equals HF's
    ``generate`` with the same penalty on that prompt alone (a slot's seen-token set must not carry over the previous
    occupant's prompt and tokens)."""
    prompts = random_prompts(4, 256, 6, 14, seed=21)
    params = SamplingParams(max_new_tokens=24, repetition_penalty=2.0, ignore_eos=True, **GREEDY)
    results = RolloutEngine(tiny_llama, max_batch=1).generate(prompts, params, n=2)
    for index, prompt in enumerate(prompts):
        out = tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=2.0,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
        ref = out[0, len(prompt):].tolist()
        assert [r.token_ids for r in results[2 * index:2 * index + 2]] == [ref, ref], index


def test_load_weights_updates_in_place(tiny_llama):
    engine = RolloutEngine(tiny_llama, max_batch=1)
    params = SamplingParams(max_new_tokens=16, **GREEDY)
    prompt = random_prompts(1, 256, 8, 8, seed=9)
    before = engine.generate(prompt, params)[0].token_ids
    donor = tiny_model("llama", seed=123)
    storage = {n: p.data_ptr() for n, p in tiny_llama.named_parameters()}
    assert engine.load_weights(donor.named_parameters()) == len(list(donor.named_parameters()))
    assert {n: p.data_ptr() for n, p in tiny_llama.named_parameters()} == storage
    for (_, a), (_, b) in zip(tiny_llama.named_parameters(), donor.named_parameters()):
        assert torch.equal(a, b)
    after = engine.generate(prompt, params)[0].token_ids
    assert after == hf_greedy(donor, prompt[0], 16) and after != before
    with pytest.raises(ValueError, match="unknown parameter name 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))])


def test_load_weights_takes_a_state_dict(tiny_llama):
    """A mapping (``model.state_dict()``) is read as its (name, tensor) items, not unpacked name by name."""
    engine = RolloutEngine(tiny_llama, max_batch=1)
    donor = tiny_model("llama", seed=123)
    assert engine.load_weights(donor.state_dict()) == len(donor.state_dict())
    for (_, a), (_, b) in zip(tiny_llama.named_parameters(), donor.named_parameters()):
        assert torch.equal(a, b)


def test_nan_logits_raise_naming_step_and_sequence(tiny_llama):
    engine = RolloutEngine(tiny_llama, max_batch=2)
    calls = {"decode": 0}

    def poison(module, args, output):
        if engine.cache.mode == "decode":  # decode steps only (the two prompts' prefill is one forward too)
            calls["decode"] += 1
            if calls["decode"] == 3:
                output = output.clone()
                output[1] = float("nan")
                return output
        return output

    handle = tiny_llama.lm_head.register_forward_hook(poison)
    try:
        with pytest.raises(FloatingPointError, match=r"decode step 3 of prompt 1 sample 0; refusing"):
            engine.generate(random_prompts(2, 256, 4, 9, seed=10), SamplingParams(max_new_tokens=10, **GREEDY))
    finally:
        handle.remove()


def test_a_refused_load_weights_leaves_the_weights_as_they_were():
    model = tiny_model()
    engine = RolloutEngine(model, compression=CompressionConfig("streaming", 16), max_batch=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pairs = [(name, p.detach() + 1) for name, p in model.named_parameters()]
    pairs.insert(2, ("model.no_such.weight", torch.zeros(1)))
    with pytest.raises(ValueError, match="unknown parameter name 'model.no_such.weight'.*Nothing was loaded"):
        engine.load_weights(pairs)
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    # values the check used to pass on name and shape alone, then fail (or cast) while copying, after earlier pairs
    names = [name for name, _ in model.named_parameters()]
    for bad, match in ((lambda p: p.detach().numpy() + 1, r"is a ndarray, not a torch.Tensor"),
                       (lambda p: torch.empty(p.shape, device="meta"), r"is a meta tensor"),
                       (lambda p: torch.ones(p.shape, dtype=torch.int64), r"has dtype torch.int64, the model's "
                                                                          r"parameter is torch.float32")):
        pairs = [(name, p.detach() + 1) for name, p in model.named_parameters()]
        pairs[3] = (names[3], bad(dict(model.named_parameters())[names[3]]))
        with pytest.raises(ValueError, match=rf"load_weights: '{names[3]}' {match}.*Nothing was loaded"):
            engine.load_weights(pairs)
        assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_numpy_numbers_are_taken_as_python_numbers(tiny_llama):
    import numpy as np

    engine = RolloutEngine(tiny_llama, compression=CompressionConfig("longflow", budget=np.int64(16)),
                           max_batch=np.int64(2))
    assert type(engine.compression.budget) is int and engine.max_batch == 2
    params = SamplingParams(max_new_tokens=4, temperature=np.float32(0.5), top_p=np.float32(0.5), seed=1)
    assert (type(params.temperature), params.temperature, params.top_p) == (float, 0.5, 0.5)
    got = engine.generate([[1, 2, 3]], params, n=np.int64(2))
    assert len(got) == 2 and [r.token_ids for r in got] == [r.token_ids for r in
                                                             engine.generate([[1, 2, 3]], params, n=2)]


def test_a_dtype_the_given_model_does_not_have_is_refused():
    model = tiny_model()
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=r"RolloutEngine.dtype=torch.bfloat16 but the model's parameters are "
                                         r"torch.float32; the engine does not cast a model it is given"):
        RolloutEngine(model, dtype=torch.bfloat16)
    assert model.config._attn_implementation == implementation  # refused before the model is touched
    assert RolloutEngine(model, dtype=torch.float32).model is model


def test_a_tokenizer_given_with_a_named_model_is_kept(smollm2):
    _, tok = smollm2
    assert RolloutEngine("smollm2", tokenizer=tok, max_batch=1).tokenizer is tok


@pytest.mark.parametrize("at", [0, 2])  # the prefill's first token, a decode step's
def test_a_stop_token_on_the_last_allowed_step_finishes_with_stop(tiny_llama, at):
    """A stop token drawn at ``max_new_tokens`` is a stop (it ends the completion: TRL masks on it), on the first token
    as on a decode step; ``ignore_eos`` drops the model's EOS only, not the stop ids given."""
    prompts = random_prompts(2, 256, 4, 9, seed=31)
    engine = RolloutEngine(tiny_llama, max_batch=2)
    ref = engine.generate(prompts, SamplingParams(max_new_tokens=at + 1, ignore_eos=True, **GREEDY))
    for ignore_eos in (False, True):
        params = SamplingParams(max_new_tokens=at + 1, stop_token_ids=[ref[0].token_ids[at]], ignore_eos=ignore_eos,
                                **GREEDY)
        got = engine.generate(prompts[:1], params)[0]
        assert got.token_ids == ref[0].token_ids and got.finish_reason == "stop", (ignore_eos, got)
