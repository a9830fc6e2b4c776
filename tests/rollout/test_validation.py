"""Bad input raises a ValueError naming the field, the value and what is allowed, before any model work."""
import math

import numpy as np
import pytest
import torch

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
    # logits / 1e-40 overflows fp32: token 0 with NaN logprobs before the check
    (dict(temperature=1e-40), r"temperature=1e-40 is invalid.*0 \(greedy\) or >= 1e-05.*use 0 for greedy"),
    (dict(temperature=9e-6), r"temperature=9e-06 is invalid"),
    (dict(max_new_tokens=True), r"max_new_tokens=True is invalid.*not a bool"),
    (dict(top_k=True), r"top_k=True is invalid.*not a bool"),  # was taken as top-1
    (dict(ignore_eos="no"), r"ignore_eos='no' is invalid.*True or False"),  # a truthy string
    (dict(seed=True), r"seed=True is invalid"),
    (dict(seed=2**64), r"seed=18446744073709551616 is invalid.*\[-2\*\*63, 2\*\*64\)"),  # past manual_seed's range
    (dict(seed=2**70), r"seed=1180591620717411303424 is invalid"),  # was an overflow inside generate
    (dict(seed=1.0), r"seed=1.0 is invalid"),
    (dict(stop_token_ids=2), r"stop_token_ids=2 is invalid.*a list, tuple or set.*\[2\] for one"),
    (dict(stop_token_ids="2"), r"stop_token_ids='2' is invalid"),
    (dict(stop_token_ids=[True]), r"stop_token_ids=\[True\] is invalid"),
    (dict(stop_token_ids=[2.0]), r"stop_token_ids=\[2.0\] is invalid"),
    (dict(stop_token_ids=[2, -1]), r"stop_token_ids=\[2, -1\] is invalid.*non-negative"),  # never sampled
    (dict(logprobs_mode="processed_logprobs"), r"logprobs_mode='processed_logprobs' is invalid.*\['raw', 'processed'\]"),
])
def test_sampling_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_edges_that_stay_allowed():
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    # torch.manual_seed's whole range: random.getrandbits(64) seeds, and negative ones (they wrap modulo 2**64)
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1 and SamplingParams(seed=-1).seed == -1
    torch.Generator().manual_seed(2**64 - 1), torch.Generator().manual_seed(-(2**63))
    assert SamplingParams(stop_token_ids={7, 2}).stop_token_ids in ((2, 7), (7, 2))  # a set, as the engine keeps
    assert SamplingParams(stop_token_ids=range(2, 4)).stop_token_ids == (2, 3)
    given = SamplingParams(max_new_tokens=np.int64(8), top_k=np.int32(5), seed=np.int64(3), ignore_eos=np.True_)
    assert (given.max_new_tokens, given.top_k, given.seed, given.ignore_eos) == (8, 5, 3, True)
    assert type(given.max_new_tokens) is int and type(given.seed) is int and given.ignore_eos is True
    assert SamplingParams(stop_token_ids=[np.int64(2), 7]).stop_token_ids == (2, 7)
    assert type(SamplingParams(stop_token_ids=[np.int64(2)]).stop_token_ids[0]) is int


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
    ([[1.0, 2]], 1, r"prompt_token_ids\[0\] holds 1.0 \(float\), not an int token id"),
    ([[1, 2], [True, False]], 1, r"prompt_token_ids\[1\] holds True \(bool\), not an int token id"),
    ([[torch.tensor(1), 2]], 1, r"holds tensor\(1\) \(Tensor\), not an int token id"),
    ([[[1, 2]]], 1, r"prompt_token_ids\[0\] holds \[1, 2\] \(list\), not an int token id"),  # one level too deep
    (torch.tensor([[[1, 2]]]), 1, r"holds \[1, 2\] \(list\), not an int token id"),
    (np.array([[1.5, 2.0]]), 1, r"holds 1.5 \(float\), not an int token id"),
    ([np.array([[1, 2]])], 1, r"prompt_token_ids\[0\]=array\(\[\[1, 2\]\]\) is not a list of token ids"),
])
def test_generate_input_errors(engine, prompts, n, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingParams(max_new_tokens=4), n=n)


