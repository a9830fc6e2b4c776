"""Edges the engine tests leave open: the processors' boundaries against HF's warpers, stop ids under ignore_eos,
a prompt of exactly max_position_embeddings tokens."""
from pathlib import Path

import pytest
import torch

from kvroll import CompressionConfig, RolloutEngine, SamplingParams
from kvroll.rollout.requests import validate_request
from kvroll.rollout.sampling import filter_logits
from tests.conftest import tiny_model
from tests.rollout.test_engine import GREEDY, random_prompts


@pytest.mark.parametrize("top_p,min_p", [(0.75, 0.0), (0.5, 0.0), (1.0, 1.0), (1.0, 0.5)])
def test_top_p_and_min_p_keep_what_hf_keeps_at_a_tie(top_p, min_p):
    """Equal logits put the cumulative mass exactly on 1 - top_p and every probability exactly on min_p * max: HF's
    warpers drop the tokens at or under the top-p line and keep those at the min-p line (min_p=1 keeps the top tie)."""
    from transformers import MinPLogitsWarper, TopPLogitsWarper

    logits = torch.zeros(2, 8)
    logits[1, :4] = 1.0
    ref = logits.clone()
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    if min_p > 0.0:
        ref = MinPLogitsWarper(min_p)(None, ref)
    got = filter_logits(logits, SamplingParams(top_p=top_p, min_p=min_p))
    assert torch.isfinite(got).sum(-1).tolist() == torch.isfinite(ref).sum(-1).tolist()


def test_ignore_eos_still_stops_at_the_given_stop_ids():
    model = tiny_model()
    model.generation_config.eos_token_id = 3
    prompts = random_prompts(3, 256, 4, 12, seed=4)
    free = RolloutEngine(model, max_batch=3).generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True,
                                                                              **GREEDY))
    stop = free[0].token_ids[5]
    got = RolloutEngine(model, max_batch=3).generate(
        prompts, SamplingParams(max_new_tokens=16, ignore_eos=True, stop_token_ids=[stop], **GREEDY))
    for ref, result in zip(free, got):
        end = ref.token_ids.index(stop) + 1 if stop in ref.token_ids else 16
        assert result.token_ids == ref.token_ids[:end]
        assert result.finish_reason == ("stop" if stop in ref.token_ids else "length")


def test_a_prompt_of_exactly_max_positions_tokens_is_taken():
    params = SamplingParams(max_new_tokens=1)
    assert validate_request([[1] * 64], params, 1, vocab_size=256, max_positions=64) == [[1] * 64]
    with pytest.raises(ValueError, match=r"has 65 tokens, more than the model's max_position_embeddings=64"):
        validate_request([[1] * 65], params, 1, vocab_size=256, max_positions=64)
    model = tiny_model()
    model.config.max_position_embeddings = 64
    engine = RolloutEngine(model, compression=CompressionConfig("streaming", budget=32), max_batch=1)
    with pytest.warns(UserWarning, match=r"exceeds the model's max_position_embeddings=64"):
        assert len(engine.generate([[1] * 64], SamplingParams(max_new_tokens=2, **GREEDY))[0].token_ids) == 2


def test_a_given_tokenizers_eos_joins_the_models_stop_ids():
    import types

    model = tiny_model()
    model.generation_config.eos_token_id = [250, 251]
    prompts = random_prompts(3, 256, 4, 12, seed=4)
    free = RolloutEngine(model, max_batch=3).generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True,
                                                                              **GREEDY))
    eos = free[1].token_ids[3]
    engine = RolloutEngine(model, max_batch=3, tokenizer=types.SimpleNamespace(eos_token_id=eos))
    assert set(engine.eos_ids) == {250, 251, eos}
    got = engine.generate(prompts, SamplingParams(max_new_tokens=16, **GREEDY))
    for ref, result in zip(free, got):
        stops = [i for i, t in enumerate(ref.token_ids) if t in (250, 251, eos)]
        assert result.token_ids == ref.token_ids[:stops[0] + 1 if stops else 16]


@pytest.mark.parametrize("tokenizer", ["gpt2", b"gpt2", Path("tok")])
def test_a_tokenizer_given_by_name_is_refused(tokenizer):
    """A name was kept as engine.tokenizer, never loaded: its EOS silently missing from the stop ids."""
    with pytest.raises(TypeError, match=r"RolloutEngine.tokenizer=.* is a name, not a tokenizer: pass a tokenizer "):
        RolloutEngine(tiny_model(), max_batch=1, tokenizer=tokenizer)
