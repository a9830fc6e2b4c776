"""TRL integration: GRPO and RLOO with compressed-KV rollouts behind one config switch.

    from kvroll.trainers import GRPOConfig, GRPOTrainer
    args = GRPOConfig(output_dir="out", use_kvroll=True, kvroll_policy="longflow", kvroll_budget=1024)
    GRPOTrainer(model="smollm2", reward_funcs=reward, args=args, train_dataset=dataset).train()

Supports TRL ``>=1.16,<1.17`` (checked at import; see ``kvroll/trainers/_trl.py``).
"""
from kvroll.trainers._trl import SUPPORTED_TRL, check_trl_version

check_trl_version()

from kvroll.trainers.grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from kvroll.trainers.rloo import RLOOConfig, RLOOTrainer  # noqa: E402

__all__ = ["GRPOConfig", "GRPOTrainer", "RLOOConfig", "RLOOTrainer", "SUPPORTED_TRL", "check_trl_version"]
