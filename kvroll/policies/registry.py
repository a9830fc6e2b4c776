"""The one registry of eviction policies: name -> (hyperparameter dataclass, policy class).

    register_policy("first_recent", FirstRecentParams, FirstRecentPolicy)   # a policy of one's own
    CompressionConfig("first_recent", budget=64, first=8)                   # then selected by name like the others

``examples/custom_policy.py`` writes one and runs it.
"""
from __future__ import annotations

import dataclasses

from kvroll.policies.baselines import FullParams, FullPolicy, RandomParams, RandomPolicy, StreamingParams, StreamingPolicy
from kvroll.policies.h2o import H2OParams, H2OPolicy
from kvroll.policies.hardkv import HardKVParams, HardKVPolicy
from kvroll.policies.lagkv import LagKVParams, LagKVPolicy
from kvroll.policies.longflow import LongFlowParams, LongFlowPolicy
from kvroll.policies.rkv import RKVParams, RKVPolicy
from kvroll.policies.snapkv import SnapKVParams, SnapKVPolicy

POLICIES: dict[str, tuple[type, type]] = {
    "full": (FullParams, FullPolicy),
    "random": (RandomParams, RandomPolicy),
    "streaming": (StreamingParams, StreamingPolicy),
    "snapkv": (SnapKVParams, SnapKVPolicy),
    "h2o": (H2OParams, H2OPolicy),
    "rkv": (RKVParams, RKVPolicy),
    "longflow": (LongFlowParams, LongFlowPolicy),
    "lagkv": (LagKVParams, LagKVPolicy),
    "hardkv": (HardKVParams, HardKVPolicy),
}


# The methods a registered policy class provides (kvroll/policies/base.py: Policy, whose attributes name, periodic,
# stat and granularity may be set per instance); a step policy adds step_scores, a periodic one compress.
REQUIRED = ("protected", "capacity", "prompt_keep", "prompt_keep_idx", "validate_budget")


def policy_names() -> list[str]:
    """The registered policies' names (the registry's order)."""
    return list(POLICIES)


def register_policy(name: str, params_cls: type, policy_cls: type, replace: bool = False) -> None:
    """Add a policy under ``name``; ``CompressionConfig(name, budget, **params)`` then builds
    ``policy_cls(params_cls(**params))``. Registration is per process: a Ray worker imports it for itself."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"register_policy: name={name!r} is invalid; use a Python identifier such as 'my_policy'.")
    if name in POLICIES and not replace:
        raise ValueError(f"register_policy: {name!r} is already registered; pick another name or pass replace=True.")
    if not (dataclasses.is_dataclass(params_cls) and params_cls.__dataclass_params__.frozen):
        raise ValueError(f"register_policy: params_cls={params_cls!r} must be a frozen dataclass of the policy's "
                         "hyperparameters (@dataclass(frozen=True)).")
    missing = [attr for attr in REQUIRED if not hasattr(policy_cls, attr)]
    step_or_compress = "compress" if getattr(policy_cls, "periodic", False) else "step_scores"
    if not hasattr(policy_cls, step_or_compress):
        missing.append(step_or_compress)
    if missing:
        raise ValueError(f"register_policy: policy_cls {getattr(policy_cls, '__name__', policy_cls)!r} lacks "
                         f"{missing}; see the Policy protocol in kvroll/policies/base.py.")
    if getattr(policy_cls, "name", name) != name:
        raise ValueError(f"register_policy: policy_cls.name={policy_cls.name!r} differs from name={name!r}; the "
                         "engine reports the policy by that attribute, so make them equal.")
    POLICIES[name] = (params_cls, policy_cls)
