"""``kvroll train``: the arithmetic task, the shipped YAML config, and a 2-step run on a tiny model directory."""
from __future__ import annotations

import json
from pathlib import Path

from kvroll.policies.registry import POLICIES
from kvroll.trainers.arithmetic import arithmetic_problems, correctness_reward, format_reward
from kvroll.trainers.train import build_parser, main

from .tiny_model import tiny_llama, tokenizer

CONFIG = Path(__file__).parents[2] / "configs" / "grpo_smollm2.yaml"


def test_problems_are_reproducible_and_correct():
    problems = arithmetic_problems(50, seed=3, max_operand=9, ops="+-*")
    assert problems == arithmetic_problems(50, seed=3, max_operand=9, ops="+-*")
    for p in problems:
        a, op, b = p["question"].removeprefix("What is ").removesuffix("?").split()
        assert str(eval(f"{int(a)} {op} {int(b)}")) == p["answer"]


def test_rewards():
    completions = [[{"role": "assistant", "content": c}] for c in
                   ["3 + 4 = 7 so <answer>7</answer>", "<answer> 8 </answer>", "the answer is 7", "<answer>x</answer>"]]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0]
    assert correctness_reward(completions, answer=["7"] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_shipped_config_parses():
    task, args = build_parser().parse_args_and_config(["--config", str(CONFIG)])
    assert task.model == "smollm2" and args.use_kvroll and args.kvroll_policy in POLICIES
    assert args.num_generations == 4 and args.per_device_train_batch_size % args.num_generations == 0


def test_two_step_run_saves_model_and_logs(tmp_path, capsys):
    tok = tokenizer()
    model_dir = tmp_path / "tiny"
    tiny_llama(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    out = tmp_path / "run"
    assert main(["--config", str(CONFIG), "--model", str(model_dir), "--output_dir", str(out), "--max_steps", "2",
                 "--max_completion_length", "12", "--kvroll_budget", "16", "--task_size", "8"]) == 0
    printed = capsys.readouterr().out
    assert "step   1/2  reward" in printed and "step   2/2  reward" in printed and "done in" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all("rewards/format_reward/mean" in r and "kvroll/rollout_seconds" in r for r in rows)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    history = json.loads((out / "log_history.json").read_text())
    assert history[-1]["step"] == 2


def test_cli_routes_train_to_trl_parser():
    from kvroll.cli import build_parser

    ns = build_parser().parse_args(["train", "--config", str(CONFIG), "--max_steps", "3"])
    assert ns.command == "train" and ns.train_args == ["--config", str(CONFIG), "--max_steps", "3"]
