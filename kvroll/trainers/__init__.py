"""TRL integration: GRPO, RLOO and PPO with compressed-KV rollouts behind one config switch.

    from kvroll.trainers import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir="out", use_kvroll=True, kvroll_policy="longflow", kvroll_budget=1024)
    GRPOTrainer(model="smollm2", reward_funcs=reward, args=args, train_dataset=dataset).train()

Supports TRL ``>=1.16,<1.17`` (checked when the trainers are first imported; see ``kvroll/trainers/_trl.py``).
The trainers load lazily, so ``kvroll.trainers.train.add_train_parser`` costs the CLI no TRL import.
"""
from kvroll.trainers._trl import SUPPORTED_TRL, check_trl_version

_LAZY = {"GRPOConfig": "grpo", "GRPOTrainer": "grpo", "RLOOConfig": "rloo", "RLOOTrainer": "rloo",
         "PPOConfig": "ppo", "PPOTrainer": "ppo"}
__all__ = [*_LAZY, "SUPPORTED_TRL", "check_trl_version"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvroll.trainers.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvroll.trainers' has no attribute {name!r}")
