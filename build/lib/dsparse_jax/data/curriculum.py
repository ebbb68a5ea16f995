"""A length curriculum for the SFT warm start: shorter chain problems first, then the task.

`sft.curriculum` is a comma list of stages `num_terms:batch_size:steps`, e.g. "8:32:250"
(250 steps of 8-term problems, batch 32). After the listed stages, SFT trains on the
task itself with sft.batch_size until sft.max_steps or sft.target_accuracy. A stage's
task is the run's task with num_terms replaced (and num_vars too with order="names",
where every variable is a term); the tokenizer's ids do not depend on num_terms, so one
set of weights serves every stage. Held-out evaluation is on the task itself, so it
runs only in the last stage.
"""

from __future__ import annotations

import dataclasses

from dsparse_jax.data.task import Task


@dataclasses.dataclass(frozen=True)
class Stage:
    task: Task
    batch_size: int
    start: int  # first SFT step (0-based) of the stage
    end: int  # one past its last step; the last stage ends at sft.max_steps


def parse(spec: str) -> list[tuple[int, int, int]]:
    """[(num_terms, batch_size, steps), ...] of a spec; ValueError names what is wrong."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        fields = part.split(":")
        try:
            values = tuple(int(f) for f in fields)
        except ValueError:
            values = ()
        if len(values) != 3 or min(values) < 1:
            raise ValueError(
                f"stage {part!r} must be num_terms:batch_size:steps, three positive integers"
            )
        out.append(values)
    return out


def stages(spec: str, task: Task, batch_size: int, max_steps: int) -> list[Stage]:
    """The SFT stages of a spec, ending with the task itself (batch_size, to max_steps).

    An empty spec is one stage. A curriculum needs the synthetic chain task (a dataset's
    problems have no length knob: its `with_terms` raises)."""
    out, start = [], 0
    for num_terms, batch, steps in parse(spec):
        out.append(Stage(task.with_terms(num_terms), batch, start, start + steps))
        start += steps
    if start >= max_steps:
        raise ValueError(
            f"its stages take {start} steps, leaving none of sft.max_steps={max_steps} "
            "for the task itself"
        )
    out.append(Stage(task, batch_size, start, max_steps))
    return out


def at(stage_list: list[Stage], step: int) -> Stage:
    """The stage that trains SFT step `step` (0-based)."""
    return next((s for s in stage_list if step < s.end), stage_list[-1])


def train_problems(stage_list: list[Stage], step: int, seed: int):
    """(stage, its training problems for SFT step `step`): each stage reads its own
    training stream from the start, stage.batch_size problems per step."""
    stage = at(stage_list, step)
    start = (step - stage.start) * stage.batch_size
    return stage, stage.task.problems("train", start, stage.batch_size, seed)
