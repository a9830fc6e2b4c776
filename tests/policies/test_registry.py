"""``register_policy``: a policy of one's own is selected by name like the built-in ones; a class that does not
follow the protocol is refused with the missing methods named."""
from dataclasses import dataclass

import pytest

from kvroll.usage import UsageError, check_policy_names
from kvroll.config import CompressionConfig
from kvroll.policies import BUILTIN_POLICIES, known_policies
from kvroll.policies.baselines import StreamingParams, StreamingPolicy
from kvroll.policies.registry import POLICIES, register_policy


@pytest.fixture
def registry():
    before = dict(POLICIES)
    yield
    POLICIES.clear()
    POLICIES.update(before)


class MyStreaming(StreamingPolicy):
    name = "my_streaming"


def test_the_torch_free_names_are_the_registrys():
    """A command line checks a policy name against BUILTIN_POLICIES before torch loads: the same names, in order."""
    assert BUILTIN_POLICIES == tuple(POLICIES)


def test_registered_policy_is_built_by_name(registry):
    with pytest.raises(UsageError, match="'my_streaming' is not a known policy"):
        check_policy_names("--policy", "my_streaming")
    register_policy("my_streaming", StreamingParams, MyStreaming)
    assert known_policies()[-1] == "my_streaming"
    check_policy_names("--policy", "my_streaming")  # once registered, a name the checks take
    config = CompressionConfig("my_streaming", budget=16, sink_tokens=2)
    policy = config.build()
    assert isinstance(policy, MyStreaming) and policy.protected() == (2, 1)
    with pytest.raises(ValueError, match="sink_tokens=2 plus the current token"):
        CompressionConfig("my_streaming", budget=3, sink_tokens=2)


@dataclass
class Loose:  # not frozen
    x: int = 0


class NoScores:
    name, periodic = "no_scores", False

    def protected(self):
        return 0, 1


@pytest.mark.parametrize("name, params, cls, message", [
    ("rkv", StreamingParams, MyStreaming, "'rkv' is already registered"),
    ("my-policy", StreamingParams, MyStreaming, "name='my-policy' is invalid"),
    ("my_streaming", Loose, MyStreaming, "must be a frozen dataclass"),
    ("no_scores", StreamingParams, NoScores, r"lacks \['capacity', 'prompt_keep', 'prompt_keep_idx', "
                                             r"'validate_budget', 'step_scores'\]"),
    ("other_name", StreamingParams, MyStreaming, "policy_cls.name='my_streaming' differs from name='other_name'"),
])
def test_bad_registration_is_refused_by_name(registry, name, params, cls, message):
    with pytest.raises(ValueError, match=message):
        register_policy(name, params, cls)
    assert name not in POLICIES or name == "rkv"
