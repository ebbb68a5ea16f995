"""Fault injection for the reliability tests (docs/reliability.md); inert unless set.

DSPARSE_FAULTS="point@step[:action],..." with action kill (default: SIGKILL this process
at that point of that RL step) or nan (the step's loss inputs become NaN). Points:
rl_rollout (after the rollout), rl_update (after theta's update, before phi's),
rl_checkpoint (while the step's checkpoint is being written), rl_nan (advantages);
sft_step (after SFT step s and its metrics / checkpoint), sft_done (SFT stopped and saved
at step s, DONE.json not yet written).
"""

from __future__ import annotations

import functools
import os
import signal
import sys

ENV = "DSPARSE_FAULTS"


@functools.lru_cache(maxsize=4)
def _parse(spec: str) -> dict[tuple[str, int], str]:
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, action = item.partition(":")
        point, _, step = where.partition("@")
        out[(point, int(step))] = action or "kill"
    return out


def action(point: str, step: int) -> str | None:
    """The action injected at `point` of step `step` (1-based), if any."""
    spec = os.environ.get(ENV)
    return _parse(spec).get((point, step)) if spec else None


def maybe_kill(point: str, step: int) -> None:
    if action(point, step) == "kill":
        print(f"[faults] SIGKILL at {point}@{step}", flush=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
