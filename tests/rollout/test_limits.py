"""The model's limits (sliding window, max_position_embeddings), the engine's lifetime and its input boundary.

Sliding windows are checked against HF ``generate`` greedy on tiny random Mistral / Qwen2 models with W = 8;
the same comparison with the window removed from the config shows that the window changes the tokens.
"""
import types
import weakref

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.cache import CompressedKVCache
from kvroll.rollout.model import sliding_window
from tests.conftest import freed_without_gc, needs_interpreter, tiny_model
from tests.rollout.test_engine import GREEDY, hf_greedy, random_prompts

WINDOW = 8
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=None,
              bos_token_id=None, pad_token_id=0)


def windowed(family: str, max_window_layers: int = 0):
    """A tiny random model whose config sets sliding_window=WINDOW (Qwen2: on layers >= max_window_layers)."""
    torch.manual_seed(0)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **COMMON))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=max_window_layers, **COMMON))
    model.generation_config.eos_token_id = None
    return model.eval()


def test_sliding_window_read_from_the_config():
    assert sliding_window(windowed("mistral").config) == (WINDOW, (0, 1))
    assert sliding_window(windowed("qwen2").config) == (WINDOW, (0, 1))
    assert sliding_window(windowed("qwen2", max_window_layers=1).config) == (WINDOW, (1,))
    assert sliding_window(windowed("qwen2", max_window_layers=2).config) is None  # no layer slides
    assert sliding_window(Qwen2Config(**COMMON)) is None  # use_sliding_window defaults to False
    assert sliding_window(tiny_model("llama").config) is None


def test_mistral_slides_every_layer_whatever_its_layer_types_say():
    """HF's Mistral applies ``sliding_window`` on every layer (its forward equals the model without ``layer_types``),
    so ``full`` past the window takes the ring and matches HF's forward instead of being refused."""
    torch.manual_seed(0)
    config = MistralConfig(sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"], **COMMON)
    model = MistralForCausalLM(config).eval()
    assert sliding_window(config) == (WINDOW, (0, 1))
    prompt = random_prompts(1, 256, 20, 20, seed=4)[0]
    got = RolloutEngine(model, max_batch=1).generate([prompt], SamplingParams(max_new_tokens=12, **GREEDY))[0]
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    assert got.token_ids == logprobs.argmax(-1).tolist()
    assert got.logprobs == pytest.approx(logprobs.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0].tolist(),
                                         abs=1e-4)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_full_past_the_window_matches_hf_generate(family, kernel, monkeypatch):
    """Past W, ``full`` keeps the last W positions in a ring of W slots; prompts shorter and longer than W (the
    prefill then attends with the window too). Removing the window from the config changes HF's tokens."""
    monkeypatch.setattr(CompressedKVCache, "kernel_on_cpu", kernel)  # the Triton decode path, interpreted
    model = windowed(family)
    prompts = [p for p in random_prompts(3, 256, 3, 20, seed=1)]
    assert min(map(len, prompts)) < WINDOW < max(map(len, prompts))
    engine = RolloutEngine(model, max_batch=2)
    short = engine.generate([[4, 5]], SamplingParams(max_new_tokens=WINDOW - 2, **GREEDY))  # within the window
    assert engine.cache.capacity == WINDOW and engine.cache.policy is engine.policy  # plain full, no ring
    assert short[0].token_ids == hf_greedy(model, [4, 5], WINDOW - 2)
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, **GREEDY))
    assert engine.cache.capacity == WINDOW and engine.cache.policy is not engine.policy  # the ring
    refs = [hf_greedy(model, prompt, 24) for prompt in prompts]
    assert [r.token_ids for r in results] == refs
    if family == "mistral":
        model.config.sliding_window = None
    else:
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        model.config.layer_types = ["full_attention"] * 2
    assert [hf_greedy(model, prompt, 24) for prompt in prompts] != refs


@pytest.mark.parametrize("policy", ["full", "longflow", "rkv"])
def test_within_the_window_every_policy_is_exact_full_attention(policy):
    """prompt + max_new_tokens <= W never reaches the window: allowed for every policy (budget covers it)."""
    model = windowed("qwen2", max_window_layers=1)
    budget = None if policy == "full" else WINDOW
    kwargs = {"buffer": 2, "window": 2} if policy == "rkv" else {}
    engine = RolloutEngine(model, CompressionConfig(policy, budget=budget, **kwargs), max_batch=2)
    prompts = [[5, 9, 11], [7, 3]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=WINDOW - 3, **GREEDY))
    assert [r.token_ids for r in results] == [hf_greedy(model, p, WINDOW - 3) for p in prompts]


