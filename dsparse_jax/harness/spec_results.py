"""Acceptance over RL steps for speculative runs (docs/results.md, "Speculative drafters over
RL"): per run, the acceptance length (tokens per verify) and the acceptance rate of each
draft position in windows of steps, the staleness check (the last window against the
window around step 10: below 80% counts as stale), rollout tokens/s, and for draft_head
the head's loss, KL and top-1 agreement. Read from the runs' metrics.jsonl.

  python -m dsparse_jax.harness.spec_results \\
      --workdirs=runs/spec/sparse_self,runs/spec/history,runs/spec/draft_head

JSON to stdout (--out also writes it), a markdown table to stderr.
"""

import json
import os
import sys

import numpy as np

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import files
from dsparse_jax.report.metrics import read_metrics

WINDOWS = ((1, 5), (6, 15), (16, 35), (36, 65), (66, 100))  # inclusive RL steps
STALE = 0.8  # the last window below this fraction of the step-10 window: stale


def drafter_name(rl: dict) -> str:
    """rl.draft, with the history drafter's mode where it is not the default (latest)."""
    draft, mode = rl.get("draft", "?"), rl.get("history_draft", "latest")
    return f"{draft} {mode}" if draft == "history" and mode != "latest" else draft


def read(workdir: str) -> tuple[list[dict], list[dict], dict]:
    """(rl records, eval records, config) of a run."""
    rl, ev, config = read_metrics(workdir, "rl"), read_metrics(workdir, "eval"), {}
    path = os.path.join(workdir, "config.json")
    if os.path.exists(path):
        with open(path) as f:
            config = json.load(f)
    return rl, ev, config


def window_mean(rl, key, lo, hi):
    v = [r[key] for r in rl if lo <= r["step"] <= hi and key in r]
    v = [x for x in v if x is not None and np.isfinite(x)]
    return round(float(np.mean(v)), 4) if v else None


def summarize(workdir: str) -> dict:
    rl, ev, config = read(workdir)
    if not rl:
        raise UserError(f"{workdir}: no RL steps in metrics.jsonl")
    k = config.get("rl", {}).get("draft_tokens", 4)
    last = rl[-1]["step"]
    windows = [(lo, min(hi, last)) for lo, hi in WINDOWS if lo <= last]
    keys = ["spec_accept_length", "rollout_tokens_per_s", "time_rollout"]
    keys += [f"spec_accept_rate_{j + 1}" for j in range(k)]
    keys += [f"draft_head_{m}" for m in ("loss", "kl", "top1_agree")]
    rows = []
    for lo, hi in windows:
        row = {"steps": f"{lo}-{hi}"}
        for key in keys:
            v = window_mean(rl, key, lo, hi)
            if v is not None:
                row[key] = v
        rows.append(row)
    ref = next((r for r in rows if r["steps"].startswith("6-")), rows[0])
    ratio = rows[-1]["spec_accept_length"] / ref["spec_accept_length"]
    return {
        "workdir": workdir,
        "draft": drafter_name(config.get("rl", {})),
        "draft_tokens": k,
        "steps": last,
        "windows": rows,
        "last_over_step10": round(ratio, 3),
        "stale": ratio < STALE,
        "greedy_accuracy": [(e["step"], e.get("greedy_accuracy")) for e in ev],
    }


def table(results: list[dict]) -> str:
    lines = [
        "| drafter | steps | accept length | rate per draft position | rollout tok/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for res in results:
        for w in res["windows"]:
            rates = " / ".join(
                f"{w[f'spec_accept_rate_{j + 1}']:.2f}"
                for j in range(res["draft_tokens"])
                if f"spec_accept_rate_{j + 1}" in w
            )
            lines.append(
                f"| {res['draft']} | {w['steps']} | {w['spec_accept_length']:.2f} | {rates} "
                f"| {w.get('rollout_tokens_per_s', float('nan')):.0f} |"
            )
        lines.append(
            f"| {res['draft']} | last / steps 6-15 | {res['last_over_step10']:.2f}"
            f"{' (stale)' if res['stale'] else ''} | | |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.spec_results", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--workdirs", type=cli.comma_list(), required=True, help="comma list")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    results = [summarize(w) for w in args.workdirs]
    files.emit_json(results, args.out)
    print(table(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    cli.run(main)
