"""The built-in graders: a completion's reward against a problem's reference answer,
computed on the host, by the problem's grader (Problem.grader; config reward.grader).

"chain" for the variable-chain task (see math_task.py); "math" (the in-house
answer_check) or "math_verify" (the math-verify package, reward.grader) for real
datasets.

Answer rule: the first line of the completion that starts with "answer:" is the
answer line; it is well formed when the rest of that line, with spaces removed
from both ends, is 1 to 32 ASCII digits. Later answer lines and any text after
the first one are ignored. Answers are compared as strings: "05" != "5".
Dataset problems (Problem.grader "math") are graded by answer_check.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from dsparse_jax.data import answer_check
from dsparse_jax.data.math_task import ANSWER_PREFIX
from dsparse_jax.errors import UserError

# reward.grader; auto: the chain task's own / the in-house math grader
GRADERS = ("auto", "math", "math_verify", "math_verify_extracted")

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


def load_math_verify():
    """The math_verify package; a UserError naming reward.grader without it."""
    try:
        import math_verify  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise UserError(
            "config.reward.grader: math_verify needs the math-verify package: "
            "pip install math-verify"
        ) from e
    return math_verify


def math_verify_reward(completion: str, reference: str, format_reward: float = 0.0) -> float:
    """The math-verify package's grade: 1 if right, `format_reward` if it parsed an answer
    that is wrong, else 0. (It falls back to the last number of the completion, where the
    in-house grader asks for \\boxed{}, #### or "the answer is".)"""
    mv = load_math_verify()
    pred = mv.parse(completion)
    if not pred:
        return 0.0
    gold = mv.parse("\\boxed{" + str(reference) + "}")
    return 1.0 if gold and mv.verify(gold, pred) else float(format_reward)


def extracted_math_verify_reward(completion: str, reference: str, format_reward: float = 0.0):
    """Our extraction (the last \\boxed{}, ####, "the answer is") in front of math-verify's
    equivalence: 1 if right, `format_reward` if an answer was given but is wrong, else 0."""
    mv = load_math_verify()
    pred = answer_check.extract_answer(completion)
    if pred is None:
        return 0.0
    gold = mv.parse("\\boxed{" + str(reference) + "}")
    got = mv.parse("\\boxed{" + pred + "}")
    return 1.0 if gold and got and mv.verify(gold, got) else float(format_reward)


# grader -> its reward(completion, reference answer, format_reward)
GRADE = {
    "chain": chain_reward,  # this task's answer line
    "math": answer_check.math_reward,  # \\boxed / #### answers, for real datasets
    "math_verify": math_verify_reward,  # math-verify's own extraction and equivalence
    "math_verify_extracted": extracted_math_verify_reward,
}


def reward(
    completion: str, answer: str, grader: str = "chain", format_reward: float = 0.0
) -> float:
    """The reward of one completion by `grader` (a key of GRADE)."""
    if grader not in GRADE:
        raise ValueError(f"unknown grader {grader!r}: {' | '.join(GRADE)}")
    return GRADE[grader](completion, answer, format_reward)


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


def answer_key(problem, completion: str) -> str | None:
    """The completion's final answer as a voting key (maj@k), by the built-in extractor of
    the problem's grader: the chain task's answer line, else answer_check's normalized
    \\boxed / #### / "the answer is" answer. None: no answer."""
    if problem.grader == "chain":
        return extract_answer(completion)
    got = answer_check.extract_answer(completion)
    return None if got is None else answer_check.normalize(got)


def is_correct(rewards_B) -> np.ndarray:
    """A completion counts as correct (accuracy, mean@k, pass@k) when its reward is >= 1."""
    return np.asarray(rewards_B) >= 1.0
