"""``kvroll train``: GRPO or PPO with compressed-KV rollouts on the offline arithmetic task (the main job).

    kvroll train --config configs/grpo_smollm2.yaml
    kvroll train --config configs/ppo_smollm2.yaml          # trainer: ppo (kvroll's PPOTrainer, PPOConfig fields)
    kvroll train --config configs/grpo_smollm2.yaml --max_steps 20 --kvroll_policy longflow --kvroll_budget 32

Every ``GRPOConfig`` field (TRL's and kvroll's) is a flat YAML key and a ``--flag``; the task adds ``model`` and
``task_*``. Prints the rewards each step; saves the model, ``log_history.json`` and ``metrics.jsonl`` (one line per
logged step) to ``output_dir``.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainerCallback


@dataclass
class TaskArguments:
    """What to train and on which generated problems."""

    model: str = field(default="smollm2", metadata={"help": "'smollm2' (embedded) or a local HF model directory."})
    task_size: int = field(default=256, metadata={"help": "Number of generated arithmetic problems."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the problem generator."})
    task_max_operand: int = field(default=20, metadata={"help": "Operands are drawn from [0, task_max_operand]."})
    task_reasoning: bool = field(default=False, metadata={"help": "Ask for worked (longer) answers."})
    task_ops: str = field(default="+", metadata={"help": "Operators to draw from, a string of '+', '-', '*'."})
    trainer: str = field(default="grpo", metadata={"help": "'grpo' (TRL's GRPOTrainer) or 'ppo' (kvroll's "
                                                           "PPOTrainer); picks the config fields the parser reads."})


def add_train_parser(subparsers) -> None:
    """Register ``kvroll train``; everything after ``train`` goes to TRL's parser (``--config file.yaml``, flags)."""
    p = subparsers.add_parser("train", help="GRPO or PPO with compressed-KV rollouts (kvroll train --config FILE.yaml)",
                              add_help=False, prefix_chars="\0")  # no options of its own: TRL's parser reads them
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=lambda ns: main(ns.train_args))


def build_parser(trainer: str = "grpo"):
    """TRL's parser over (TaskArguments, GRPOConfig or PPOConfig); without CUDA it defaults to CPU and fp32."""
    import torch
    from trl import TrlParser

    from kvroll.trainers import GRPOConfig, PPOConfig

    parser = TrlParser((TaskArguments, PPOConfig if trainer == "ppo" else GRPOConfig))
    if not torch.cuda.is_available():
        parser.set_defaults(use_cpu=True, bf16=False)  # TRL defaults to bf16, which a CPU runs as slow autocast
    return parser


def main(argv: list[str] | None = None) -> int:
    task, args = build_parser(trainer_name(argv)).parse_args_and_config(argv)
    return train(task, args)


def trainer_name(argv: list[str] | None) -> str:
    """``--trainer`` from the command line, else the ``trainer`` key of the ``--config`` YAML, else 'grpo'."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    flags = dict(zip(argv, argv[1:]))
    name = flags.get("--trainer")
    if name is None and "--config" in flags:
        import yaml

        name = (yaml.safe_load(Path(flags["--config"]).read_text()) or {}).get("trainer")
    name = name or "grpo"
    if name not in ("grpo", "ppo"):
        raise ValueError(f"trainer={name!r} is invalid; choose 'grpo' or 'ppo'.")
    return name


def train(task: TaskArguments, args) -> int:
    from kvroll.trainers import GRPOTrainer, PPOTrainer
    from kvroll.trainers.arithmetic import arithmetic_dataset, correctness_reward, format_reward

    dataset = arithmetic_dataset(task.task_size, task.task_seed, task.task_max_operand, task.task_ops,
                                 task.task_reasoning)
    trainer_cls = PPOTrainer if task.trainer == "ppo" else GRPOTrainer
    trainer = trainer_cls(model=task.model, reward_funcs=[format_reward, correctness_reward], args=args,
                          train_dataset=dataset)
    printer = RewardPrinter(Path(args.output_dir), args.max_steps)
    trainer.add_callback(printer)
    if trainer.accelerator.is_main_process:
        rollout = (f"kvroll {args.kvroll_policy} budget {args.kvroll_budget}" if args.use_kvroll
                   else "TRL model.generate")
        print(f"kvroll train: {task.model}, {len(dataset)} problems, rollouts: {rollout}, "
              f"{args.per_device_train_batch_size} rows x {trainer.accelerator.num_processes} ranks a step, "
              f"{task.trainer}, G={getattr(args, 'num_generations', 1)}, "
              f"max_completion_length={args.max_completion_length}", flush=True)
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        (Path(args.output_dir) / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
        printer.summary()
    return 0


class RewardPrinter(TrainerCallback):
    """Prints one line of rewards per logged step and appends the step's logs to ``metrics.jsonl``."""

    def __init__(self, out_dir: Path, max_steps: int):
        self.path, self.max_steps, self.rows, self.start = out_dir / "metrics.jsonl", max_steps, [], time.time()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or "reward" not in logs:
            return
        row = {"step": state.global_step, "elapsed_s": round(time.time() - self.start, 1), **logs}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        get = logs.get
        print(f"step {state.global_step:>3}/{self.max_steps}  reward {get('reward'):.3f}  "
              f"format {get('rewards/format_reward/mean', float('nan')):.2f}  "
              f"correct {get('rewards/correctness_reward/mean', float('nan')):.2f}  "
              f"len {get('completions/mean_length', float('nan')):.0f}  "
              f"|dlogp| {get('sampling/sampling_logp_difference/mean', float('nan')):.3f}  "
              f"rollout {get('kvroll/rollout_seconds', float('nan')):.1f}s  "
              f"sync {1000 * get('kvroll/sync_seconds', float('nan')):.2f}ms  "
              f"elapsed {row['elapsed_s']:.0f}s", flush=True)

    def summary(self) -> None:
        if not self.rows:
            return
        half = max(1, len(self.rows) // 2)
        first = sum(r["reward"] for r in self.rows[:half]) / half
        last = sum(r["reward"] for r in self.rows[-half:]) / half
        print(f"kvroll train: done in {time.time() - self.start:.0f}s; mean reward first half {first:.3f}, "
              f"last half {last:.3f}; logs in {self.path.parent}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
