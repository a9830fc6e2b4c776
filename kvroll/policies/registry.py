"""The one registry of eviction policies: name -> (hyperparameter dataclass, policy class)."""
from __future__ import annotations

from kvroll.policies.baselines import FullParams, FullPolicy, RandomParams, RandomPolicy, StreamingParams, StreamingPolicy
from kvroll.policies.longflow import LongFlowParams, LongFlowPolicy

POLICIES: dict[str, tuple[type, type]] = {
    "full": (FullParams, FullPolicy),
    "random": (RandomParams, RandomPolicy),
    "streaming": (StreamingParams, StreamingPolicy),
    "longflow": (LongFlowParams, LongFlowPolicy),
}


def policy_names() -> list[str]:
    return list(POLICIES)
