"""Figures of RL runs from their metrics.jsonl: reward and mismatch over training, KL and
acceptance per completion-position bin. One or several runs (e.g. one per rollout mode)
per figure.

  python -m dsparse_jax.rl.plots runs/dense runs/distillsparse --out figures/

Figures (PNG): reward.png (reward, kept reward, response length, held-out accuracy of
the dense and the sparse policy vs step), mismatch.png (exact and k3 KL(sparse || dense),
mean and 5th-percentile acceptance, TIS clip / MIS mask fractions vs step),
kl_bins.png and alpha_bins.png (per completion-position bin, averaged over the first and
the last third of training: KL, and the 5th percentile and mean of acceptance alpha).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dsparse_jax.train.metrics import read_metrics  # noqa: E402

_BIN = re.compile(r"^(.*)_bin(\d+)$")


def load_run(workdir: str) -> dict:
    """{'label', 'rl': [records], 'eval': [records], 'bin_width': int | None}."""
    bin_width = None
    cfg_path = os.path.join(workdir, "config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            bin_width = json.load(f).get("metrics", {}).get("position_bin")
    records = read_metrics(workdir)
    return {"label": os.path.basename(os.path.normpath(workdir)),
            "rl": [r for r in records if r["phase"] == "rl"],
            "eval": [r for r in records if r["phase"] == "eval"], "bin_width": bin_width}


def _series(records: list[dict], key: str):
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
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
            for part, sub, style in (("first third", recs[:third], "--"),
                                     ("last third", recs[-third:], "-")):
                prof = bin_profile(sub, name)
                if not prof or all(math.isnan(v) for v in prof):
                    continue
                w = run["bin_width"]
                x = [(i + 0.5) * w for i in range(len(prof))] if w else list(range(len(prof)))
                ax.plot(x, prof, style, marker="o", markersize=3, color=color,
                        label=f"{run['label']} ({part})")
        ax.set_title(name)
        ax.set_xlabel("completion position (tokens)" if any(r["bin_width"] for r in runs)
                      else "position bin")
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
    _panel(axes[1, 0], runs, "eval", [("greedy_accuracy", "-o"),
                                      ("sparse_greedy_accuracy", "--s")],
           "held-out greedy accuracy (dense / sparse policy)")
    _panel(axes[1, 1], runs, "rl", [("accuracy", "-")], "rollout accuracy")
    fig.tight_layout()
    path = os.path.join(out_dir, "reward.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    _panel(axes[0, 0], runs, "rl", [("kl_exact", "-"), ("kl_k3", ":")],
           "KL(sparse || dense) per token: exact / k3")
    _panel(axes[0, 1], runs, "rl", [("alpha_mean", "-"), ("alpha_p5", ":")],
           "acceptance alpha: mean / 5th percentile")
    _panel(axes[1, 0], runs, "rl", [("log_ratio_mean_abs", "-"), ("log_ratio_max_abs", ":")],
           "|log p_dense - log p_sparse|: mean / max")
    _panel(axes[1, 1], runs, "rl", [("tis_clip_frac", "-"), ("mis_masked_frac", ":")],
           "TIS clip fraction / MIS mask fraction")
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdirs", nargs="+", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", default=None, help="output folder (default <first run>/figures)")
    a = p.parse_args(argv)
    out = a.out or os.path.join(a.workdirs[0], "figures")
    for path in plot_runs(a.workdirs, out):
        print(path)


if __name__ == "__main__":
    main()
