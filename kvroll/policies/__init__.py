"""Eviction policies, selected by name through :class:`kvroll.CompressionConfig`."""
from kvroll.policies.registry import POLICIES, policy_names, register_policy

__all__ = ["POLICIES", "policy_names", "register_policy"]
