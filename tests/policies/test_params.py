"""Hyperparameter validation (errors name the field, the value and the allowed range) and the YAML presets."""
from pathlib import Path

import numpy as np
import pytest

from kvroll import CompressionConfig
from kvroll.policies.registry import POLICIES

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "policies"


@pytest.mark.parametrize("policy, kwargs, field, value, allowed", [
    ("rkv", {"mix_lambda": 1.5}, "mix_lambda", "1.5", "[0.0, 1.0]"),
    ("rkv", {"mix_lambda": -0.1}, "mix_lambda", "-0.1", "[0.0, 1.0]"),
    ("rkv", {"threshold": 1.2}, "threshold", "1.2", "[-1.0, 1.0]"),
    ("rkv", {"beta": -1}, "beta", "-1", ">= 0"),
    ("lagkv", {"lag": 0}, "lag", "0", ">= 1"),
    ("lagkv", {"ratio": 0.0}, "ratio", "0.0", "(0.0, 1.0]"),
    ("lagkv", {"ratio": 1.01}, "ratio", "1.01", "(0.0, 1.0]"),
    ("hardkv", {"p": 0}, "p", "0", "(0.0, 1.0]"),
    ("hardkv", {"p": 1.1}, "p", "1.1", "(0.0, 1.0]"),
    ("hardkv", {"base": "h2o"}, "base", "'h2o'", "one of"),
    ("snapkv", {"pool_kernel": 4}, "pool_kernel", "4", "odd"),
])
def test_out_of_range_hyperparameter_names_field_value_and_range(policy, kwargs, field, value, allowed):
    with pytest.raises(ValueError) as err:
        CompressionConfig(policy, budget=1024, **kwargs)
    message = str(err.value)
    assert f"{field}={value}" in message and allowed in message


@pytest.mark.parametrize("policy, kwargs, match", [
    ("h2o", {"window": 128}, r"window=128 is invalid: window must be < budget"),  # its default window fits
    ("hardkv", {"window": 128}, r"budget=128 is invalid.*>= 140.*window=128.*raise the budget or lower window"),
    ("snapkv", {"window": 128, "buffer": 128}, r"budget=128 is invalid.*>= 129.*window=128.*or lower window"),
    ("rkv", {"window": 128}, r"budget=128 is invalid.*>= 129.*window=128.*or lower window"),
])
def test_window_not_below_budget_is_rejected(policy, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompressionConfig(policy, budget=128, **kwargs)
    CompressionConfig(policy, budget=256, **kwargs)


@pytest.mark.parametrize("policy, budget, window", [("rkv", 4, 8), ("snapkv", 16, 32), ("hardkv", 32, 32)])
def test_budget_below_the_default_window_is_blamed_on_the_budget(policy, budget, window):
    """The user set only the budget: the error must name it first, not the window they never touched."""
    with pytest.raises(ValueError) as err:
        CompressionConfig(policy, budget=budget)
    message = str(err.value)
    assert message.startswith(f"CompressionConfig.budget={budget} is invalid"), message
    assert f"window={window}" in message and "lower window" in message


@pytest.mark.parametrize("sinks, smallest", [(2, 5), (5, 11), (0, 2)])
def test_h2o_states_the_smallest_budget_its_default_window_takes(sinks, smallest):
    """H2O's default window is budget // 2: the error names the budget and the smallest one that fits beside the
    sinks (it used to state a minimum it then refused, blaming the window the user never set)."""
    with pytest.raises(ValueError) as err:
        CompressionConfig("h2o", budget=smallest - 1, sink_tokens=sinks)
    assert str(err.value).startswith(f"CompressionConfig.budget={smallest - 1} is invalid for policy 'h2o': budget "
                                     f"must be an integer >= {smallest}"), str(err.value)
    CompressionConfig("h2o", budget=smallest, sink_tokens=sinks)


def test_lagkv_budget_too_small_for_lag_says_how_to_fix():
    with pytest.raises(ValueError, match=r"budget=128 is invalid.*lower lag"):
        CompressionConfig("lagkv", budget=128)
    CompressionConfig("lagkv", budget=128, lag=32)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "rkv", "lagkv", "hardkv"])
def test_unknown_keyword_is_rejected(policy):
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['lamda'\]"):
        CompressionConfig(policy, budget=1024, lamda=0.1)


def test_every_policy_has_a_preset_that_loads():
    names = {p.stem for p in PRESETS.glob("*.yaml")}
    assert names == set(POLICIES)
    for name in names:
        config = CompressionConfig.from_yaml(PRESETS / f"{name}.yaml")
        assert config.policy == name
    rkv = CompressionConfig.from_yaml(PRESETS / "rkv.yaml", budget=256)
    assert (rkv.budget, rkv.params.mix_lambda, rkv.params.buffer, rkv.params.window) == (256, 0.1, 128, 8)


def test_preset_errors_name_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: lagkv\nbudget: 1024\nratio: 2\n")
    with pytest.raises(ValueError, match=r"bad.yaml: LagKVParams.ratio=2 is invalid"):
        CompressionConfig.from_yaml(bad)
    bad.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match=r"bad.yaml: a policy preset is a flat mapping"):
        CompressionConfig.from_yaml(bad)


def test_lagkv_smallest_budget_is_sinks_plus_three_lags():
    """S + 3L: sinks, a compressed region of at least one lag and a raw tail of up to 2 lags (not S + 2L, which
    leaves the region no room: every compression would drop all it compressed)."""
    with pytest.raises(ValueError, match=r"budget=399 is invalid for policy 'lagkv': budget must be an integer >= 400"):
        CompressionConfig("lagkv", budget=399)
    CompressionConfig("lagkv", budget=400)


def test_numpy_hyperparameters_are_taken_as_python_numbers():
    """As a numpy budget is: np.int64(7) was refused as "must be an integer"."""
    config = CompressionConfig("rkv", np.int64(64), pool_kernel=np.int64(7), mix_lambda=np.float32(0.25))
    params = config.build().params
    assert (params.pool_kernel, params.mix_lambda) == (7, 0.25)
    assert type(params.pool_kernel) is int and type(params.mix_lambda) is float
    with pytest.raises(ValueError, match="pool_kernel"):  # a numpy bool is still not a number
        CompressionConfig("rkv", 64, pool_kernel=np.bool_(True))
