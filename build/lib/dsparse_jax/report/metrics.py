"""Metrics out: JSONL (the source of truth), TensorBoard events, optional Weights & Biases,
samples.jsonl (a few rollouts of each RL step), a console progress line."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np


def _scalar(v):
    v = np.asarray(v)
    return float(v) if v.size == 1 else v.tolist()


class MetricsWriter:
    """Appends {"phase", "step", ...metrics} records to <workdir>/metrics.jsonl and mirrors
    scalars to TensorBoard (<workdir>/tb) and Weights & Biases when enabled.

    wandb: {"project", "name", "config"} starts a wandb run in <workdir>/wandb (the wandb
    package is optional; WANDB_MODE=offline needs no network or account); its id is kept in
    <workdir>/wandb_run_id, so a resumed run continues the same wandb run. Each phase logs
    against its own step (`<phase>/step`), since SFT and RL steps restart from 1."""

    def __init__(self, workdir: str, tensorboard: bool = True, wandb: dict | None = None):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.samples_path = os.path.join(workdir, "samples.jsonl")
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tb"))
        self._wandb = None
        if wandb is not None:
            self._wandb = _start_wandb(workdir, **wandb)

    def write(self, phase: str, step: int, metrics: dict) -> dict:
        record = {"phase": phase, "step": int(step)}
        record.update({k: _scalar(v) for k, v in metrics.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, float) and math.isfinite(v):
                    self._tb.add_scalar(f"{phase}/{k}", v, step)
            self._tb.flush()
        if self._wandb is not None:
            scalars = {
                f"{phase}/{k}": v
                for k, v in record.items()
                if isinstance(v, float) and math.isfinite(v)
            }
            self._wandb.log({**scalars, f"{phase}/step": record["step"]})
        return record

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """Appends {"phase": "rl", "step", prompt, completion, reward, ...} lines to
        <workdir>/samples.jsonl."""
        with open(self.samples_path, "a") as f:
            for s in samples:
                f.write(json.dumps({"phase": "rl", "step": int(step), **s}) + "\n")

    def drop_after(self, phase: str, step: int) -> None:
        """Forget records of `phase` past `step` (metrics and samples of work lost in a
        crash, which a resumed run will redo), and any line a kill cut short. The rewrite
        is atomic."""
        for path in (self.path, self.samples_path):
            _drop_after(path, phase, step)

    def close(self):
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


WANDB_ID_FILE = "wandb_run_id"  # in the workdir: the wandb run a resumed run continues


def _start_wandb(workdir: str, project: str, name: str, config: dict):
    try:
        import wandb  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(
            "config.log.wandb: needs the wandb package (pip install wandb; it is not in "
            "requirements.txt)"
        ) from e
    id_path = os.path.join(workdir, WANDB_ID_FILE)
    run_id = None
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip() or None
    run = wandb.init(
        project=project, name=name, config=config, dir=workdir, id=run_id, resume="allow"
    )
    if run_id is None:  # the first start: kept so that a resumed run continues this one
        tmp = id_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(run.id)
        os.replace(tmp, id_path)
    for phase in ("sft", "rl", "eval"):
        run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
    return run


def _drop_after(path: str, phase: str, step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [l for l in f if l.strip()]
    keep = []
    for l in lines:
        r = _parse(l)
        if r is None:
            print(
                f"[metrics] WARNING: dropping an unreadable line of {path}: {l[:80]!r}",
                flush=True,
            )
        elif not (r["phase"] == phase and r["step"] > step):
            keep.append(l if l.endswith("\n") else l + "\n")
    if keep != lines:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, path)


def _parse(line: str) -> dict | None:
    """A record, or None for a line that is not one (e.g. cut short by a kill)."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) and "phase" in r and "step" in r else None


def read_metrics(workdir: str, phase: str | None = None) -> list[dict]:
    """The records of metrics.jsonl (unreadable lines skipped)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [r for r in map(_parse, f) if r is not None]
    return [r for r in records if phase is None or r["phase"] == phase]


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    """Console progress of a loop: bar, step/total, chosen metrics, elapsed, ETA.

    On a terminal it is one line rewritten in place; otherwise (a log file, a pipe) one
    line every `every` steps and at the last step. `upper_bound`: the loop may stop before
    `total` (SFT stops at its accuracy target), so the ETA, which assumes every step,
    is printed as 'ETA <= ...'. `after_s`: updates stay silent until the loop has run this
    long (a loop that is quick prints nothing). Call close() before printing anything
    else."""

    def __init__(
        self,
        name: str,
        total: int,
        start: int = 0,
        stream=None,
        every: int = 1,
        upper_bound: bool = False,
        tty: bool | None = None,
        after_s: float = 0.0,
    ):
        self.name, self.total, self.start, self.after_s = name, total, start, after_s
        self.every, self.upper_bound = max(1, every), upper_bound
        self.t0 = time.time()
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self._open = False  # a terminal line is being rewritten

    def line(self, step: int, metrics: dict, keys: tuple[str, ...] = ()) -> str:
        done = step - self.start
        elapsed = time.time() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else float("nan")
        frac = step / max(self.total, 1)
        bar = "#" * int(20 * frac) + "." * (20 - int(20 * frac))
        shown = " ".join(f"{k} {float(metrics[k]):.3g}" for k in keys if k in metrics)
        eta_s = _fmt_time(eta) if math.isfinite(eta) else "?"
        eta_s = f"ETA <= {eta_s} (may stop earlier)" if self.upper_bound else f"ETA {eta_s}"
        return f"[{self.name}] {bar} {step}/{self.total} {shown} | {_fmt_time(elapsed)} elapsed, {eta_s}"

    def update(self, step: int, metrics: dict, keys: tuple[str, ...] = ()) -> None:
        if time.time() - self.t0 < self.after_s:
            return
        if self.tty:
            self.stream.write("\r" + self.line(step, metrics, keys) + "\033[K")
            self.stream.flush()
            self._open = True
        elif step % self.every == 0 or step >= self.total:
            print(self.line(step, metrics, keys), file=self.stream, flush=True)

    def close(self) -> None:
        """Ends the terminal line (the next update starts a new one)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
