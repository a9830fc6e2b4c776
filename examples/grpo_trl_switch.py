"""Plain TRL GRPO on a local Hugging Face model directory; switching its rollouts to kvroll is the only change.

    python examples/grpo_trl_switch.py                          # the embedded model's HF directory, kvroll rollouts
    python examples/grpo_trl_switch.py --model /path/to/hf_model --steps 20
    python examples/grpo_trl_switch.py --trl                    # the same script on TRL's own model.generate

The switch, against a plain TRL script:

    - from trl import GRPOConfig, GRPOTrainer
    + from kvroll.trainers import GRPOConfig, GRPOTrainer
      args = GRPOConfig(..., use_kvroll=True, kvroll_policy="rkv", kvroll_budget=80, kvroll_policy_kwargs={"buffer": 8})

``--model`` is any local directory with a config.json and a tokenizer (Llama, Qwen2, Qwen3 or Mistral); by
default the directory the embedded SmolLM2-135M-Instruct is converted into (``kvroll.rollout.model``).
"""
import argparse
import random
import re

import torch
from datasets import Dataset

from kvroll.rollout.model import smollm2_checkpoint
from kvroll.trainers import GRPOConfig, GRPOTrainer  # plain TRL: from trl import GRPOConfig, GRPOTrainer

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--model", default=None, help="a local HF model directory (default: the embedded model's)")
p.add_argument("--steps", type=int, default=3)
p.add_argument("--max-completion-length", type=int, default=32)
p.add_argument("--out", default="runs/example_grpo")
p.add_argument("--trl", action="store_true", help="TRL's own rollouts (model.generate) instead of kvroll's")
opts = p.parse_args()

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
    output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=8, num_generations=4,
    max_completion_length=opts.max_completion_length, learning_rate=2e-5, logging_steps=1, report_to="none",
    save_strategy="no", use_cpu=cpu, bf16=not cpu,
    use_kvroll=not opts.trl, kvroll_policy="rkv", kvroll_budget=80, kvroll_policy_kwargs={"buffer": 8},
)
model = opts.model or str(smollm2_checkpoint())
trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=dataset)
trainer.train()
for h in trainer.state.log_history:
    if "reward" in h:
        kv = (f"  KV {h['kvroll/kv_bytes'] / 2**20:.2f} MiB of {h['kvroll/kv_bytes_full_equivalent'] / 2**20:.2f} "
              f"(full), {h['kvroll/evicted_tokens']:.0f} evicted" if "kvroll/kv_bytes" in h else "")
        print(f"step {h['step']}: reward {h['reward']:.3f}, completion length {h['completions/mean_length']:.1f}{kv}")
