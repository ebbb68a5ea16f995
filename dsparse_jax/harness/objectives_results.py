"""Theta's objectives compared at the same wall time (docs/results.md, "Objectives
compared"): runs of the same job that differ only in their objective settings, each
stopped after the same wall time, read from their metrics.jsonl.

  python -m dsparse_jax.harness.objectives_results \\
      --workdirs=runs/objectives/grpo,runs/objectives/dapo,runs/objectives/gspo,runs/objectives/cispo

Elapsed time at a record: the sum of `time_step` over the RL records and `time` over the
evaluation records before it, in file order (start-up, the SFT warm start's reuse and
compiles outside a step excluded). Per run: RL steps done; at each --marks (seconds), the
last evaluation at or before it (held-out greedy accuracy, mean@k, its RL step); the
fraction of informative groups (rewards that vary within a group: `groups_mixed_drawn`,
over every drawn group, where dynamic sampling ran, else `groups_mixed`), mean over steps;
with dynamic sampling the draws per step and the extra rollout tokens they cost.
JSON to stdout (--out also writes it), a markdown table to stderr.
"""

import os
import sys

import numpy as np

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import files
from dsparse_jax.report.metrics import read_metrics


def timeline(records: list[dict]) -> list[tuple[float, dict]]:
    """(elapsed seconds after the record, record) of the RL and evaluation records."""
    out, t = [], 0.0
    for r in records:
        if r["phase"] == "rl":
            t += r.get("time_step", 0.0)
        elif r["phase"] == "eval":
            t += r.get("time", 0.0)
        else:
            continue
        out.append((t, r))
    return out


def _mean(rows: list[dict], key: str) -> float | None:
    v = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and np.isfinite(r[key])]
    return round(float(np.mean(v)), 4) if v else None


def summarize(workdir: str, marks: list[float]) -> dict:
    line = timeline(read_metrics(workdir))
    rl = [r for _, r in line if r["phase"] == "rl"]
    evals = [(t, r) for t, r in line if r["phase"] == "eval"]
    at = {}
    for mark in marks:
        seen = [(t, r) for t, r in evals if t <= mark]
        if seen:
            t, r = seen[-1]
            mk = next((v for k, v in r.items() if k.startswith("mean_at_")), None)
            at[str(int(mark))] = {
                "step": r["step"],
                "elapsed_s": round(t, 1),
                "greedy_accuracy": r["greedy_accuracy"],
                "mean_at_k": mk,
            }
    dynamic = any("groups_mixed_drawn" in r for r in rl)
    out = {
        "workdir": workdir,
        "rl_steps": len(rl),
        "elapsed_s": round(line[-1][0], 1) if line else 0.0,
        "median_step_s": round(float(np.median([r["time_step"] for r in rl[1:]])), 3)
        if len(rl) > 1
        else None,
        "at": at,
        "informative_groups": _mean(rl, "groups_mixed_drawn" if dynamic else "groups_mixed"),
        "curve": [(round(t, 1), r["step"], r["greedy_accuracy"]) for t, r in evals],
    }
    if dynamic:
        out["dynamic_draws"] = _mean(rl, "dynamic_draws")
        out["dynamic_extra_tokens"] = _mean(rl, "dynamic_extra_tokens")
    return out


def markdown(runs: list[dict], marks: list[float]) -> str:
    head = ["run", "RL steps", "s / step"] + [f"greedy / mean@k at {int(m)} s" for m in marks]
    head += ["informative groups", "draws / step", "extra tokens / step"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in runs:
        cells = [f"`{os.path.basename(r['workdir'])}`", str(r["rl_steps"]), str(r["median_step_s"])]
        for m in marks:
            a = r["at"].get(str(int(m)))
            mk = "-" if a is None or a["mean_at_k"] is None else f"{a['mean_at_k']:.3f}"
            cells.append(f"{a['greedy_accuracy']:.3f} / {mk} (step {a['step']})" if a else "-")
        cells += [str(r["informative_groups"])]
        cells += [str(r.get("dynamic_draws", "-")), str(r.get("dynamic_extra_tokens", "-"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.objectives_results",
        description=__doc__.split("\n\n")[0],
    )
    ap.add_argument("--workdirs", type=cli.comma_list(), required=True, help="comma list")
    ap.add_argument("--marks", default="60,120,300,600,1200", help="seconds, comma list")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    marks = [float(x) for x in args.marks.split(",")]
    for w in args.workdirs:
        if not os.path.isfile(os.path.join(w, "metrics.jsonl")):
            raise UserError(f"--workdirs: {w} has no metrics.jsonl")
    runs = [summarize(w, marks) for w in args.workdirs]
    files.emit_json({"marks_s": marks, "runs": runs}, args.out)
    print(markdown(runs, marks), file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.run(main)
