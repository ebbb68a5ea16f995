"""`Rewarder`: a row's reward as the weighted sum of the built-in grader (graders.py) and
users' own reward functions (user.py), config reward.*.

`Rewarder(fns, weights, ...)`: reward.fn is a comma list of function references (user.py:
path/to/file.py[:name] | package.module:name | builtin) with reward.weights; a row's
reward is the weighted sum. A user function that raises, returns a non-number or runs past
reward.timeout_s scores 0 on that row: the row counts in `reward_errors`, the first error
of each function is printed with its traceback. The run stops with one line
(RewardErrors, a UserError) when more than reward.max_error_fraction of the last
reward.error_window rows failed, once at least reward.error_min_rows rows were scored: a
rate over many rows, not one batch, so a rare failure never stops a run by chance. A
batch function that returns another number of values than rows stops the run at once.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from dsparse_jax.data.rewards import graders, user
from dsparse_jax.errors import UserError


def parse_refs(fn: str) -> list[str]:
    """reward.fn as a list of refs ("" -> the built-in grader alone)."""
    refs = [s.strip() for s in str(fn).split(",") if s.strip()]
    return refs or [user.BUILTIN]


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
    """More reward errors over the recent rows than reward.max_error_fraction allows."""


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
        error_window: int = 512,
        error_min_rows: int = 64,
    ):
        if grader not in graders.GRADERS:
            raise UserError(
                f"config.reward.grader: must be one of {graders.GRADERS}, got {grader!r}"
            )
        if grader.startswith("math_verify"):
            graders.load_math_verify()
        self.refs = parse_refs(fn)
        self.weights = parse_weights(weights, len(self.refs))
        self.grader, self.format_reward = grader, format_reward
        self.max_error_fraction, self.error_min_rows = max_error_fraction, error_min_rows
        self._recent = collections.deque(maxlen=error_window)  # bool per scored row
        self._first_error = None  # the first failure seen, for the stop's message
        self.names = _names(self.refs)
        mine = [s for s in self.refs if s != user.BUILTIN]
        self._worker = user.RewardWorker(mine, timeout_s) if mine else None
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
            r.error_window,
            r.error_min_rows,
        )

    def builtin(self, problems, completions: Sequence[str]) -> np.ndarray:
        """The in-house grade of each row (the chain task's grader, or reward.grader)."""
        kinds = [p.grader for p in problems]
        if self.grader != "auto":
            kinds = [g if g == "chain" else self.grader for g in kinds]
        answers = [p.answer for p in problems]
        return graders.batch_rewards(completions, answers, self.format_reward, kinds)

    def score(self, problems, completions: Sequence[str], where: str = "") -> Scored:
        """Rewards of row i = (problems[i], completions[i]); raises RewardErrors when more
        than max_error_fraction of the recent rows failed (`where`: e.g. "RL step 3")."""
        if len(problems) != len(completions):
            raise ValueError(f"got {len(completions)} completions for {len(problems)} problems")
        total = np.zeros(len(completions), np.float32)
        errors = np.zeros(len(completions), bool)
        metrics, first = {}, None
        rows = None
        for ref, name, w in zip(self.refs, self.names, self.weights):
            if ref == user.BUILTIN:
                values = self.builtin(problems, completions)
            else:
                rows = rows or [_row(p, c) for p, c in zip(problems, completions)]
                outcomes = self._worker.call(self._worker_index(ref), rows)
                fatal = next((o["fatal"] for o in outcomes if "fatal" in o), None)
                if fatal:
                    raise UserError(f"config.reward.fn: {ref} {fatal}")
                values = np.array([o.get("value", 0.0) for o in outcomes], np.float32)
                failed = np.array(["error" in o for o in outcomes])
                errors |= failed
                if failed.any():
                    bad = outcomes[int(np.argmax(failed))]
                    first = first or f"{ref}: {bad['error']}"
                    self._log_once(ref, bad)
            total += w * values
            if len(self.refs) > 1:
                metrics[f"reward_{name}"] = float(values.mean())
        metrics["reward_errors"] = int(errors.sum())
        self._first_error = self._first_error or first
        self._recent.extend(errors.tolist())
        n, n_err = len(self._recent), sum(self._recent)
        if n >= self.error_min_rows and n_err > self.max_error_fraction * n:
            raise RewardErrors(
                f"reward: {n_err} of the last {n} rows failed"
                f"{' (at ' + where + ')' if where else ''} ({n_err / n:.0%}), more than "
                f"config.reward.max_error_fraction={self.max_error_fraction}; first: "
                f"{self._first_error}"
            )
        return Scored(total, errors, metrics)

    def _worker_index(self, ref: str) -> int:
        return [s for s in self.refs if s != user.BUILTIN].index(ref)

    def _log_once(self, ref: str, outcome: dict) -> None:
        if ref in self._logged:
            return
        self._logged.add(ref)
        print(
            f"[reward] WARNING: reward.fn {ref} failed on a row, which scores 0 "
            f"({outcome['error']}); every failed row is counted in the metric reward_errors, "
            "only this first one is printed:\n" + (outcome.get("traceback") or ""),
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()


def _names(refs: list[str]) -> list[str]:
    """Metric names of the functions: their function names, made unique."""
    names = []
    for s in refs:
        base = s if s == user.BUILTIN else user.split_ref(s)[1]
        name, k = base, 2
        while name in names:
            name, k = f"{base}{k}", k + 1
        names.append(name)
    return names
