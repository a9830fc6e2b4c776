"""On the embedded SmolLM2 at budget 128 over a 512-token continuation, every informed policy has a lower mean
teacher-forced KL(full || policy) than random eviction (fixed seeds). One full-KV reference is shared."""
import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine
from kvroll.bench.fidelity import load_prompts, policy_kwargs
from kvroll.rollout.replay import greedy_reference, kl_and_agreement

BUDGET, NEW_TOKENS = 128, 512
INFORMED = ["snapkv", "h2o", "rkv", "longflow", "lagkv", "hardkv"]


@pytest.fixture(scope="module")
def reference(smollm2):
    model, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": load_prompts()[0]}], add_generation_prompt=True,
                                     return_dict=False)
    engine = RolloutEngine(model, CompressionConfig("full"), max_batch=1, tokenizer=tok)
    tokens, logprobs = greedy_reference(engine, [prompt], NEW_TOKENS)
    return model, [prompt], tokens, logprobs


def _run(reference, policy):
    model, prompts, tokens, logprobs = reference
    engine = RolloutEngine(model, CompressionConfig(policy, BUDGET, **policy_kwargs(policy, BUDGET)), max_batch=1)
    bytes_before = engine.kv_cache_bytes()
    kl, agree = kl_and_agreement(engine, prompts, tokens, logprobs)
    assert torch.isfinite(kl).all()
    assert engine.kv_cache_bytes() == bytes_before  # static: allocated once
    return engine, float(kl.mean())


@pytest.fixture(scope="module")
def random_kl(reference):
    return _run(reference, "random")[1]


@pytest.mark.slow
@pytest.mark.parametrize("policy", INFORMED)
def test_informed_policy_beats_random(reference, random_kl, policy):
    engine, kl = _run(reference, policy)
    assert kl < random_kl, f"{policy}: mean KL {kl:.4f} >= random's {random_kl:.4f}"
    if policy == "hardkv":  # head-adaptive: live counts differ across heads inside the fixed buffers
        live = engine.cache.count[:, 0]  # [layers, kv_heads]
        assert bool((live.amax(-1) != live.amin(-1)).any()), live
        assert int(live.max()) <= engine.cache.capacity
        assert bool((engine.cache.state["temp"][:, 0] > 0).all())  # calibrated at the first compression
