"""kvroll: fast, memory-bounded RL rollouts on a static compressed KV cache.

    from kvroll import RolloutEngine, SamplingParams, CompressionConfig
    engine = RolloutEngine("smollm2", compression=CompressionConfig(policy="longflow", budget=256))
    results = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=64, temperature=0.7, seed=0), n=4)
"""
from kvroll.config import CompressionConfig
from kvroll.rollout.engine import Completion, RolloutEngine
from kvroll.rollout.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["CompressionConfig", "Completion", "RolloutEngine", "SamplingParams", "__version__"]
