"""``CompressionConfig``: which eviction policy, which budget, and the policy's own hyperparameters.

    CompressionConfig(policy="longflow", budget=256)                    # paper defaults
    CompressionConfig(policy="longflow", budget=256, granularity="layer")  # a policy keyword
    CompressionConfig.from_yaml("configs/policies/rkv.yaml")            # a preset (flat keys)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroll.checks import as_int
from kvroll.policies.base import make_params
from kvroll.policies.registry import POLICIES


class CompressionConfig:
    """A validated (policy, budget, hyperparameters) triple; ``build()`` makes the policy object.

    ``budget`` is the number of tokens each sequence keeps per KV head (``rkv`` and ``snapkv`` add their buffer on
    top, ``hardkv`` its interval). For ``full`` it may be left as None. Every check of the values alone runs here,
    before any model is loaded (against a model's positions: ``kvroll.rollout.model.check_budget_fits``).
    """

    def __init__(self, policy: str = "full", budget: int | None = None, **kwargs: Any):
        if not isinstance(policy, str):
            raise TypeError(f"CompressionConfig.policy={policy!r} must be a policy name (a str), one of "
                            f"{sorted(POLICIES)}; pass one name, e.g. policy='rkv'.")
        if policy not in POLICIES:
            raise ValueError(
                f"CompressionConfig.policy={policy!r} is not a known policy; choose one of {sorted(POLICIES)}."
            )
        params_cls, policy_cls = POLICIES[policy]
        self.policy = policy
        if as_int(budget) is not None:  # a numpy integer is taken, as a Python int
            budget = as_int(budget)
        self.budget = budget
        self.params = make_params(params_cls, policy, kwargs)
        self._policy_cls = policy_cls
        self.build().validate_budget(budget)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "CompressionConfig":
        """Load a preset: a flat YAML mapping ``policy``, ``budget`` and the policy's hyperparameters.

        ``overrides`` replace keys of the file (e.g. ``budget=128``); ``policy=...`` names the policy of a file
        without one. Errors name the file and the field.
        """
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise ValueError(f"{path}: cannot read the policy preset ({err}).") from err
        if not isinstance(data, dict) or "policy" not in {**data, **overrides}:
            raise ValueError(f"{path}: a policy preset is a flat mapping with at least a 'policy' key (or a "
                             f"policy=... override), e.g. 'policy: rkv' and 'budget: 1024'; got {data!r}.")
        data = {**data, **overrides}
        try:
            return cls(**data)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from err

    def build(self):
        """A fresh policy object carrying this config's hyperparameters."""
        return self._policy_cls(self.params)

    def __repr__(self) -> str:
        return f"CompressionConfig(policy={self.policy!r}, budget={self.budget!r}, params={self.params!r})"
