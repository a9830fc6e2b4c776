"""The torch sampler's processors at their boundaries against HF's warpers (fp32, the same order: penalty, T, top-k,
top-p, min-p): an exact top-p cut, a top-p so small that only the top token stays, min-p = 1 over a tie at the top,
top-k one short of the vocabulary and tied at the k-th, the penalty's sign rule; and that ``sample`` draws only from
that support, its processed logprob the warped one."""
import pytest
import torch
from transformers.generation.logits_process import (LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from kvroll import SamplingParams
from kvroll.rollout.sampling import apply_repetition_penalty, filter_logits, sample


def hf_warped(logits, params, ids=None):
    steps = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty)] if ids is not None else []
    steps.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        steps.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        steps.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        steps.append(MinPLogitsWarper(params.min_p))
    return LogitsProcessorList(steps)(ids if ids is not None else torch.zeros(1, 0, dtype=torch.long), logits.clone())


QUARTERS = torch.tensor([[0.5, 0.25, 0.25, 0.0]]).log()  # fp32 softmax: exactly 0.5, 0.25, 0.25, 0


@pytest.mark.parametrize("logits, kwargs, support", [
    (QUARTERS, dict(top_p=0.75), 2),  # ascending cumulative mass 0, 0.25 <= 1 - 0.75: the first 0.25 is cut (HF's <=)
    (torch.tensor([[3.0, 1.0, 0.5, -2.0]]), dict(top_p=1e-9), 1),  # 1 - 1e-9 is 1.0 in fp32: the top token stays
    (torch.tensor([[2.0, 2.0, 1.0, -1.0]]), dict(min_p=1.0), 2),  # min-p = 1 keeps the tied top (probs == limit)
    (torch.tensor([[3.0, 1.0, 0.5, -2.0]]), dict(top_k=3), 3),  # top-k one short of the vocabulary cuts one
    (torch.tensor([[3.0, 1.0, 1.0, -2.0]]), dict(top_k=2), 3),  # a tie at the k-th is kept (HF's <)
])
def test_filters_at_their_boundaries_are_hfs(logits, kwargs, support):
    params = SamplingParams(temperature=1.0, **kwargs)
    got, want = filter_logits(logits, params), hf_warped(logits, params)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (got, want)
    assert int(torch.isfinite(got).sum()) == support
    rows = 4000
    tokens, logprobs = sample(logits.expand(rows, -1), SamplingParams(temperature=1.0, logprobs_mode="processed",
                                                                     **kwargs), torch.Generator().manual_seed(0))
    assert torch.isfinite(want[0, tokens]).all()  # drawn only inside HF's support
    torch.testing.assert_close(logprobs, want.log_softmax(-1)[0, tokens], atol=1e-6, rtol=0)
    assert len(tokens.unique()) == support


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_as_hf():
    logits = torch.tensor([[2.0, -2.0, 0.0, 1.0, -0.5]])
    ids = torch.tensor([[0, 1, 2, 4]])
    seen = torch.zeros(1, 5, dtype=torch.bool)
    seen[0, ids[0]] = True
    got = apply_repetition_penalty(logits, seen, 1.5)
    assert torch.equal(got, RepetitionPenaltyLogitsProcessor(1.5)(ids, logits.clone()))
    assert got.tolist() == [[torch.tensor(2.0 / 1.5).item(), -3.0, 0.0, 1.0, -0.75]]
