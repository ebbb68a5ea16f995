"""The Task interface: what the training loop asks of a task, and the problems it serves.

Two tasks implement it: the embedded chain task (`math_task.ChainTaskConfig`) and a
dataset's problems (`dataset_task.DatasetTask`). Grading travels with each problem
(`Problem.grader`), since rewards and maj@k votes see problems, not tasks.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Problem:
    """prompt + solution is the full text; answer is the reference final answer.

    grader: the built-in grader of the problem ("chain": the chain task's answer line;
      "math": answer_check's \\boxed / #### answers; rewards/graders.py).
    data_source, extra_info, ground_truth: what users' reward functions see (verl's
      record fields; "" or None: the defaults of rewards/rewarder.py).
    """

    prompt: str
    solution: str
    answer: str
    grader: str = "chain"
    data_source: str = ""
    extra_info: dict | None = dataclasses.field(default=None, compare=False)
    ground_truth: str = ""  # the answer field as written ("": answer)


class Task(Protocol):
    """A source of problems with static widths: what a run needs of its task."""

    def problems(self, split: str, start: int, count: int, seed: int) -> list[Problem]:
        """Problems start..start+count-1 of split ("train" | "eval"): a pure function of
        the arguments (a resumed run reads the same problems)."""

    def prompt_buffer(self) -> int:
        """Static prompt width in tokens, BOS included."""

    def completion_budget(self) -> int:
        """Tokens a completion may take, EOS included."""

    def describe(self) -> str:
        """One line for logs."""

    def with_terms(self, num_terms: int) -> Task:
        """The task with num_terms terms per problem (a curriculum stage); ValueError for
        a task without a length knob."""
