"""Figures of RL runs from their metrics.jsonl: reward and mismatch over training, KL and
acceptance per completion-position bin. One or several runs (e.g. one per rollout mode)
per figure.

  python -m dsparse_jax.harness.plots --workdirs=runs/dense,runs/distillsparse --out=figures/

Figures (PNG): reward.png (reward, kept reward, response length, held-out accuracy of
the dense and the sparse policy vs step), mismatch.png (exact and k3 KL(sparse || dense),
mean and 5th-percentile acceptance, TIS clip / MIS mask fractions vs step),
kl_bins.png and alpha_bins.png (per completion-position bin, averaged over the first and
the last third of training: KL, and the 5th percentile and mean of acceptance alpha).
"""

from __future__ import annotations

import json
import math
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dsparse_jax.config import cli  # noqa: E402
from dsparse_jax.report.metrics import read_metrics  # noqa: E402

_BIN = re.compile(r"^(.*)_bin(\d+)$")


def load_run(workdir: str) -> dict:
    """{'label', 'rl': [records], 'eval': [records], 'bin_width': int | None}."""
    bin_width = None
    cfg_path = os.path.join(workdir, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            bin_width = json.load(f).get("metrics", {}).get("position_bin")
    records = read_metrics(workdir)
    return {
        "label": os.path.basename(os.path.normpath(workdir)),
        "rl": [r for r in records if r["phase"] == "rl"],
        "eval": [r for r in records if r["phase"] == "eval"],
        "bin_width": bin_width,
    }


def _series(records: list[dict], key: str):
    pts = [
        (r["step"], r[key])
        for r in records
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return [p[0] for p in pts], [p[1] for p in pts]


def bin_profile(records: list[dict], name: str) -> list[float]:
    """Mean over records of metric `name`_bin<k>, per bin k (NaN where never finite)."""
    sums, counts = {}, {}
    for r in records:
        for k, v in r.items():
            m = _BIN.match(k)
            if m and m.group(1) == name and isinstance(v, (int, float)) and math.isfinite(v):
                i = int(m.group(2))
                sums[i] = sums.get(i, 0.0) + v
                counts[i] = counts.get(i, 0) + 1
    n = max(sums, default=-1) + 1
    return [sums[i] / counts[i] if i in counts else float("nan") for i in range(n)]


def _panel(ax, runs, phase, keys, title):
    drawn = False
    for run in runs:
        for key, style in keys:
            x, y = _series(run[phase], key)
            if x:
                label = run["label"] + ("" if len(keys) == 1 else f" {key}")
                ax.plot(x, y, style, label=label, markersize=3)
                drawn = True
    ax.set_title(title)
    ax.set_xlabel("step")
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def _bins_figure(runs, names, path, ylabel):
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        for ri, run in enumerate(runs):
            color = f"C{ri % 10}"  # one colour per run; dashed: early, solid: late
            recs = run["rl"]
            third = max(len(recs) // 3, 1)
            for part, sub, style in (
                ("first third", recs[:third], "--"),
                ("last third", recs[-third:], "-"),
            ):
                prof = bin_profile(sub, name)
                if not prof or all(math.isnan(v) for v in prof):
                    continue
                w = run["bin_width"]
                x = [(i + 0.5) * w for i in range(len(prof))] if w else list(range(len(prof)))
                ax.plot(
                    x,
                    prof,
                    style,
                    marker="o",
                    markersize=3,
                    color=color,
                    label=f"{run['label']} ({part})",
                )
        ax.set_title(name)
        ax.set_xlabel(
            "completion position (tokens)" if any(r["bin_width"] for r in runs) else "position bin"
        )
        ax.set_ylabel(ylabel)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_runs(workdirs: list[str], out_dir: str) -> list[str]:
    """Writes the figures of one or several runs into out_dir; returns the paths written."""
    runs = [load_run(w) for w in workdirs]
    os.makedirs(out_dir, exist_ok=True)
    written = []

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    _panel(axes[0, 0], runs, "rl", [("reward", "-"), ("reward_kept", ":")], "reward")
    _panel(axes[0, 1], runs, "rl", [("response_length_mean", "-")], "response length")
    _panel(
        axes[1, 0],
        runs,
        "eval",
        [("greedy_accuracy", "-o"), ("sparse_greedy_accuracy", "--s")],
        "held-out greedy accuracy (dense / sparse policy)",
    )
    _panel(axes[1, 1], runs, "rl", [("accuracy", "-")], "rollout accuracy")
    fig.tight_layout()
    path = os.path.join(out_dir, "reward.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    _panel(
        axes[0, 0],
        runs,
        "rl",
        [("kl_exact", "-"), ("kl_k3", ":")],
        "KL(sparse || dense) per token: exact / k3",
    )
    _panel(
        axes[0, 1],
        runs,
        "rl",
        [("alpha_mean", "-"), ("alpha_p5", ":")],
        "acceptance alpha: mean / 5th percentile",
    )
    _panel(
        axes[1, 0],
        runs,
        "rl",
        [("log_ratio_mean_abs", "-"), ("log_ratio_max_abs", ":")],
        "|log p_dense - log p_sparse|: mean / max",
    )
    _panel(
        axes[1, 1],
        runs,
        "rl",
        [("tis_clip_frac", "-"), ("mis_masked_frac", ":")],
        "TIS clip fraction / MIS mask fraction",
    )
    if any(y > 0 for line in axes[0, 0].lines for y in line.get_ydata()):
        axes[0, 0].set_yscale("symlog", linthresh=1e-4)
    fig.tight_layout()
    path = os.path.join(out_dir, "mismatch.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    path = os.path.join(out_dir, "kl_bins.png")
    _bins_figure(runs, ["kl_exact"], path, "KL(sparse || dense)")
    written.append(path)
    path = os.path.join(out_dir, "alpha_bins.png")
    _bins_figure(runs, ["alpha_p5", "alpha_mean"], path, "acceptance alpha")
    written.append(path)
    return written


# --------------------------------------------------------------- experiment figures
# (harness/results.py: figures of a multi-run experiment)
def plot_bins(workdirs: list[str], out_dir: str, labels: list[str] | None = None) -> list[str]:
    """kl_bins.png and alpha_bins.png (early vs late per completion-position bin) of only
    these runs, e.g. naive sparse vs DistillSparse. Returns the paths written."""
    runs = [load_run(w) for w in workdirs]
    for run, label in zip(runs, labels or []):
        run["label"] = label
    os.makedirs(out_dir, exist_ok=True)
    kl, alpha = os.path.join(out_dir, "kl_bins.png"), os.path.join(out_dir, "alpha_bins.png")
    _bins_figure(runs, ["kl_exact"], kl, "KL(sparse || dense)")
    _bins_figure(runs, ["alpha_p5", "alpha_mean"], alpha, "acceptance alpha")
    return [kl, alpha]


def _mean_se_by_step(runs: list[dict], phase: str, key: str):
    """Steps, the mean over runs at each, and its standard error (0 with one run)."""
    by_step = {}
    for run in runs:
        for x, y in zip(*_series(run[phase], key)):
            by_step.setdefault(x, []).append(y)
    steps = sorted(by_step)
    means = [sum(by_step[s]) / len(by_step[s]) for s in steps]
    ses = []
    for s, m in zip(steps, means):
        v = by_step[s]
        var = sum((y - m) ** 2 for y in v) / (len(v) - 1) if len(v) > 1 else 0.0
        ses.append(math.sqrt(var / len(v)))
    return steps, means, ses


def plot_seed_spread(
    groups: dict[str, list[str]],
    path: str,
    panels=(
        ("eval", "greedy_accuracy", "held-out greedy accuracy, dense policy"),
        ("eval", "sparse_greedy_accuracy", "held-out greedy accuracy, actor"),
        ("rl", "reward", "rollout reward"),
        ("rl", "kl_exact", "KL(sparse || dense) per token"),
    ),
) -> str:
    """One line per group (label -> the workdirs of its seeds): the mean over seeds per
    step with a +- 1 standard error band. Returns the path written."""
    loaded = {label: [load_run(w) for w in wds] for label, wds in groups.items()}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, (phase, key, title) in zip(axes[0], panels):
        for gi, (label, runs) in enumerate(loaded.items()):
            x, m, s = _mean_se_by_step(runs, phase, key)
            if not x:
                continue
            color = f"C{gi % 10}"
            ax.plot(x, m, "-o", markersize=3, color=color, label=f"{label} (n={len(runs)})")
            ax.fill_between(
                x,
                [a - b for a, b in zip(m, s)],
                [a + b for a, b in zip(m, s)],
                color=color,
                alpha=0.2,
            )
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(
    workdirs: list[str], path: str, bars: dict[str, tuple] | None = None, skip_first: bool = True
) -> str:
    """Rollout tokens/s and time per RL step vs step (one line per run; skip_first drops
    step 1, whose times include the compile), and optionally a bar chart
    bars = {label: (mean tokens/s, spread)}. Returns the path written."""
    runs = [load_run(w) for w in workdirs]
    if skip_first:
        for run in runs:
            run["rl"] = [r for r in run["rl"] if r["step"] >= 2] or run["rl"]
    ncols = 3 if bars else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 3.6), squeeze=False)
    _panel(axes[0, 0], runs, "rl", [("rollout_tokens_per_s", "-")], "rollout tokens/s")
    _panel(axes[0, 1], runs, "rl", [("time_step", "-")], "time per RL step (s)")
    if bars:
        ax = axes[0, 2]
        labels = list(bars)
        ax.bar(
            range(len(labels)),
            [bars[k][0] for k in labels],
            yerr=[bars[k][1] for k in labels],
            color=[f"C{i % 10}" for i in range(len(labels))],
            capsize=3,
        )
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.set_title("rollout tokens/s (median over steps >= 2)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel_by_run(ax, runs, phase, keys, title):
    """Like _panel, but one colour per run and one line style per key."""
    styles = ["-", "--", ":", "-."]
    for ri, run in enumerate(runs):
        for ki, key in enumerate(keys):
            x, y = _series(run[phase], key)
            if x:
                label = run["label"] + ("" if len(keys) == 1 else f" {key}")
                ax.plot(
                    x,
                    y,
                    styles[ki % len(styles)],
                    color=f"C{ri % 10}",
                    marker="o",
                    markersize=2.5,
                    label=label,
                )
    ax.set_title(title)
    ax.set_xlabel("step")
    if ax.lines:
        ax.legend(fontsize=6)


def plot_curves(
    workdirs: list[str],
    path: str,
    panels=(
        (
            "eval",
            ("greedy_accuracy", "sparse_greedy_accuracy"),
            "held-out greedy accuracy: dense policy (solid) / actor (dashed)",
        ),
        ("eval", ("mean_at_2", "mean_at_4"), "held-out mean@k"),
        ("rl", ("reward",), "rollout reward (all generated samples)"),
        ("rl", ("response_length_mean",), "response length"),
    ),
    labels: list[str] | None = None,
) -> str:
    """Accuracy / reward curves of several runs, one colour per run (every mode in one
    figure stays readable). Returns the path written."""
    runs = [load_run(w) for w in workdirs]
    for run, label in zip(runs, labels or []):
        run["label"] = label
    ncols = 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(11, 3.6 * nrows), squeeze=False)
    for ax, (phase, keys, title) in zip(axes.flat, panels):
        _panel_by_run(ax, runs, phase, list(keys), title)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.plots", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--workdirs", type=cli.comma_list(), required=True, help="run directories, comma list"
    )
    p.add_argument("--out", default=None, help="output folder (default <first run>/figures)")
    a = p.parse_args(argv)
    if not a.workdirs:
        p.error("--workdirs: give at least one run directory")
    out = a.out or os.path.join(a.workdirs[0], "figures")
    for path in plot_runs(a.workdirs, out):
        print(path)
    return 0


if __name__ == "__main__":
    cli.run(main)