@pytest.mark.parametrize("family,policy,match", [
    ("mistral", "longflow", r"sliding_window=8 .*= 9 exceeds it; policy 'longflow' does not apply the window.*"
                            r"Lower max_new_tokens to <= 5, or use policy 'full'"),
    ("qwen2", "rkv", r"sliding_window=8 .*policy 'rkv' does not apply"),
    ("qwen2-mixed", "full", r"sliding_window=8 .*'full' applies it only when every layer slides \(here only layers "
                            r"\[1\] of 2 do\).*Lower max_new_tokens to <= 5\.$"),
])
def test_past_the_window_otherwise_is_refused_before_any_work(family, policy, match):
    model = windowed("qwen2", max_window_layers=1) if family == "qwen2-mixed" else windowed(family)
    budget = None if policy == "full" else 16
    engine = RolloutEngine(model, CompressionConfig(policy, budget=budget), max_batch=1)
    engine._prefill = None  # any model work would fail differently
    with pytest.raises(ValueError, match=match):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=6, **GREEDY))


def test_a_prompt_as_long_as_the_window_names_both_lengths():
    engine = RolloutEngine(windowed("mistral"), CompressionConfig("streaming", budget=16), max_batch=1)
    with pytest.raises(ValueError, match=r"= 10 exceeds it.*Keep prompt \+ max_new_tokens within 8 tokens \(the "
                                         r"longest prompt alone has 9\), or use policy 'full'"):
        engine.generate([[1] * 9], SamplingParams(max_new_tokens=1))


def test_budget_above_max_positions_is_refused_before_allocation(monkeypatch):
    model = tiny_model("llama")
    model.config.max_position_embeddings = 512
    monkeypatch.setattr(CompressedKVCache, "__init__", None)  # allocating would raise a TypeError instead
    with pytest.raises(ValueError, match=r"budget=1000000 exceeds the model's max_position_embeddings=512.*"
                                         r"Use budget <= 512, or policy 'full'"):
        RolloutEngine(model, CompressionConfig("longflow", budget=10**6))
    with pytest.raises(ValueError, match=r"budget=513 exceeds .*=512"):
        RolloutEngine(model, CompressionConfig("rkv", budget=513))


def test_rkv_buffer_may_run_past_max_positions():
    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    engine = RolloutEngine(model, CompressionConfig("rkv", budget=64, buffer=8), max_batch=1)
    assert engine.cache.capacity == 72


@pytest.mark.parametrize("policy,kwargs", [("rkv", {"buffer": 64}), ("snapkv", {"buffer": 64, "window": 8}),
                                           ("hardkv", {"interval": 64, "window": 8})])
def test_a_buffer_of_exactly_max_positions_is_taken(policy, kwargs):
    """The limit is inclusive, as the budget's: a buffer (Hard-KV: interval) equal to the positions can fill."""
    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    engine = RolloutEngine(model, CompressionConfig(policy, budget=32, **kwargs), max_batch=1)
    assert engine.cache.capacity >= 64


@pytest.mark.parametrize("policy,kwargs,field", [("rkv", {"buffer": 10**9}, "buffer"),
                                                  ("snapkv", {"buffer": 65, "window": 8}, "buffer"),
                                                  ("hardkv", {"interval": 10**9, "window": 8}, "interval")])
def test_buffer_past_max_positions_is_refused_before_allocation(monkeypatch, policy, kwargs, field):
    """budget + buffer slots (10**9: ~256 GB on this tiny model) that no sequence within the positions fills."""
    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    monkeypatch.setattr(CompressedKVCache, "__init__", None)  # allocating would raise a TypeError instead
    value = kwargs[field]
    with pytest.raises(ValueError, match=rf"CompressionConfig.{field}={value} exceeds the model's "
                                         rf"max_position_embeddings=64: policy '{policy}' would hold budget \+ {field} "
                                         rf"= {32 + value} slots.*Use {field} <= 64"):
        RolloutEngine(model, CompressionConfig(policy, budget=32, **kwargs))


def test_full_ignores_a_budget_and_says_so():
    with pytest.warns(UserWarning, match=r"budget=256 is ignored by policy 'full'.*budget=None"):
        config = CompressionConfig("full", budget=256)
    assert RolloutEngine(tiny_model("llama"), config).kv_cache_bytes() == 0  # sized per generate call


