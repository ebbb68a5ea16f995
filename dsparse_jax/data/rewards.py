"""Rewards for the variable-chain task (see math_task.py), computed on the host.

Answer rule: the first line of the completion that starts with "answer:" is the
answer line; it is well formed when the rest of that line, with spaces removed
from both ends, is 1 to 32 ASCII digits. Later answer lines and any text after
the first one are ignored. Answers are compared as strings: "05" != "5".
Real datasets (sources.MathProblem, grader "math") are graded by answer_check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from dsparse_jax.data import answer_check
from dsparse_jax.data.math_task import ANSWER_PREFIX

_KEY = ANSWER_PREFIX.strip()  # "answer:"
_LINE_START = re.compile(r"(?:^|\n)" + re.escape(_KEY))
_NUMBER = re.compile(r"[0-9]{1,32}")


def extract_answer(completion: str) -> str | None:
    """The digits of the first answer line, or None if absent or malformed."""
    if not isinstance(completion, str):
        return None
    m = _LINE_START.search(completion)
    if m is None:
        return None
    end = completion.find("\n", m.end())
    rest = completion[m.end() :] if end < 0 else completion[m.end() : end]
    rest = rest.strip(" ")
    return rest if _NUMBER.fullmatch(rest) else None


def chain_reward(completion: str, answer: str, format_reward: float = 0.0) -> float:
    """1.0 if the answer is right, `format_reward` if well formed but wrong, else 0."""
    got = extract_answer(completion)
    if got is None:
        return 0.0
    return 1.0 if got == str(answer).strip() else float(format_reward)


def reward(
    completion: str, answer: str, grader: str = "chain", format_reward: float = 0.0
) -> float:
    """The reward of one completion: grader "chain" (this task's answer line) or "math"
    (\\boxed / #### answers graded by answer_check, for real datasets)."""
    if grader == "chain":
        return chain_reward(completion, answer, format_reward)
    if grader == "math":
        return answer_check.math_reward(completion, answer, format_reward)
    raise ValueError(f"unknown grader {grader!r}: chain | math")


def batch_rewards(
    completions: Sequence[str],
    answers: Sequence[str],
    format_reward: float = 0.0,
    graders: Sequence[str] | None = None,
) -> np.ndarray:
    """`reward` of each (completion, answer[, grader]) triple, float32 [B]."""
    if len(completions) != len(answers):
        raise ValueError(f"got {len(completions)} completions for {len(answers)} answers")
    graders = ["chain"] * len(answers) if graders is None else list(graders)
    return np.array(
        [reward(c, a, g, format_reward) for c, a, g in zip(completions, answers, graders)],
        dtype=np.float32,
    )
