"""Tests for mutants of kvroll/config.py and kvroll/policies/base.py that survived tests/policies/test_params.py and
test_registry.py: a bool is not an integer (hyperparameter or budget), a float hyperparameter must be finite, and a
preset without 'policy' is refused (it would silently be 'full', the constructor's default)."""
import math

import pytest

from kvroll import CompressionConfig


@pytest.mark.parametrize("policy, kwargs, field", [
    ("rkv", {"beta": True}, "RKVParams.beta=True"), ("streaming", {"sink_tokens": False}, "StreamingParams.sink_tokens"),
    ("lagkv", {"lag": True}, "LagKVParams.lag=True"), ("random", {"seed": False}, "RandomParams.seed=False"),
])
def test_a_bool_is_not_an_integer_hyperparameter(policy, kwargs, field):
    with pytest.raises(ValueError, match=rf"{field}.* is invalid: .* must be an integer >= "):
        CompressionConfig(policy, budget=1024, **kwargs)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True])
@pytest.mark.parametrize("policy, field", [("rkv", "mix_lambda"), ("rkv", "threshold"), ("lagkv", "ratio"),
                                           ("hardkv", "p")])
def test_a_float_hyperparameter_is_a_finite_number(policy, field, value):
    with pytest.raises(ValueError, match=rf"{field}={value!r} is invalid: {field} must be a number in"):
        CompressionConfig(policy, budget=1024, **{field: value})


@pytest.mark.parametrize("policy", ["rkv", "streaming", "longflow", "lagkv", "h2o"])
def test_a_bool_budget_is_refused(policy):
    with pytest.raises(ValueError, match=rf"budget=True is invalid for policy '{policy}': budget must be an integer"):
        CompressionConfig(policy, budget=True)


def test_a_preset_without_a_policy_is_refused(tmp_path):
    preset = tmp_path / "nopolicy.yaml"
    preset.write_text("budget: 128\nwindow: 8\n")
    with pytest.raises(ValueError, match=r"nopolicy.yaml: a policy preset is a flat mapping with at least a 'policy'"):
        CompressionConfig.from_yaml(preset)


def test_a_preset_without_a_policy_loads_when_the_override_names_one(tmp_path):
    """The override supplies the policy; the file's other keys still apply. Neither naming one stays refused, and
    the error says both ways to name it."""
    preset = tmp_path / "nopolicy.yaml"
    preset.write_text("budget: 128\nwindow: 8\n")
    config = CompressionConfig.from_yaml(preset, policy="rkv")
    assert (config.policy, config.budget, config.params.window) == ("rkv", 128, 8)
    with pytest.raises(ValueError, match=r"nopolicy.yaml: .*'policy' key \(or a policy=\.\.\. override\).*got "
                                         r"\{'budget': 128, 'window': 8\}"):
        CompressionConfig.from_yaml(preset, budget=64)
