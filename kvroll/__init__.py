"""kvroll: fast, memory-bounded RL rollouts on a static compressed KV cache.

    from kvroll import RolloutEngine, SamplingParams, CompressionConfig
    engine = RolloutEngine("smollm2", compression=CompressionConfig(policy="longflow", budget=256))
    results = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=64, temperature=0.7, seed=0), n=4)

The names load on first use, so ``import kvroll.cli`` checks a command line before torch is imported.
"""
__version__ = "0.1.0"
_LAZY = {"CompressionConfig": "kvroll.config", "Completion": "kvroll.rollout.engine",
         "RolloutEngine": "kvroll.rollout.engine", "SamplingParams": "kvroll.rollout.sampling"}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvroll' has no attribute {name!r}")
