"""Plain TRL GRPO on a small arithmetic task; switching its rollouts to kvroll is the only change.

    python examples/grpo_trl_switch.py              # kvroll rollouts (compressed KV, IS correction on)
    python examples/grpo_trl_switch.py --trl        # the same script on TRL's own model.generate

The switch, against a plain TRL script:

    - from trl import GRPOConfig, GRPOTrainer
    + from kvroll.trainers import GRPOConfig, GRPOTrainer
      args = GRPOConfig(..., use_kvroll=True, kvroll_policy="rkv", kvroll_budget=80, kvroll_policy_kwargs={"buffer": 8})
"""
import random
import re
import sys

import torch
from datasets import Dataset

from kvroll.rollout.model import smollm2_checkpoint
from kvroll.trainers import GRPOConfig, GRPOTrainer  # plain TRL: from trl import GRPOConfig, GRPOTrainer

rng = random.Random(0)
pairs = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(64)]
shot = [{"role": "system", "content": "Answer with the final number inside answer tags, e.g. <answer>42</answer>."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4. <answer>4</answer>"}]  # SmolLM2-135M needs the example
dataset = Dataset.from_list([{"prompt": shot + [{"role": "user", "content": f"What is {a} + {b}?"}],
                              "answer": str(a + b)} for a, b in pairs])


def correct(completions, answer, **kwargs):
    found = [re.search(r"<answer>\s*(-?\d+)\s*</answer>", c[0]["content"]) for c in completions]
    return [1.0 if m and m.group(1) == a else 0.0 for m, a in zip(found, answer)]


cpu = not torch.cuda.is_available()
args = GRPOConfig(
    output_dir="runs/example_grpo", max_steps=3, per_device_train_batch_size=8, num_generations=4,
    max_completion_length=32, learning_rate=2e-5, logging_steps=1, report_to="none", save_strategy="no",
    use_cpu=cpu, bf16=not cpu,
    use_kvroll="--trl" not in sys.argv, kvroll_policy="rkv", kvroll_budget=80, kvroll_policy_kwargs={"buffer": 8},
)
trainer = GRPOTrainer(model=str(smollm2_checkpoint()), reward_funcs=correct, args=args, train_dataset=dataset)
trainer.train()
print([round(h["reward"], 3) for h in trainer.state.log_history if "reward" in h])
