"""Tests for mutants of kvroll/bench/fidelity.py that survived tests/policies/test_fidelity_eval.py: --ignore-eos scoring
the steps past a reference's EOS (and only then), the length checks' lower bound."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvroll.bench.fidelity
from kvroll import CompressionConfig, RolloutEngine
from kvroll.bench.fidelity import check_inputs, run_fidelity


class _Tokenizer:
    def apply_chat_template(self, messages, add_generation_prompt, return_dict):
        return [1 + len(messages[0]["content"]) % 80] * 6

    def decode(self, ids):
        return " ".join(map(str, ids))


@pytest.fixture
def tiny(monkeypatch):
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=89, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    monkeypatch.setattr(kvroll.bench.fidelity, "_load", lambda name, device="cpu": (model, _Tokenizer()))
    monkeypatch.setattr(kvroll.bench.fidelity, "load_config", lambda name: model.config)
    return model


def test_a_reference_is_scored_to_its_eos_unless_ignore_eos(tiny, monkeypatch):
    """Row 0's reference says EOS at step 1: scored for 2 steps (EOS counted), or all 5 with ignore_eos."""
    (eos, *_) = sorted(RolloutEngine(tiny, CompressionConfig("full"), max_batch=1).eos_ids)
    real = kvroll.bench.fidelity.greedy_reference

    def reference_with_eos(engine, prompts, steps):
        tokens, logprobs = real(engine, prompts, steps)
        tokens[0, 1] = eos
        tokens[1] = torch.where(tokens[1] == eos, (eos + 1) % 89, tokens[1])  # row 1: no EOS
        return tokens, logprobs

    monkeypatch.setattr(kvroll.bench.fidelity, "greedy_reference", reference_with_eos)
    args = dict(policies=["full"], budgets=[16], max_new_tokens=5, num_prompts=2, log=lambda s: 0)
    to_eos = run_fidelity("tiny", **args)
    assert to_eos["reference_lengths"] == [2, 5] and not to_eos["ignore_eos"]
    past = run_fidelity("tiny", ignore_eos=True, **args)
    assert past["reference_lengths"] == [5, 5] and past["ignore_eos"]
    # full agrees with its own reference except at the EOS put in by hand: 1 miss in 2 + 5 scored steps
    assert to_eos["results"][0]["top1_agreement"] == pytest.approx(6 / 7)
    assert to_eos["results"][0]["greedy_prefix_min"] == 1 and to_eos["results"][0]["greedy_prefix_mean"] == 3.0


@pytest.mark.parametrize("flag, kwargs", [("--num-prompts", dict(num_prompts=0)),
                                          ("--max-new-tokens", dict(max_new_tokens=0)),
                                          ("--max-new-tokens", dict(max_new_tokens=True))])
def test_lengths_below_one_are_refused_by_flag(tiny, flag, kwargs):
    args = {**dict(max_new_tokens=4, num_prompts=None), **kwargs}
    with pytest.raises(ValueError, match=rf"{flag}={list(kwargs.values())[0]!r} is invalid: it must be an integer "
                                         r">= 1"):
        check_inputs("tiny", ["full"], [16], args["max_new_tokens"], args["num_prompts"])


def test_regenerate_command_repeats_every_flag_given(tiny, tmp_path):
    """fidelity.md's command reproduces the run: --num-prompts and --ignore-eos included when given."""
    import argparse

    from kvroll.bench.fidelity import run_eval_fidelity

    args = argparse.Namespace(model="tiny", policies=["full", "streaming"], budgets=[16, 24], max_new_tokens=3,
                              num_prompts=1, prompts=None, threads=None, device="cpu", out=str(tmp_path / "o"),
                              ignore_eos=True)
    assert run_eval_fidelity(args) == 0
    assert ("kvroll eval fidelity --model tiny --policies full,streaming --budgets 16,24 --max-new-tokens 3 "
            "--num-prompts 1 --ignore-eos") in (tmp_path / "o" / "fidelity.md").read_text()
