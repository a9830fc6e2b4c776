"""The arithmetic task's ``long`` style: short prompts, multi-operand problems, "answer is N" rewards."""
from __future__ import annotations

import re

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


def test_short_rewards_take_the_first_tagged_answer_signed():
    completions = [[{"role": "assistant", "content": c}] for c in
                   ["<answer>-3</answer>", "<answer>3</answer> no: <answer>7</answer>", "<answer>7</answer> <answer>3",
                    "3 + 4 = 7, <answer>8</answer>"]]
    assert format_reward(completions) == [1.0, 1.0, 1.0, 1.0]
    # the first tag counts: hedging with several answers earns nothing; the right number in the reasoning neither
    assert correctness_reward(completions, answer=["-3", "7", "7", "7"]) == [1.0, 0.0, 1.0, 0.0]
    assert final_answer_correctness_reward([[{"role": "assistant", "content": "ANSWER IS 7"}]], answer=["7"]) == [1.0]


@pytest.mark.parametrize("operands", [2, 3])
def test_operands_cover_zero_to_max_operand(operands):
    problems = arithmetic_problems(400, seed=0, max_operand=3, ops="+", operands=operands)
    columns = zip(*(map(int, p["question"].removeprefix("What is ").removesuffix("?").split(" + ")) for p in problems))
    assert [sorted(set(c)) for c in columns] == [[0, 1, 2, 3]] * operands


def test_reasoning_prompt_shows_a_worked_example():
    plain, worked = (arithmetic_dataset(1, reasoning=r)[0]["prompt"] for r in (False, True))
    assert "<answer>" in plain[0]["content"] and "step by step" not in plain[0]["content"]
    assert "step by step" in worked[0]["content"] and len(worked[2]["content"]) > len(plain[2]["content"])
    assert plain[-1] == worked[-1]  # the same question


@pytest.mark.parametrize("kwargs, message", [
    (dict(size=True), "size=True"), (dict(size=4, max_operand=0), "max_operand=0"),
    (dict(size=4, ops=""), "ops=''"), (dict(size=4, ops="+/"), "ops='+/'")])
def test_bad_problem_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        arithmetic_problems(**kwargs)


def test_rewards_read_commas_the_minus_sign_and_markdown_as_one_integer():
    long = [[{"role": "assistant", "content": c}] for c in
            ["The answer is 1,234.", "The answer is: **7**", "**The answer is:** -7", "The answer is \u2212 7.",
             "The answer is 07", "The answer is \uff17.", "the answer is 12,345,6", "the answer is 1,23"]]
    assert final_answer_format_reward(long) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    # 1,234 is not 1; U+2212 keeps its sign; a fullwidth digit is not an ASCII integer
    assert final_answer_correctness_reward(long, answer=["1234", "7", "-7", "-7", "7", "7", "12", "1"]) == [
        1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert final_answer_correctness_reward(long[:1] + long[3:4], answer=["1", "7"]) == [0.0, 0.0]
    short = [[{"role": "assistant", "content": c}] for c in
             ["<answer>1,234</answer>", "<answer>\u22127</answer>", "<answer>\uff17</answer>", "<answer>-0</answer>"]]
    assert format_reward(short) == [1.0, 1.0, 0.0, 1.0]
    assert correctness_reward(short, answer=["1234", "-7", "7", "0"]) == [1.0, 1.0, 0.0, 1.0]
