"""Eviction policies, selected by name through :class:`kvroll.CompressionConfig`.

The registry loads on first use (it imports torch); ``BUILTIN_POLICIES`` does not, so a command line checks a policy
name before torch is imported.
"""
# The registry's built-in names, in its order; tests/policies/test_registry.py checks them against POLICIES.
BUILTIN_POLICIES = ("full", "random", "streaming", "snapkv", "h2o", "rkv", "longflow", "lagkv", "hardkv")
_LAZY = ("POLICIES", "policy_names", "register_policy")
__all__ = ["BUILTIN_POLICIES", "known_policies", *_LAZY]


def known_policies() -> list[str]:
    """The names a ``CompressionConfig`` takes now, without importing torch: the built-in ones, and those registered
    with ``register_policy`` (which can only be there once the registry is imported)."""
    import sys

    registry = sys.modules.get("kvroll.policies.registry")
    return list(registry.POLICIES) if registry is not None else list(BUILTIN_POLICIES)


def __getattr__(name: str):
    if name in _LAZY:
        from kvroll.policies import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'kvroll.policies' has no attribute {name!r}")
