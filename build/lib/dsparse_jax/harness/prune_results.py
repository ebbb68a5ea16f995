"""The pruning experiment's tables (docs/results.md, "Online rollout pruning"): dense GRPO
vs GRPO with rollout pruning from one SFT warm start, read from the runs' metrics.jsonl.

  python -m dsparse_jax.harness.prune_results --workdirs=runs/prune_exp/dense,runs/prune_exp/pruned

Per run: RL steps, accuracy (greedy, mean@k) at each evaluation against the cumulative
RL step time (time_step summed; evaluations and compiles of step 1 included as they
happened, evaluation time excluded), tokens generated / trained per step, tokens per
useful row (rows in groups with a non-zero advantage), groups with non-zero reward
variance, and for the pruned run the head's AUC and calibration over training.
"""

import os

import numpy as np

from dsparse_jax.config import cli
from dsparse_jax.report.metrics import read_metrics


def read(workdir: str) -> tuple[list[dict], list[dict]]:
    """(rl records, eval records) of a run."""
    return read_metrics(workdir, "rl"), read_metrics(workdir, "eval")


def mean(rows, key, lo=0, hi=None):
    v = [r[key] for r in rows[lo:hi] if key in r and r[key] is not None]
    v = [x for x in v if np.isfinite(x)]
    return float(np.mean(v)) if v else float("nan")


def curve(rl, ev) -> list[tuple[int, float, float, float]]:
    """(step, cumulative step seconds, greedy, mean@k) at each evaluation."""
    t = np.cumsum([r["time_step"] for r in rl])
    out = []
    for e in ev:
        s = e["step"]
        mk = next((v for k, v in e.items() if k.startswith("mean_at_")), float("nan"))
        out.append((s, float(t[s - 1]) if s else 0.0, e["greedy_accuracy"], mk))
    return out


def main(argv: list[str]) -> int:
    ap = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.prune_results", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--workdirs", type=cli.comma_list(), required=True, help="comma list")
    runs = ap.parse_args(argv).workdirs
    print(
        "| run | RL steps | RL step time (s, sum) | s / step (median, >= 2) | tokens generated / step | tokens trained / step | (gen + trained) / step | groups mixed (trained) | tokens gen. / useful row | final greedy | final mean@k |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w in runs:
        rl, ev = read(w)
        c = curve(rl, ev)
        gen, tr = mean(rl, "tokens_generated"), mean(rl, "tokens_trained")
        print(
            f"| `{os.path.basename(w)}` | {len(rl)} | {sum(r['time_step'] for r in rl):.0f} | "
            f"{np.median([r['time_step'] for r in rl[1:]]):.2f} | {gen:.0f} | {tr:.0f} | "
            f"{gen + tr:.0f} | {mean(rl, 'groups_mixed'):.3f} | "
            f"{mean(rl, 'tokens_per_useful_row'):.1f} | {c[-1][2]:.3f} | {c[-1][3]:.3f} |"
        )
    print()
    print("Accuracy against cumulative RL step time (greedy / mean@k):")
    print()
    for w in runs:
        rl, ev = read(w)
        pts = ", ".join(f"step {s} @ {t:.0f}s: {g:.3f} / {m:.3f}" for s, t, g, m in curve(rl, ev))
        print(f"- `{os.path.basename(w)}`: {pts}")
    for w in runs:
        rl, _ = read(w)
        if not any("prune_head_auc" in r for r in rl):
            continue
        n = len(rl)
        print()
        print(
            f"`{os.path.basename(w)}` pruning metrics (mean over steps 1-{n // 3} / {n // 3 + 1}-{2 * n // 3} / {2 * n // 3 + 1}-{n}):"
        )
        print()
        for key in (
            "prune_head_auc",
            "prune_head_ece",
            "prune_head_mean_pred",
            "prune_head_mean_label",
            "prune_groups_mixed_kept",
            "prune_groups_mixed_completed",
            "prune_reward_label",
            "reward_kept",
            "prune_tokens_generated",
            "prune_tokens_unpruned_est",
            "prune_token_ratio",
            "time_rollout",
            "time_update_head",
        ):
            parts = [
                mean(rl, key, a, b) for a, b in ((0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n))
            ]
            print(f"- {key}: " + " / ".join(f"{p:.3f}" for p in parts))
    for w in runs:
        rl, _ = read(w)
        print(
            f"- `{os.path.basename(w)}` time_rollout mean {mean(rl, 'time_rollout', 1):.2f} s, time_step mean {mean(rl, 'time_step', 1):.2f} s (steps >= 2)"
        )
    return 0


if __name__ == "__main__":
    cli.run(main)
