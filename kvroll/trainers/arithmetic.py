"""An offline, verifiable task for the main job: small arithmetic with the answer in tags.

    dataset = arithmetic_dataset(size=256, seed=0)      # columns: prompt (chat messages), answer (str)
    rewards = [format_reward, correctness_reward]       # TRL reward functions, 1.0 / 0.0 each
    dataset = arithmetic_dataset(size=256, style="long", max_operand=9)   # short prompt, long answers
    rewards = reward_funcs("long")

A completion is well formatted when it holds ``<answer>N</answer>`` with an integer N, and correct when the first
such N equals the answer. N is written in ASCII digits, may carry a sign (``-`` or the minus sign U+2212) and
thousands commas (``1,234``), and is compared as an integer (``07`` and ``7`` are the same answer).

``style="long"`` is the shape of reasoning workloads: a ~30-token prompt (a one-line system instruction and a
three-operand question, no worked example) and completions several times longer (SmolLM2-135M-Instruct explains
at length, ~100-200 tokens). Without a worked example that model almost never writes answer tags, so this style
scores a closing sentence instead (the prompt does not ask for it; the model learns it from the reward): well
formatted when the completion says ``answer is N``, correct when the first such N equals the answer.
"""
from __future__ import annotations

import random
import re

from kvroll.checks import as_int

SYSTEM_PROMPT = "Answer with the final number inside answer tags, for example <answer>42</answer>."
# One worked example, shown as a previous chat turn: SmolLM2-135M rarely uses the tags without one.
EXAMPLE = ("What is 2 + 2?", "2 + 2 = 4. <answer>4</answer>")
REASONING_PROMPT = ("Work it out step by step, then give the final number inside answer tags, for example "
                    "<answer>42</answer>.")
REASONING_EXAMPLE = ("What is 23 + 14?", "Add the tens: 20 + 10 = 30. Add the ones: 3 + 4 = 7. Together: 30 + 7 = "
                     "37. <answer>37</answer>")
LONG_PROMPT = "Explain each step."
# An integer: ASCII digits, a sign ('-', or U+2212 with at most one space before the digits), thousands commas.
_NUMBER = r"((?:-|\u2212 ?)?(?:\d{1,3}(?:,\d{3})+|\d+))"
ANSWER = re.compile(rf"<answer>\s*{_NUMBER}\s*</answer>", re.ASCII)
# "The answer is: 42.", "The answer is: **-7**", "the answer is 1,234"; not 7.5, 1,23 or 12,345,6
FINAL_ANSWER = re.compile(rf"answer is\W{{0,4}}?{_NUMBER}(?!\d|[.,]\d)", re.IGNORECASE | re.ASCII)
STYLES = ("short", "long")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def check_problem_args(size, max_operand, ops, prefix: str = "") -> None:
    """The generator's arguments, each error naming ``prefix`` + the argument (``kvroll train``: ``task_``)."""
    for name, value in (("size", size), ("max_operand", max_operand)):
        if not (as_int(value) is not None and value >= 1):
            raise ValueError(f"{prefix}{name}={value!r} is invalid: use an integer >= 1.")
    if not (isinstance(ops, str) and ops and set(ops) <= set(_OPS)):
        raise ValueError(f"{prefix}ops={ops!r} is invalid: use a non-empty string of {''.join(_OPS)!r} (e.g. '+-').")


def arithmetic_problems(size: int, seed: int = 0, max_operand: int = 50, ops: str = "+-",
                        operands: int = 2) -> list[dict]:
    """``size`` problems ``a op b [op c ...]`` with ``operands`` operands in [0, max_operand], as {"question",
    "answer"} dicts; the answer follows the usual precedence (``*`` before ``+``/``-``)."""
    check_problem_args(size, max_operand, ops)
    if not (as_int(operands) is not None and operands >= 2):
        raise ValueError(f"operands={operands!r} is invalid: use an integer >= 2.")
    rng = random.Random(seed if as_int(seed) is None else as_int(seed))  # random.Random refuses numpy integers
    problems = []
    for _ in range(size):  # draw order a, b, op (then c, op, ...) keeps the two-operand problems of earlier versions
        values = [rng.randint(0, max_operand), rng.randint(0, max_operand)]
        signs = [rng.choice(ops)]
        for _ in range(operands - 2):
            values.append(rng.randint(0, max_operand))
            signs.append(rng.choice(ops))
        expr = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(signs, values[1:])])
        problems.append({"question": f"What is {expr}?", "answer": str(_evaluate(values, signs))})
    return problems


