"""``CompressionConfig``: which eviction policy, which budget, and the policy's own hyperparameters.

    CompressionConfig(policy="longflow", budget=256)                    # paper defaults
    CompressionConfig(policy="longflow", budget=256, granularity="layer")  # a policy keyword
"""
from __future__ import annotations

from typing import Any

from kvroll.policies.base import make_params
from kvroll.policies.registry import POLICIES


class CompressionConfig:
    """A validated (policy, budget, hyperparameters) triple; ``build()`` makes the policy object.

    ``budget`` is the number of tokens each sequence keeps per KV head (R-KV adds its buffer on top). For
    ``full`` it may be left as None. Every check runs here, before any model is loaded.
    """

    def __init__(self, policy: str = "full", budget: int | None = None, **kwargs: Any):
        if policy not in POLICIES:
            raise ValueError(
                f"CompressionConfig.policy={policy!r} is not a known policy; choose one of {sorted(POLICIES)}."
            )
        params_cls, policy_cls = POLICIES[policy]
        self.policy = policy
        self.budget = budget
        self.params = make_params(params_cls, policy, kwargs)
        self._policy_cls = policy_cls
        self.build().validate_budget(budget)

    def build(self):
        """A fresh policy object carrying this config's hyperparameters."""
        return self._policy_cls(self.params)

    def __repr__(self) -> str:
        return f"CompressionConfig(policy={self.policy!r}, budget={self.budget!r}, params={self.params!r})"
