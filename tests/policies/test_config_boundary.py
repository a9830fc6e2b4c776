"""CompressionConfig at its boundary: full's budget, the presets against the paper defaults, a preset that is not
UTF-8, and an empty prompt set refused before the model loads."""
from pathlib import Path

import pytest

from kvroll import CompressionConfig
from kvroll.policies.registry import POLICIES

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "policies"


@pytest.mark.parametrize("budget", ["x", "128", 1.5, True, 0, -5, [64], float("nan")])
def test_full_refuses_a_budget_no_policy_takes(budget):
    """It only warned ("is ignored by policy 'full'") for a string, a float, a bool, 0 or a negative budget."""
    with pytest.raises(ValueError) as err:
        CompressionConfig("full", budget=budget)
    message = str(err.value)
    assert message.startswith(f"CompressionConfig.budget={budget!r} is invalid for policy 'full': budget must be "
                              "an integer >= 1") and "budget=None" in message, message


def test_full_still_takes_an_integer_budget_with_a_warning():
    with pytest.warns(UserWarning, match=r"budget=64 is ignored by policy 'full'"):
        assert CompressionConfig("full", budget=64).budget == 64
    assert CompressionConfig("full").budget is None


# The paper defaults (DESIGN.md 2.2, docs/fidelity.md, each policy's docstring), field by field.
PAPER = {
    "full": (None, {}),
    "random": (1024, {"seed": 0}),
    "streaming": (1024, {"sink_tokens": 4}),
    "snapkv": (1024, {"window": 32, "pool_kernel": 5, "buffer": 128}),
    "h2o": (1024, {"window": None, "sink_tokens": 0}),
    "rkv": (1024, {"buffer": 128, "window": 8, "pool_kernel": 7, "threshold": 0.5, "beta": 1, "mix_lambda": 0.1}),
    "longflow": (3200, {"granularity": "head", "sink_tokens": 0, "window": 1, "prompt_window": 32,
                        "prompt_pool_kernel": 5}),
    "lagkv": (1024, {"sink_tokens": 16, "lag": 128, "ratio": 0.5}),
    "hardkv": (1024, {"p": 0.9, "base": "attention", "interval": 128, "window": 32, "sink_tokens": 4,
                      "min_keep": 8, "max_keep": None, "pool_kernel": 5, "calibration_iters": 60}),
}


@pytest.mark.parametrize("policy", sorted(PAPER))
def test_each_preset_is_the_paper_defaults_and_the_dataclass_defaults(policy):
    import dataclasses
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # full's preset passes no budget: no warning
        config = CompressionConfig.from_yaml(PRESETS / f"{policy}.yaml")
    budget, params = PAPER[policy]
    assert (config.policy, config.budget) == (policy, budget)
    assert dataclasses.asdict(config.params) == params
    assert config.params == POLICIES[policy][0]()  # the preset spells out the class defaults, nothing else


def test_a_preset_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"policy: rkv\nbudget: 128 # caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1.yaml: cannot read the policy preset \("):
        CompressionConfig.from_yaml(bad)


def test_an_empty_prompt_set_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    import kvroll.bench.fidelity

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the prompts were checked")

    monkeypatch.setattr(kvroll.bench.fidelity, "_load", no_load)
    monkeypatch.setattr(kvroll.bench.fidelity, "load_config", lambda name: LlamaConfig(max_position_embeddings=1024))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=rf"--prompts {empty} holds no prompts"):
        kvroll.bench.fidelity.run_fidelity("tiny", ["full"], [16], max_new_tokens=4, prompts_path=empty, log=lambda s: 0)
