"""Rewards, computed on the host: the built-in graders and `Rewarder`, which combines
them with users' own reward functions (config reward.*; data/user_rewards.py).

Built-in graders: "chain" for the variable-chain task (see math_task.py); "math" (the
in-house answer_check) or "math_verify" (the math-verify package, reward.grader) for real
datasets.

Answer rule: the first line of the completion that starts with "answer:" is the
answer line; it is well formed when the rest of that line, with spaces removed
from both ends, is 1 to 32 ASCII digits. Later answer lines and any text after
the first one are ignored. Answers are compared as strings: "05" != "5".
Dataset problems (Problem.grader "math") are graded by answer_check.

`Rewarder(fns, weights, ...)`: reward.fn is a comma list of specs (user_rewards.py:
path/to/file.py[:name] | package.module:name | builtin) with reward.weights; a row's
reward is the weighted sum. A user function that raises, returns a non-number or runs past
reward.timeout_s scores 0 on that row: the row counts in `reward_errors`, the first error
of each function is printed with its traceback, and more than reward.max_error_fraction
failed rows in one batch raise RewardErrors (a UserError: the run stops with one line).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Sequence

import numpy as np

from dsparse_jax.data import answer_check, user_rewards
from dsparse_jax.data.math_task import ANSWER_PREFIX
from dsparse_jax.errors import UserError

GRADERS = ("auto", "math", "math_verify")  # reward.grader; auto: chain task / in-house math

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


def _math_verify():
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
    mv = _math_verify()
    pred = mv.parse(completion)
    if not pred:
        return 0.0
    gold = mv.parse("\\boxed{" + str(reference) + "}")
    return 1.0 if gold and mv.verify(gold, pred) else float(format_reward)


def reward(
    completion: str, answer: str, grader: str = "chain", format_reward: float = 0.0
) -> float:
    """The reward of one completion: grader "chain" (this task's answer line), "math"
    (\\boxed / #### answers graded by answer_check, for real datasets) or "math_verify"."""
    if grader == "chain":
        return chain_reward(completion, answer, format_reward)
    if grader == "math":
        return answer_check.math_reward(completion, answer, format_reward)
    if grader == "math_verify":
        return math_verify_reward(completion, answer, format_reward)
    raise ValueError(f"unknown grader {grader!r}: chain | math | math_verify")


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


# ---------------------------------------------------------------------- combined rewards
def parse_specs(fn: str) -> list[str]:
    """reward.fn as a list of specs ("" -> the built-in grader alone)."""
    specs = [s.strip() for s in str(fn).split(",") if s.strip()]
    return specs or [user_rewards.BUILTIN]


def parse_weights(weights: str, n: int) -> list[float]:
    """reward.weights ("" -> 1 each) as n finite floats."""
    if not str(weights).strip():
        return [1.0] * n
    try:
        out = [float(w) for w in str(weights).split(",")]
    except ValueError:
        raise UserError(f"config.reward.weights: {weights!r} is not a comma list of numbers")
    if len(out) != n or not all(np.isfinite(out)):
        raise UserError(
            f"config.reward.weights: {weights!r} must be {n} finite numbers, one per reward.fn"
        )
    return out


class RewardErrors(UserError):
    """More reward errors in one batch than reward.max_error_fraction allows."""


@dataclasses.dataclass
class Scored:
    rewards: np.ndarray  # float32 [B], the weighted sum
    errors: np.ndarray  # bool [B]: some reward function failed on this row (it scored 0)
    metrics: dict


def _row(problem, completion: str) -> dict:
    """A row as user reward functions see it."""
    return {
        "prompt": problem.prompt,
        "completion": completion,
        "ground_truth": problem.ground_truth or problem.answer,
        "data_source": problem.data_source or "synthetic:chain",
        "extra_info": problem.extra_info or {},
    }


class Rewarder:
    """The reward of each (problem, completion): the built-in grader and/or users'
    functions (reward.fn), weighted (reward.weights). Built from the config section with
    `from_config`; `close()` ends the worker process of user functions."""

    def __init__(
        self,
        fn: str = "",
        weights: str = "",
        grader: str = "auto",
        format_reward: float = 0.0,
        timeout_s: float = 10.0,
        max_error_fraction: float = 0.1,
    ):
        if grader not in GRADERS:
            raise UserError(f"config.reward.grader: must be one of {GRADERS}, got {grader!r}")
        if grader == "math_verify":
            _math_verify()
        self.specs = parse_specs(fn)
        self.weights = parse_weights(weights, len(self.specs))
        self.grader, self.format_reward = grader, format_reward
        self.max_error_fraction = max_error_fraction
        self.names = _names(self.specs)
        user = [s for s in self.specs if s != user_rewards.BUILTIN]
        self._worker = user_rewards.RewardWorker(user, timeout_s) if user else None
        self._logged: set[str] = set()

    @classmethod
    def from_config(cls, config) -> Rewarder:
        r = config.reward
        return cls(
            r.fn,
            r.weights,
            r.grader,
            config.task.format_reward,
            r.timeout_s,
            r.max_error_fraction,
        )

    def builtin(self, problems, completions: Sequence[str]) -> np.ndarray:
        """The in-house grade of each row (the chain task's grader, or reward.grader)."""
        graders = [p.grader for p in problems]
        if self.grader != "auto":
            graders = [g if g == "chain" else self.grader for g in graders]
        answers = [p.answer for p in problems]
        return batch_rewards(completions, answers, self.format_reward, graders)

    def score(self, problems, completions: Sequence[str], where: str = "") -> Scored:
        """Rewards of row i = (problems[i], completions[i]); raises RewardErrors when more
        than max_error_fraction of the rows failed (`where`: e.g. "RL step 3")."""
        if len(problems) != len(completions):
            raise ValueError(f"got {len(completions)} completions for {len(problems)} problems")
        total = np.zeros(len(completions), np.float32)
        errors = np.zeros(len(completions), bool)
        metrics, first = {}, None
        rows = None
        for spec, name, w in zip(self.specs, self.names, self.weights):
            if spec == user_rewards.BUILTIN:
                values = self.builtin(problems, completions)
            else:
                rows = rows or [_row(p, c) for p, c in zip(problems, completions)]
                outcomes = self._worker.call(self._worker_index(spec), rows)
                values = np.array([o.get("value", 0.0) for o in outcomes], np.float32)
                failed = np.array(["error" in o for o in outcomes])
                errors |= failed
                if failed.any():
                    bad = outcomes[int(np.argmax(failed))]
                    first = first or f"{spec}: {bad['error']}"
                    self._log_once(spec, bad)
            total += w * values
            if len(self.specs) > 1:
                metrics[f"reward_{name}"] = float(values.mean())
        n_err = int(errors.sum())
        metrics["reward_errors"] = n_err
        frac = n_err / max(1, len(errors))
        if frac > self.max_error_fraction:
            raise RewardErrors(
                f"reward: {n_err} of {len(errors)} rows failed{' in ' + where if where else ''}"
                f" ({frac:.0%}), more than config.reward.max_error_fraction="
                f"{self.max_error_fraction}; first: {first}"
            )
        return Scored(total, errors, metrics)

    def _worker_index(self, spec: str) -> int:
        return [s for s in self.specs if s != user_rewards.BUILTIN].index(spec)

    def _log_once(self, spec: str, outcome: dict) -> None:
        if spec in self._logged:
            return
        self._logged.add(spec)
        print(
            f"[reward] WARNING: reward.fn {spec} failed on a row, which scores 0 "
            f"({outcome['error']}); every failed row is counted in the metric reward_errors, "
            "only this first one is printed:\n" + (outcome.get("traceback") or ""),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


def _names(specs: list[str]) -> list[str]:
    """Metric names of the functions: their function names, made unique."""
    names = []
    for s in specs:
        base = s if s == user_rewards.BUILTIN else user_rewards.split_spec(s)[1]
        name, k = base, 2
        while name in names:
            name, k = f"{base}{k}", k + 1
        names.append(name)
    return names