def test_past_max_positions_refused_for_full_and_warned_for_a_compressing_policy():
    model = tiny_model("llama")
    model.config.max_position_embeddings = 32
    prompts, params = [[1] * 10, [2] * 20], SamplingParams(max_new_tokens=13, **GREEDY)
    with pytest.raises(ValueError, match=r"longest prompt \(20 tokens\) \+ max_new_tokens=13 = 33 exceeds the "
                                         r"model's max_position_embeddings=32.*lower max_new_tokens to <= 12"):
        RolloutEngine(model, max_batch=2).generate(prompts, params)
    engine = RolloutEngine(model, CompressionConfig("streaming", budget=16), max_batch=2)
    with pytest.warns(UserWarning, match=r"= 33 exceeds the model's max_position_embeddings=32. Allowed with "
                                         r"policy 'streaming'"):
        results = engine.generate(prompts, params)
    assert [len(r.token_ids) for r in results] == [13, 13]
    RolloutEngine(model, max_batch=2).generate(prompts, SamplingParams(max_new_tokens=12, **GREEDY))  # fits


@pytest.mark.parametrize("policy,budget", [("full", None), ("rkv", 16)])
def test_deleting_an_engine_frees_its_cache_without_gc(policy, budget):
    """No reference cycle: the cache's tensors die with the last reference to the engine (gc disabled)."""
    def build():
        engine = RolloutEngine(tiny_model("llama"), CompressionConfig(policy, budget=budget, buffer=8) if budget
                               else None, max_batch=2)
        engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=30, repetition_penalty=1.1, **GREEDY))
        return engine, [engine.cache.k, engine.cache.v, engine._runner.tokens]

    assert freed_without_gc(build)


def test_close_and_context_manager_free_the_cache():
    model = tiny_model("llama")
    with RolloutEngine(model, CompressionConfig("longflow", budget=16), max_batch=2) as engine:
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, **GREEDY))
        k = weakref.ref(engine.cache.k)
    assert k() is None and engine.kv_cache_bytes() == 0
    with pytest.raises(RuntimeError, match=r"closed.*make a new RolloutEngine"):
        engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
    engine.close()  # idempotent


BAD_REQUESTS = [
    ([1, 2, 3], SamplingParams(max_new_tokens=4), r"flat list of 3 ints.*pass \[prompt_ids\]"),
    (torch.tensor([1, 2, 3]), SamplingParams(max_new_tokens=4), r"flat list of 3 ints"),
    ([[1, 2], "hi"], SamplingParams(max_new_tokens=4), r"prompt_token_ids\[1\]='hi' is not a list of token ids"),
    ([[1, 2], [True, 2]], SamplingParams(max_new_tokens=4), r"\[1\] holds True \(bool\), not an int token id"),
    ([[1, 256]], SamplingParams(max_new_tokens=4), r"token id 256 outside the vocabulary \[0, 256\)"),
    ([[1], [1] * 8193], SamplingParams(max_new_tokens=4), r"\[1\] has 8193 tokens.*max_position_embeddings=8192"),
]


@pytest.mark.parametrize("prompts,params,match", BAD_REQUESTS)
def test_generate_input_errors(prompts, params, match):
    engine = RolloutEngine(tiny_model("llama"), max_batch=1)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, params)


@pytest.mark.parametrize("prompts,params,match", BAD_REQUESTS)
def test_pool_input_errors_equal_the_engines(prompts, params, match):
    from kvroll.rollout.pool import RolloutPool  # importable without Ray; Ray starts only in RolloutPool()

    model = tiny_model("llama")
    with pytest.raises(ValueError, match=match) as from_engine:
        RolloutEngine(model, max_batch=1).generate(prompts, params)
    # no workers, no Ray: the check comes first, with the limits RolloutPool.__init__ reads from the model config
    pool = types.SimpleNamespace(vocab_size=model.config.vocab_size,
                                 max_positions=model.config.max_position_embeddings)
    with pytest.raises(ValueError, match=match) as from_pool:
        RolloutPool.submit(pool, prompts, params)
    assert str(from_pool.value) == str(from_engine.value)


def test_device_errors():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda' but this torch build has no usable CUDA device.*"
                                             r"device='cpu'"):
            RolloutEngine(tiny_model("llama"), device="cuda")
    with pytest.raises(ValueError, match=r"device='tpu9' is not a device"):
        RolloutEngine(tiny_model("llama"), device="tpu9")
    with pytest.raises(ValueError, match=r"device='meta' but the model's parameters are on cpu.*model.to"):
        RolloutEngine(tiny_model("llama"), device="meta")
    RolloutEngine(tiny_model("llama"), device="cpu")
