"""An offline, verifiable task for the main job: small arithmetic with the answer in tags.

    dataset = arithmetic_dataset(size=256, seed=0)      # columns: prompt (chat messages), answer (str)
    rewards = [format_reward, correctness_reward]       # TRL reward functions, 1.0 / 0.0 each

A completion is well formatted when it holds ``<answer>N</answer>`` with an integer N, and correct when the first
such N equals the answer exactly.
"""
from __future__ import annotations

import random
import re

SYSTEM_PROMPT = "Answer with the final number inside answer tags, for example <answer>42</answer>."
# One worked example, shown as a previous chat turn: SmolLM2-135M rarely uses the tags without one.
EXAMPLE = ("What is 2 + 2?", "2 + 2 = 4. <answer>4</answer>")
REASONING_PROMPT = ("Work it out step by step, then give the final number inside answer tags, for example "
                    "<answer>42</answer>.")
REASONING_EXAMPLE = ("What is 23 + 14?", "Add the tens: 20 + 10 = 30. Add the ones: 3 + 4 = 7. Together: 30 + 7 = "
                     "37. <answer>37</answer>")
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problems(size: int, seed: int = 0, max_operand: int = 50, ops: str = "+-") -> list[dict]:
    """``size`` problems ``a op b`` with operands in [0, max_operand], as {"question", "answer"} dicts."""
    if not (isinstance(size, int) and size >= 1):
        raise ValueError(f"size={size!r} is invalid: use an integer >= 1.")
    if not (isinstance(max_operand, int) and max_operand >= 1):
        raise ValueError(f"max_operand={max_operand!r} is invalid: use an integer >= 1.")
    if not ops or set(ops) - set(_OPS):
        raise ValueError(f"ops={ops!r} is invalid: use a non-empty string of {''.join(_OPS)!r}.")
    rng = random.Random(seed)
    problems = []
    for _ in range(size):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        problems.append({"question": f"What is {a} {op} {b}?", "answer": str(_OPS[op](a, b))})
    return problems


def arithmetic_dataset(size: int = 256, seed: int = 0, max_operand: int = 50, ops: str = "+-",
                       reasoning: bool = False):
    """A ``datasets.Dataset`` of conversational prompts for TRL (columns ``prompt`` and ``answer``).

    ``reasoning=True`` asks for (and shows) a worked, longer answer.
    """
    from datasets import Dataset

    system, (example_q, example_a) = (REASONING_PROMPT, REASONING_EXAMPLE) if reasoning else (SYSTEM_PROMPT, EXAMPLE)
    head = [{"role": "system", "content": system}, {"role": "user", "content": example_q},
            {"role": "assistant", "content": example_a}]
    rows = [{"prompt": head + [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
            for p in arithmetic_problems(size, seed, max_operand, ops)]
    return Dataset.from_list(rows)


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def extract_answer(text: str) -> str | None:
    match = ANSWER.search(text)
    return match.group(1) if match else None


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion holds ``<answer>N</answer>`` with an integer N."""
    return [1.0 if extract_answer(_text(c)) is not None else 0.0 for c in completions]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the first tagged integer equals the answer exactly."""
    return [1.0 if extract_answer(_text(c)) == str(a) else 0.0 for c, a in zip(completions, answer)]
