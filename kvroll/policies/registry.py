"""The one registry of eviction policies: name -> (hyperparameter dataclass, policy class)."""
from __future__ import annotations

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


def policy_names() -> list[str]:
    return list(POLICIES)
