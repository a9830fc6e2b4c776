"""Bad input raises a ValueError naming the field, the value and what is allowed, before any model work."""
import math

import pytest

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from tests.conftest import tiny_model


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy="nope", budget=8), r"policy='nope'.*\['full', .*'longflow'.*'random'.*'streaming'"),
    (dict(policy="longflow", budget=0), r"budget=0.*>= 2"),
    (dict(policy="longflow", budget=-5), r"budget=-5"),
    (dict(policy="longflow", budget=None), r"budget=None"),
    (dict(policy="streaming", budget=5), r"budget=5.*>= 6.*sink_tokens=4"),
    (dict(policy="longflow", budget=8, sink_tokens=4, window=4), r"budget=8.*>= 9"),
    (dict(policy="longflow", budget=64, granularity="token"), r"granularity='token'.*'head' or 'layer'"),
    (dict(policy="longflow", budget=64, lamda=0.1), r"unknown keyword.*\['lamda'\]"),
    (dict(policy="streaming", budget=64, sink_tokens=-1), r"sink_tokens=-1.*>= 0"),
])
def test_compression_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), r"temperature=-0.1.*>= 0"),
    (dict(temperature=math.nan), r"temperature=nan.*finite"),
    (dict(temperature=math.inf), r"temperature=inf.*finite"),
    (dict(top_p=0.0), r"top_p=0.0.*\(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1.5"),
    (dict(top_k=-1), r"top_k=-1.*>= 0"),
    (dict(max_new_tokens=0), r"max_new_tokens=0.*>= 1"),
    (dict(min_p=2.0), r"min_p=2.0"),
    (dict(repetition_penalty=0.0), r"repetition_penalty=0.0"),
])
def test_sampling_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def engine():
    model = tiny_model("llama")
    model.config.max_position_embeddings = 64
    engine = RolloutEngine(model, compression=CompressionConfig("longflow", budget=16), max_batch=2)

    def refuse(*args, **kwargs):
        raise AssertionError("model work started before validation")

    engine._prefill = refuse  # any error must come first
    return engine


@pytest.mark.parametrize("prompts,n,match", [
    ([[1, 2], []], 1, r"prompt_token_ids\[1\] is empty"),
    ([[1, 256]], 1, r"prompt_token_ids\[0\] holds token id 256 outside the vocabulary \[0, 256\)"),
    ([[-1]], 1, r"token id -1 outside"),
    ([[1] * 65], 1, r"65 tokens, more than the model's max_position_embeddings=64"),
    ([], 1, r"non-empty list"),
    ([[1, 2]], 0, r"n=0 is invalid: n must be an integer >= 1"),
])
def test_generate_input_errors(engine, prompts, n, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingParams(max_new_tokens=4), n=n)


def test_unsupported_architecture_names_the_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama.*qwen2.*qwen3.*mistral"):
        RolloutEngine(model)


def test_max_batch_error():
    with pytest.raises(ValueError, match=r"max_batch=0"):
        RolloutEngine(tiny_model(), max_batch=0)


def test_missing_model_directory_error(tmp_path):
    with pytest.raises(ValueError, match=r"neither 'smollm2' nor a Hugging Face model directory"):
        RolloutEngine(str(tmp_path / "nowhere"))
