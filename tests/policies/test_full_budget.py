"""A budget covering the whole sequence must reproduce ``full`` token for token (tiny random-weight Llama)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvroll import CompressionConfig, RolloutEngine, SamplingParams

NEW_TOKENS = 150


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (20, 45, 9)]
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    full = RolloutEngine(model, CompressionConfig("full"), max_batch=3).generate(prompts, sampling)
    return model, prompts, sampling, [c.token_ids for c in full]


@pytest.mark.parametrize("policy, kwargs", [
    ("snapkv", {}), ("h2o", {}), ("rkv", {}), ("lagkv", {"lag": 8}),
    ("hardkv", {"p": 1.0, "interval": 32}),  # p = 1 keeps every candidate: compressions run, nothing is lost
])
def test_covering_budget_reproduces_full(tiny, policy, kwargs):
    model, prompts, sampling, want = tiny
    engine = RolloutEngine(model, CompressionConfig(policy, budget=256, **kwargs), max_batch=3)
    got = [c.token_ids for c in engine.generate(prompts, sampling)]
    assert got == want


def test_small_budget_changes_tokens_but_stays_finite(tiny):
    """The same harness notices eviction: a tight budget diverges from full (so the test above can fail)."""
    model, prompts, sampling, want = tiny
    engine = RolloutEngine(model, CompressionConfig("hardkv", budget=48, interval=16, window=8), max_batch=3)
    got = [c.token_ids for c in engine.generate(prompts, sampling)]
    assert got != want
    live = engine.cache.count[0]  # [slots, kv_heads]
    assert int(live.max()) <= engine.cache.capacity