def _evaluate(values: list[int], signs: list[str]) -> int:
    """``values[0] signs[0] values[1] ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    terms, term_signs = [values[0]], []
    for op, v in zip(signs, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            term_signs.append(op)
    total = terms[0]
    for op, v in zip(term_signs, terms[1:]):
        total = _OPS[op](total, v)
    return total


def arithmetic_dataset(size: int = 256, seed: int = 0, max_operand: int = 50, ops: str = "+-",
                       reasoning: bool = False, style: str = "short", operands: int | None = None):
    """A ``datasets.Dataset`` of conversational prompts for TRL (columns ``prompt`` and ``answer``).

    ``style="short"``: answer tags taught by a worked example turn (~77-token prompt, answers of tens of tokens);
    ``reasoning=True`` asks for (and shows) a worked, longer answer (~120-token prompt). ``style="long"``: a
    one-line instruction and the question only (~30 tokens), long explanations; score it with
    ``reward_funcs("long")``. ``operands`` defaults to 2 (short) or 3 (long).
    """
    from datasets import Dataset

    if style not in STYLES:
        raise ValueError(f"style={style!r} is invalid: use one of {STYLES}.")
    if style == "long" and reasoning:
        raise ValueError("reasoning=True applies to style='short' only; style='long' always asks for explanations.")
    operands = operands if operands is not None else (3 if style == "long" else 2)
    if style == "long":
        head = [{"role": "system", "content": LONG_PROMPT}]
    else:
        system, (example_q, example_a) = (REASONING_PROMPT, REASONING_EXAMPLE) if reasoning else (SYSTEM_PROMPT,
                                                                                                   EXAMPLE)
        head = [{"role": "system", "content": system}, {"role": "user", "content": example_q},
                {"role": "assistant", "content": example_a}]
    rows = [{"prompt": head + [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
            for p in arithmetic_problems(size, seed, max_operand, ops, operands)]
    return Dataset.from_list(rows)


def reward_funcs(style: str = "short") -> list:
    """The (format, correctness) reward functions that score ``arithmetic_dataset(style=style)``."""
    if style not in STYLES:
        raise ValueError(f"style={style!r} is invalid: use one of {STYLES}.")
    return [format_reward, correctness_reward] if style == "short" else [final_answer_format_reward,
                                                                         final_answer_correctness_reward]


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def extract_answer(text: str, pattern: re.Pattern = ANSWER) -> str | None:
    """The first integer ``pattern`` captures (``ANSWER``: in tags; ``FINAL_ANSWER``: after "answer is"), as
    ``str(int(N))``: "-7" for "\u2212 7", "1234" for "1,234", "7" for "07"."""
    match = pattern.search(text)
    if not match:
        return None
    return str(int(match.group(1).replace("\u2212", "-").replace(" ", "").replace(",", "")))


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion holds ``<answer>N</answer>`` with an integer N."""
    return [1.0 if extract_answer(_text(c)) is not None else 0.0 for c in completions]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the first tagged integer equals the answer."""
    return [1.0 if extract_answer(_text(c)) == str(a) else 0.0 for c, a in zip(completions, answer)]


def final_answer_format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion says ``answer is N`` with an integer N (the ``long`` style)."""
    return [1.0 if extract_answer(_text(c), FINAL_ANSWER) is not None else 0.0 for c in completions]


def final_answer_correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the first ``answer is N`` has N equal to the answer (the ``long`` style)."""
    return [1.0 if extract_answer(_text(c), FINAL_ANSWER) == str(a) else 0.0 for c, a in zip(completions, answer)]