@pytest.mark.parametrize("prompts", [
    [[np.int64(5), 7, np.int32(9)]],  # numpy integers, e.g. read from an array
    np.array([[5, 7, 9]]),  # a 2-D integer array, as a 2-D tensor is
    [np.array([5, 7, 9], dtype=np.int64)],
    torch.tensor([[5, 7, 9]]),
])
def test_numpy_token_ids_generate_what_python_ints_do(prompts):
    engine = RolloutEngine(tiny_model("llama"), max_batch=1)
    params = SamplingParams(max_new_tokens=5, temperature=0)
    got = engine.generate(prompts, params)
    assert got[0].prompt_ids == [5, 7, 9] and all(type(t) is int for t in got[0].prompt_ids)
    assert got[0].token_ids == engine.generate([[5, 7, 9]], params)[0].token_ids


@pytest.mark.parametrize("model", [123, None])
def test_engine_model_of_the_wrong_type_is_a_type_error_naming_model(model):
    with pytest.raises(TypeError, match=rf"RolloutEngine.model={model!r} \({type(model).__name__}\) is not a model: "
                                        r"pass 'smollm2', a local Hugging Face model directory"):
        RolloutEngine(model)


def test_compression_policy_of_the_wrong_type_is_a_type_error_naming_policy():
    with pytest.raises(TypeError, match=r"CompressionConfig.policy=\['rkv'\] must be a policy name \(a str\)"):
        CompressionConfig(["rkv"])


def test_unsupported_architecture_names_the_families():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama.*qwen2.*qwen3.*mistral"):
        RolloutEngine(model)


@pytest.mark.parametrize("head", ["LlamaModel", "LlamaForTokenClassification", "LlamaForSequenceClassification"])
def test_a_supported_family_without_a_causal_lm_head_is_refused(head):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, num_labels=3, pad_token_id=0)
    model = getattr(transformers, head)(config).eval()
    with pytest.raises(ValueError, match=rf"RolloutEngine.model is a {head}, not a causal LM: pass .*ForCausalLM"):
        RolloutEngine(model)


@pytest.mark.parametrize("max_batch", [0, True])
def test_max_batch_error(max_batch):
    with pytest.raises(ValueError, match=rf"max_batch={max_batch!r} is invalid"):
        RolloutEngine(tiny_model(), max_batch=max_batch)


def test_missing_model_directory_error(tmp_path):
    with pytest.raises(ValueError, match=r"neither 'smollm2' nor a Hugging Face model directory"):
        RolloutEngine(str(tmp_path / "nowhere"))


def test_a_model_directory_without_a_tokenizer_loads_when_one_is_given(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)  # config and weights, no tokenizer files
    tokenizer = object()
    engine = RolloutEngine(str(tmp_path), max_batch=1, tokenizer=tokenizer)
    assert engine.tokenizer is tokenizer
    got = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, temperature=0.0))[0].token_ids
    assert got == RolloutEngine(model, max_batch=1).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4,
                                                                                          temperature=0.0))[0].token_ids
    assert RolloutEngine(bytes(tmp_path), max_batch=1, tokenizer=tokenizer).tokenizer is tokenizer  # a bytes path


def test_a_dtype_or_device_named_as_the_models_own_is_taken():
    model = tiny_model()
    assert RolloutEngine(model, dtype="float32").model is model
    assert RolloutEngine(model, dtype="torch.float32").model is model
    assert RolloutEngine(model, device="cpu:0").device == torch.device("cpu")
    assert RolloutEngine(model, sync_every=np.int64(2)).sync_every == 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.int32), r"RolloutEngine.dtype=torch.int32 is invalid: it must be a floating-point torch dtype"),
    (dict(dtype="bogus"), r"RolloutEngine.dtype='bogus' is invalid"),
    (dict(cuda_graphs="no"), r"RolloutEngine.cuda_graphs='no' is invalid: it must be True, False or None"),
])
def test_engine_setting_errors_name_the_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutEngine(tiny_model(), **kwargs)


def test_a_named_model_with_a_bad_dtype_is_refused_before_loading(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"RolloutEngine.dtype='bogus' is invalid"):
        RolloutEngine(str(tmp_path), dtype="bogus", tokenizer=object())
