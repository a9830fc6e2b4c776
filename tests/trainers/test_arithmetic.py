"""The arithmetic task's ``long`` style: short prompts, multi-operand problems, "answer is N" rewards."""
from __future__ import annotations

import pytest

from kvroll.trainers.arithmetic import (arithmetic_dataset, arithmetic_problems, correctness_reward,
                                        final_answer_correctness_reward, final_answer_format_reward, format_reward,
                                        reward_funcs)

from .tiny_model import tokenizer


@pytest.mark.parametrize("operands, ops", [(3, "+"), (4, "+-*"), (5, "-*")])
def test_multi_operand_answers_follow_precedence(operands, ops):
    problems = arithmetic_problems(40, seed=1, max_operand=9, ops=ops, operands=operands)
    assert problems == arithmetic_problems(40, seed=1, max_operand=9, ops=ops, operands=operands)
    for p in problems:
        expr = p["question"].removeprefix("What is ").removesuffix("?")
        assert len(expr.split()) == 2 * operands - 1
        assert str(eval(expr)) == p["answer"]  # a generated string of digits and + - *


def test_two_operand_problems_are_unchanged():
    # Pinned from the two-operand-only version: the main job's data must not move with the operands option.
    problems = arithmetic_problems(3, seed=2, max_operand=9, ops="+-*")
    assert [(p["question"], p["answer"]) for p in problems] == [
        ("What is 0 + 1?", "1"), ("What is 5 * 2?", "10"), ("What is 4 * 4?", "16")]


def test_long_prompts_are_short_and_hold_no_example():
    tok = tokenizer()
    rows = arithmetic_dataset(64, seed=0, max_operand=9, ops="+", style="long")
    assert all([m["role"] for m in r["prompt"]] == ["system", "user"] for r in rows)
    lengths = [len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, return_dict=False)) for r in rows]
    short = arithmetic_dataset(8, seed=0, max_operand=9, ops="+", reasoning=True)
    short_length = len(tok.apply_chat_template(short[0]["prompt"], add_generation_prompt=True, return_dict=False))
    assert max(lengths) <= 32 < short_length  # 25% of ~160-token completions (~40) keeps the prompt whole
    assert rows[0]["prompt"][-1]["content"].count("+") == 2


def test_final_answer_rewards():
    completions = [[{"role": "assistant", "content": c}] for c in
                   ["3 + 4 = 7. So, the answer is 7.", "The answer is: -2", "The answer is **7**", "the answer is 7.5",
                    "<answer>7</answer>", "The answer is 17. Or the answer is 7."]]
    assert final_answer_format_reward(completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert final_answer_correctness_reward(completions, answer=["7", "-2", "7", "7", "7", "7"]) == [
        1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_reward_funcs_and_bad_input():
    assert reward_funcs() == reward_funcs("short") == [format_reward, correctness_reward]
    assert reward_funcs("long") == [final_answer_format_reward, final_answer_correctness_reward]
    with pytest.raises(ValueError, match="style='tiny'"):
        reward_funcs("tiny")
    with pytest.raises(ValueError, match="style='tiny'"):
        arithmetic_dataset(4, style="tiny")
    with pytest.raises(ValueError, match="reasoning=True"):
        arithmetic_dataset(4, style="long", reasoning=True)
    with pytest.raises(ValueError, match="operands=1"):
        arithmetic_problems(4, operands=1)
