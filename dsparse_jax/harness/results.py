"""The experiment's report: reads the runs of the experiment (harness/experiment.py) and writes
docs/results.md (a table in the style of the paper's Table 1, per-run numbers, the
sparsity sweep, the numbers behind each claim) and PNG figures in docs/results/.

  python -m dsparse_jax.harness.results --expdir=runs/exp [--out=docs/results.md]
  (= python -m dsparse_jax.harness.experiment report --expdir=runs/exp)

Everything comes from the runs' metrics.jsonl (dsparse_jax/train/rl_loop.py writes the
`rl` and `eval` records), experiment_run.json (the harness: variant, seed, overrides,
wall time of every attempt) and <expdir>/sweep/sweep.json. The block between the
CONCLUSIONS markers is human-written: a regenerated report keeps it as it was.

Definitions (also printed under the table):
  final         mean over the last 10% of RL steps (at least the last step)
  accuracy      the last evaluation (held-out greedy accuracy / mean@k of the dense
                policy; actor: the rollout policy, sparse attention (+ LoRA))
  longest bin   the last completion-position bin with tokens in the final steps
  tokens/s, s/step  medians over RL steps >= 2 (step 1 includes the compile)
  wall time     the run's processes, every attempt summed (compile, evaluations and
                checkpoints included; the shared SFT warm start excluded)
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import statistics

import numpy as np

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.harness import ROOT
from dsparse_jax.harness.variants import DESCRIPTIONS, MAIN, ORDER
from dsparse_jax.reliability import files
from dsparse_jax.report.metrics import read_metrics

BEGIN = "<!-- BEGIN CONCLUSIONS: human-written, kept as is when the report is regenerated -->"
END = "<!-- END CONCLUSIONS -->"
PLACEHOLDER = (
    "_Not written yet. State which claims replicated at this scale and which "
    "did not, with the numbers above; a finding that does not replicate is "
    "reported as such._"
)
_BIN = re.compile(r"^(.*)_bin(\d+)$")


# ------------------------------------------------------------------------------ one run
def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(vals):
    vals = [v for v in vals if _finite(v)]
    return sum(vals) / len(vals) if vals else None


def _median(vals):
    vals = [v for v in vals if _finite(v)]
    return statistics.median(vals) if vals else None


def final_window(rl: list[dict]) -> list[dict]:
    return rl[-max(1, math.ceil(len(rl) / 10)) :] if rl else []


def bin_values(records: list[dict], name: str) -> dict[int, float]:
    """Bin index -> mean over records of finite `name`_bin<k> (bins with tokens only)."""
    sums, counts = {}, {}
    for r in records:
        for k, v in r.items():
            m = _BIN.match(k)
            if not (m and m.group(1) == name and _finite(v)):
                continue
            i = int(m.group(2))
            tokens = "all_tokens" if name.startswith("all_") else "tokens"
            if r.get(f"{tokens}_bin{i}", 1) <= 0:
                continue
            sums[i] = sums.get(i, 0.0) + v
            counts[i] = counts.get(i, 0) + 1
    return {i: sums[i] / counts[i] for i in sorted(sums)}


def summarize_run(workdir: str) -> dict | None:
    """The numbers of one run (None if it has no RL records)."""
    meta = _read_json(os.path.join(workdir, "experiment_run.json")) or {}
    name = os.path.basename(os.path.normpath(workdir))
    m = re.match(r"^(.*)_s(\d+)$", name)
    variant = meta.get("variant") or (m.group(1) if m else name)
    seed = meta.get("seed", int(m.group(2)) if m else None)
    records = read_metrics(workdir)
    rl = sorted((r for r in records if r["phase"] == "rl"), key=lambda r: r["step"])
    ev = sorted((r for r in records if r["phase"] == "eval"), key=lambda r: r["step"])
    if not rl:
        return None
    cfg = _read_json(os.path.join(workdir, "config.json")) or {}
    num_steps = cfg.get("rl", {}).get("num_steps")
    fin = final_window(rl)
    timed = [r for r in rl if r["step"] >= 2] or rl
    last_ev = ev[-1] if ev else {}
    first_ev = ev[0] if ev and ev[0]["step"] == 0 else {}
    k = cfg.get("eval", {}).get("mean_at_k")
    kkey = f"mean_at_{k}" if k else None
    alpha_bins = bin_values(fin, "alpha_p5")
    kl_bins = bin_values(fin, "kl_exact")
    walls = [a.get("wall_s") for a in meta.get("attempts", [])]
    wall = sum(w for w in walls if _finite(w)) if any(_finite(w) for w in walls) else None
    if wall is None:
        wall = (_read_json(os.path.join(workdir, "summary.json")) or {}).get("wall_time_s")
    # A killed attempt records no wall time: the steps and evaluations it logged bound it.
    logged = sum(r.get("time_step", 0) for r in rl) + sum(r.get("time", 0) for r in ev)
    wall = max(wall or 0.0, logged) or None
    out = {
        "name": name,
        "workdir": workdir,
        "variant": variant,
        "seed": seed,
        "steps": rl[-1]["step"],
        "num_steps": num_steps,
        "done": os.path.exists(os.path.join(workdir, "summary.json"))
        and num_steps is not None
        and rl[-1]["step"] >= num_steps,
        "eval_step": last_ev.get("step"),
        "greedy_accuracy": last_ev.get("greedy_accuracy"),
        "greedy_accuracy_step0": first_ev.get("greedy_accuracy"),
        "mean_at_k": last_ev.get(kkey) if kkey else None,
        "k": k,
        "actor_greedy_accuracy": last_ev.get("sparse_greedy_accuracy"),
        "greedy_correct": last_ev.get("greedy_correct"),  # per problem (newer records)
        "actor_greedy_correct": last_ev.get("sparse_greedy_correct"),
        "kl_exact": _mean(r.get("kl_exact") for r in fin),
        "kl_k3": _mean(r.get("kl_k3") for r in fin),
        "alpha_mean": _mean(r.get("alpha_mean") for r in fin),
        "alpha_p5": _mean(r.get("alpha_p5") for r in fin),
        "alpha_p5_first_bin": alpha_bins[min(alpha_bins)] if alpha_bins else None,
        "alpha_p5_longest_bin": alpha_bins[max(alpha_bins)] if alpha_bins else None,
        "longest_bin": max(alpha_bins) if alpha_bins else None,
        "alpha_p5_worst_bin": min(alpha_bins.values()) if alpha_bins else None,
        "worst_bin": min(alpha_bins, key=alpha_bins.get) if alpha_bins else None,
        "kl_first_bin": kl_bins[min(kl_bins)] if kl_bins else None,
        "kl_longest_bin": kl_bins[max(kl_bins)] if kl_bins else None,
        "kl_exact_first": _mean(r.get("kl_exact") for r in rl[: max(1, math.ceil(len(rl) / 10))]),
        "reward_final": _mean(r.get("reward") for r in fin),
        "response_length_final": _mean(r.get("response_length_mean") for r in fin),
        "tis_clip_frac": _mean(r.get("tis_clip_frac") for r in fin),
        "mis_masked_frac": _mean(r.get("mis_masked_frac") for r in fin),
        "mis_seq_masked_frac": _mean(r.get("mis_seq_masked_frac") for r in fin),
        "rollout_tokens_per_s": _median(r.get("rollout_tokens_per_s") for r in timed),
        "time_step": _median(r.get("time_step") for r in timed),
        "time_rollout": _median(r.get("time_rollout") for r in timed),
        "wall_s": wall,
        "phase_s": phase_medians(timed),
        "accept_length_first": _mean(r.get("spec_accept_length") for r in rl[:1]),
        "accept_length_final": _mean(r.get("spec_accept_length") for r in fin),
        "eval_curve": [
            (r["step"], r.get("greedy_accuracy"), r.get("sparse_greedy_accuracy")) for r in ev
        ],
        "position_bin": cfg.get("metrics", {}).get("position_bin"),
        "mismatch_windows": mismatch_windows(rl),
    }
    return out


def phase_medians(timed: list[dict]) -> dict[str, float]:
    """Phase name -> median over the timed RL records (steps >= 2: step 1 compiles) of its
    time_<phase>, for every phase the run logged, in the order the step runs them."""
    names = dict.fromkeys(k for r in timed for k in r if k.startswith("time_") and k != "time_step")
    return {k.removeprefix("time_"): _median(r.get(k) for r in timed) for k in names}


def mismatch_windows(rl: list[dict], parts: int = 3) -> list[dict]:
    """The mismatch over training: the RL steps cut into `parts` consecutive windows, each
    with its steps, the mean exact KL over all rows (`all_kl_exact`, = `kl_exact` where
    every generated row is kept) and the per-bin means of the exact KL and p5 α."""
    out = []
    for i in range(parts):
        part = rl[len(rl) * i // parts : len(rl) * (i + 1) // parts]
        if not part:
            continue
        prefix = "all_" if any("all_kl_exact" in r for r in part) else ""
        out.append(
            {
                "steps": (part[0]["step"], part[-1]["step"]),
                "kl_exact": _mean(r.get(prefix + "kl_exact") for r in part),
                "kl_bins": bin_values(part, prefix + "kl_exact"),
                "alpha_p5_bins": bin_values(part, prefix + "alpha_p5"),
            }
        )
    return out


def split_expdirs(expdir: str | list[str]) -> list[str]:
    """`a,b` or a list -> the experiment directories, in order."""
    dirs = expdir.split(",") if isinstance(expdir, str) else list(expdir)
    return [d for d in dirs if d]


def find_runs(expdir: str | list[str]) -> list[dict]:
    """Every run with RL records under the experiment directories (`a,b`: several, each
    run named <expdir's name>/<run> then)."""
    dirs = split_expdirs(expdir)
    runs = []
    for d in dirs:
        if not os.path.isdir(d):
            raise UserError(f"--expdir: {d} is not a directory")
        for name in sorted(os.listdir(d)):
            wd = os.path.join(d, name)
            if name == "sft_base" or not os.path.isdir(wd):
                continue
            if not os.path.exists(os.path.join(wd, "metrics.jsonl")):
                continue
            s = summarize_run(wd)
            if s is not None:
                if len(dirs) > 1:
                    s["name"] = f"{os.path.basename(os.path.normpath(d))}/{s['name']}"
                runs.append(s)
    rank = {v: i for i, v in enumerate(ORDER)}
    runs.sort(
        key=lambda r: (
            rank.get(r["variant"], len(ORDER)),
            r["variant"],
            r["seed"] if r["seed"] is not None else -1,
        )
    )
    return runs


# ----------------------------------------------------------------------------- aggregate
def agg(vals):
    """(mean, standard error of the mean (sample std / sqrt(n)) or None, n) over the
    finite values."""
    vals = [v for v in vals if _finite(v)]
    if not vals:
        return None, None, 0
    m = sum(vals) / len(vals)
    se = statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else None
    return m, se, len(vals)


def bootstrap_interval(outcomes_SxP, reps: int = 2000, level: float = 0.95, seed: int = 0):
    """(lo, hi): the percentile interval of the mean accuracy over seeds x problems, each
    resample drawing seeds and problems with replacement (the same problems for every seed
    drawn: the seeds answer the same held-out set)."""
    x_SxP = np.asarray(outcomes_SxP, np.float64)
    s, p = x_SxP.shape
    rng = np.random.default_rng(seed)
    seeds_RxS, probs_RxP = rng.integers(0, s, (reps, s)), rng.integers(0, p, (reps, p))
    means_R = x_SxP[seeds_RxS[:, :, None], probs_RxP[:, None, :]].mean(axis=(1, 2))
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(means_R, [tail, 1.0 - tail])
    return float(lo), float(hi)


def interval_cell(rs: list[dict], key: str) -> str:
    """[lo, hi] of `bootstrap_interval` when every run of the group logged the per-problem
    outcomes `key` of one eval set, else nothing."""
    rows = [r.get(key) for r in rs]
    if not rows or any(not x for x in rows) or len({len(x) for x in rows}) != 1:
        return ""
    lo, hi = bootstrap_interval(rows)
    return f" [{lo:.3f}, {hi:.3f}]"


def fmt(v, digits=3, spread=None):
    if not _finite(v):
        return "-"
    if abs(v) >= 1000:
        body = f"{v:.0f}"
        return body + (f" ± {spread:.0f}" if _finite(spread) else "")

    def one(x):
        return f"{x:.{digits}g}" if (abs(x) < 1e-2 and x != 0) else f"{x:.{digits}f}"

    return one(v) + (f" ± {one(spread)}" if _finite(spread) else "")


def fmt_time(s):
    if not _finite(s):
        return "-"
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def group(runs: list[dict]) -> dict[str, list[dict]]:
    """Variant -> its runs that finished (all its runs while none has): a run in progress
    shows in the per-run table, not in the means."""
    out = {}
    for r in runs:
        out.setdefault(r["variant"], []).append(r)
    return {v: [r for r in rs if r["done"]] or rs for v, rs in out.items()}


def unfinished(shown: list[dict]) -> bool:
    """Whether a variant's runs in its means (group) are all still in progress."""
    return not any(r["done"] for r in shown)


def seeds_cell(runs: list[dict], variant: str, shown: list[dict]) -> str:
    """The seeds of the variant's runs in its means, then ' (+k unfinished)' for its
    runs left out of them, or ' (unfinished)' where no run in them has finished."""
    seeds = ",".join(str(r["seed"]) for r in shown)
    if unfinished(shown):
        return seeds + " (unfinished)"
    k = sum(1 for r in runs if r["variant"] == variant and all(r is not s for s in shown))
    return seeds + (f" (+{k} unfinished)" if k else "")


def mean_se(vals, digits=3) -> str:
    """'mean ± standard error' of the finite values ('-' if none)."""
    m, se, _ = agg(vals)
    return fmt(m, digits, se)


def cell(rs: list[dict], key: str, digits=3) -> str:
    return mean_se((r[key] for r in rs), digits)


def main_table(runs: list[dict]) -> list[str]:
    groups = group(runs)
    ks = sorted({r["k"] for r in runs if r["k"]})
    kname = f"mean@{ks[0]}" if len(ks) == 1 else "mean@k"
    lines = [
        f"| method | seeds | RL steps | greedy acc. (step 0 → final) | {kname} "
        "| actor greedy acc. | KL(sparse‖dense) final | p5 α, longest bin | p5 α, worst bin "
        "| rollout tok/s | s / RL step | wall time / run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v, rs in groups.items():
        seeds = seeds_cell(runs, v, rs)
        steps = sorted({r["steps"] for r in rs})
        step0 = cell(rs, "greedy_accuracy_step0")
        m, s, _ = agg(r["wall_s"] for r in rs)
        wall = fmt_time(m) + (f" ± {fmt_time(s)}" if _finite(s) else "")
        bins = sorted({r["longest_bin"] for r in rs if r["longest_bin"] is not None})
        a5 = cell(rs, "alpha_p5_longest_bin")
        if a5 != "-" and bins:
            a5 += f" (bin {','.join(map(str, bins))})"
        worst = cell(rs, "alpha_p5_worst_bin")
        wbins = sorted({r["worst_bin"] for r in rs if r["worst_bin"] is not None})
        if worst != "-" and wbins:
            worst += f" (bin {','.join(map(str, wbins))})"
        lines.append(
            f"| {DESCRIPTIONS.get(v, v)} (`{v}`) | {seeds} | {'/'.join(map(str, steps))} "
            f"| {step0} → {cell(rs, 'greedy_accuracy')}{interval_cell(rs, 'greedy_correct')} "
            f"| {cell(rs, 'mean_at_k')} "
            f"| {cell(rs, 'actor_greedy_accuracy')}{interval_cell(rs, 'actor_greedy_correct')} "
            f"| {cell(rs, 'kl_exact', 3)} | {a5} | {worst} "
            f"| {cell(rs, 'rollout_tokens_per_s', 0)} | {cell(rs, 'time_step', 2)} | {wall} |"
        )
    return lines


def run_table(runs: list[dict]) -> list[str]:
    lines = [
        "| run | done | steps | greedy acc. step 0 / final | mean@k | actor acc. "
        "| final reward | resp. len. | KL exact first → final | KL bin 0 / longest "
        "| p5 α bin 0 / longest | TIS clip | MIS masked token / seq. | tok/s | s/step | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- | --- | --- |",
    ]
    for r in runs:
        lines.append(
            f"| `{r['name']}` | {'yes' if r['done'] else 'no'} | {r['steps']}/{r['num_steps']} "
            f"| {fmt(r['greedy_accuracy_step0'])} / {fmt(r['greedy_accuracy'])} "
            f"| {fmt(r['mean_at_k'])} | {fmt(r['actor_greedy_accuracy'])} "
            f"| {fmt(r['reward_final'])} | {fmt(r['response_length_final'], 1)} "
            f"| {fmt(r['kl_exact_first'])} → {fmt(r['kl_exact'])} "
            f"| {fmt(r['kl_first_bin'])} / {fmt(r['kl_longest_bin'])} "
            f"| {fmt(r['alpha_p5_first_bin'])} / {fmt(r['alpha_p5_longest_bin'])} "
            f"| {fmt(r['tis_clip_frac'])} "
            f"| {fmt(r['mis_masked_frac'])} / {fmt(r['mis_seq_masked_frac'])} "
            f"| {fmt(r['rollout_tokens_per_s'], 0)} | {fmt(r['time_step'], 2)} "
            f"| {fmt_time(r['wall_s'])} |"
        )
    return lines


def curve_table(runs: list[dict]) -> list[str]:
    """Held-out greedy accuracy at every evaluated step, dense policy / actor, mean ±
    standard error over the seeds evaluated at that step (their number when it is not
    every seed's)."""
    groups = group(runs)
    steps = sorted({s for r in runs for s, _, _ in r["eval_curve"]})
    if not steps:
        return []
    lines = [
        "| method | seeds | " + " | ".join(f"step {s}" for s in steps) + " |",
        "| --- | --- |" + " --- |" * len(steps),
    ]
    for v, rs in groups.items():
        cells = []
        for s in steps:
            parts = []
            for i in (1, 2):
                vals = [c[i] for r in rs for c in r["eval_curve"] if c[0] == s]
                n = agg(vals)[2]
                if n:
                    parts.append(mean_se(vals) + (f" (n={n})" if n != len(rs) else ""))
            cells.append(" / ".join(parts) if parts else "-")
        lines.append(f"| `{v}` | {seeds_cell(runs, v, rs)} | " + " | ".join(cells) + " |")
    return lines


def phase_table(runs: list[dict]) -> list[str]:
    """Seconds per RL step by phase (each run's median over steps >= 2, then mean ±
    standard error over seeds), with the rollout's tokens/s and the speculative
    acceptance length (first step -> the last 10% of steps) where a run has one."""
    groups = group(runs)
    phases = list(dict.fromkeys(p for r in runs for p in r["phase_s"]))
    if not phases:
        return []
    lines = [
        "| method | seeds | "
        + " | ".join(phases)
        + " | step | rollout tok/s | acceptance length first → final |",
        "| --- | --- |" + " --- |" * (len(phases) + 3),
    ]
    for v, rs in groups.items():
        cells = [mean_se((r["phase_s"].get(p) for r in rs), 2) for p in phases]
        final = cell(rs, "accept_length_final", 2)
        accept = "-" if final == "-" else f"{cell(rs, 'accept_length_first', 2)} → {final}"
        lines.append(
            f"| `{v}` | {seeds_cell(runs, v, rs)} | "
            + " | ".join(cells)
            + f" | {cell(rs, 'time_step', 2)} | {cell(rs, 'rollout_tokens_per_s', 0)} | {accept} |"
        )
    return lines


def position_ranges(runs: list[dict], num: int = 4) -> list[tuple[int, int]]:
    """The completion-position bins of every run cut into `num` equal ranges (first and
    last bin of each)."""
    last = max((i for r in runs for w in r["mismatch_windows"] for i in w["kl_bins"]), default=-1)
    if last < 0:
        return []
    num = min(num, last + 1)
    return [((last + 1) * i // num, (last + 1) * (i + 1) // num - 1) for i in range(num)]


def mismatch_table(runs: list[dict]) -> list[str]:
    """Exact KL(actor ‖ dense) and p5 α over training (thirds of the RL steps) and over
    the completion (position ranges): per run's window the mean over its steps and over
    the bins of a range, then mean ± standard error over seeds."""
    ranges = position_ranges(runs)
    sized = [r for r in runs if r["mismatch_windows"] and r["position_bin"]]
    if not ranges or not sized:
        return []
    width = sized[0]["position_bin"]
    heads = [f"tokens {a * width}-{(b + 1) * width - 1}" for a, b in ranges]
    lines = [
        "| method | steps | KL all positions | "
        + " | ".join(f"KL {h}" for h in heads)
        + " | "
        + " | ".join(f"p5 α {h}" for h in heads)
        + " |",
        "| --- | --- | --- |" + " --- |" * (2 * len(ranges)),
    ]

    def in_range(bins, a, b):
        return _mean(v for i, v in bins.items() if a <= i <= b)

    for v, rs in group(sized).items():
        for i in range(max(len(r["mismatch_windows"]) for r in rs)):
            ws = [r["mismatch_windows"][i] for r in rs if len(r["mismatch_windows"]) > i]
            if all(w["kl_exact"] is None for w in ws):
                continue
            span = f"{min(w['steps'][0] for w in ws)}-{max(w['steps'][1] for w in ws)}"
            kl = [mean_se(in_range(w["kl_bins"], a, b) for w in ws) for a, b in ranges]
            al = [mean_se(in_range(w["alpha_p5_bins"], a, b) for w in ws) for a, b in ranges]
            lines.append(
                f"| `{v}` (n={len(ws)}{', unfinished' if unfinished(rs) else ''})"
                f" | {span} | {mean_se(w['kl_exact'] for w in ws)} | " + " | ".join(kl + al) + " |"
            )
    return lines


def sft_base(expdir: str) -> tuple[dict, float | None]:
    """The experiment's SFT warm start: its summary and its wall time (its attempts
    summed, else the summary's)."""
    summary = _read_json(os.path.join(expdir, "sft_base", "summary.json")) or {}
    meta = _read_json(os.path.join(expdir, "sft_base", "experiment_sft.json")) or {}
    wall = sum(a.get("wall_s") or 0 for a in meta.get("attempts", []))
    return summary, wall or summary.get("wall_time_s")


def cpu_time(runs: list[dict], expdirs: list[str]) -> str:
    """One line: the wall time of every run and of the SFT warm starts, summed (a warm
    start copied from one experiment to another counted once; an experiment without one
    adds none)."""
    walls = [r["wall_s"] for r in runs if _finite(r["wall_s"])]
    starts = {}
    for d in expdirs:
        summary, wall = sft_base(d)
        if summary or wall:
            starts.setdefault(json.dumps(summary, sort_keys=True), wall or 0.0)
    return (
        f"Wall time of these runs: {fmt_time(sum(walls))} over {len(walls)} runs, "
        f"+ {fmt_time(sum(starts.values()))} for {len(starts)} SFT warm start(s). Every "
        "attempt of every run summed, evaluations and checkpoints included; an attempt "
        "that was killed counts by the steps and evaluations it logged (a lower bound)."
    )


def claim_numbers(runs: list[dict]) -> list[str]:
    """The numbers each claim of the method turns on, side by side (no verdicts)."""
    g = group(runs)

    def m(v, key):
        return agg(r[key] for r in g.get(v, []))[0]

    def line(text, *vals):
        return text.format(*[fmt(x) for x in vals])

    out = []
    if "sparse" in g:
        out.append(
            line(
                "- Claim 1, naive sparse is off-policy: final KL(sparse‖dense) {} per token "
                "(first steps {}); p5 α {} in bin 0 vs {} in the longest bin; KL {} in "
                "bin 0 vs {} in the longest bin.",
                m("sparse", "kl_exact"),
                m("sparse", "kl_exact_first"),
                m("sparse", "alpha_p5_first_bin"),
                m("sparse", "alpha_p5_longest_bin"),
                m("sparse", "kl_first_bin"),
                m("sparse", "kl_longest_bin"),
            )
        )
        if "dense" in g:
            out.append(
                line(
                    "  Training quality: held-out greedy accuracy dense {} vs naive "
                    "sparse {}; final rollout reward dense {} vs sparse {}.",
                    m("dense", "greedy_accuracy"),
                    m("sparse", "greedy_accuracy"),
                    m("dense", "reward_final"),
                    m("sparse", "reward_final"),
                )
            )
    for v, what in (("sparse_tis", "TIS clip fraction"), ("sparse_mis", "MIS masked fraction")):
        if v in g:
            key = "tis_clip_frac" if v == "sparse_tis" else "mis_masked_frac"
            out.append(
                line(
                    f"- Claim 2, `{v}`: greedy accuracy {{}} (naive sparse {{}}, dense {{}}), "
                    f"final KL {{}}, {what} {{}}.",
                    m(v, "greedy_accuracy"),
                    m("sparse", "greedy_accuracy"),
                    m("dense", "greedy_accuracy"),
                    m(v, "kl_exact"),
                    m(v, key),
                )
            )
    if "distillsparse" in g:
        ds, sp = m("distillsparse", "kl_exact"), m("sparse", "kl_exact")
        ratio = (sp / ds) if _finite(sp) and _finite(ds) and ds > 0 else None
        out.append(
            line(
                "- Claim 3, DistillSparse: final KL {} vs naive sparse {} (ratio sparse / "
                "DistillSparse {}); p5 α longest bin {} vs {}; greedy accuracy {} vs "
                "dense {}; actor greedy accuracy {}.",
                ds,
                sp,
                ratio,
                m("distillsparse", "alpha_p5_longest_bin"),
                m("sparse", "alpha_p5_longest_bin"),
                m("distillsparse", "greedy_accuracy"),
                m("dense", "greedy_accuracy"),
                m("distillsparse", "actor_greedy_accuracy"),
            )
        )
        td, tds = m("dense", "rollout_tokens_per_s"), m("distillsparse", "rollout_tokens_per_s")
        sd, sds = m("dense", "time_step"), m("distillsparse", "time_step")
        out.append(
            line(
                "  Cost: rollout tokens/s {} vs dense {} (ratio {}); s per RL step {} "
                "vs dense {} (ratio dense / DistillSparse {}).",
                tds,
                td,
                tds / td if _finite(td) and _finite(tds) and td else None,
                sds,
                sd,
                sd / sds if _finite(sd) and _finite(sds) and sds else None,
            )
        )
    if "distillsparse_m2n" in g:
        out.append(
            line(
                "- Claim 4, oversampling M = 2n: greedy accuracy {} vs DistillSparse {}; final "
                "KL {} vs {}; s per RL step {} vs {}.",
                m("distillsparse_m2n", "greedy_accuracy"),
                m("distillsparse", "greedy_accuracy"),
                m("distillsparse_m2n", "kl_exact"),
                m("distillsparse", "kl_exact"),
                m("distillsparse_m2n", "time_step"),
                m("distillsparse", "time_step"),
            )
        )
    return out


# ------------------------------------------------------------------------------- figures
def sweep_figure(sweep: dict, path: str) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in sweep.get("rows", []) if r.get("budget") is not None]
    if not rows:
        return None
    x = [r["budget"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    axes[0].plot(x, [r.get("kl_exact") for r in rows], "-o", label="exact KL(sparse‖dense)")
    axes[0].plot(x, [r.get("kl_k3") for r in rows], ":o", label="k3")
    axes[0].set_yscale("log")
    axes[0].set_title("mismatch per token vs budget")
    axes[1].plot(x, [r.get("alpha_mean") for r in rows], "-o", label="mean α")
    axes[1].plot(x, [r.get("alpha_p5") for r in rows], ":o", label="p5 α")
    axes[1].set_title("acceptance vs budget")
    dense = next((r for r in sweep["rows"] if r.get("budget") is None), {})
    axes[2].plot(x, [r.get("reward") for r in rows], "-o", label="sampled reward (sparse)")
    if "greedy_accuracy" in rows[0]:
        axes[2].plot(
            x, [r.get("greedy_accuracy") for r in rows], ":o", label="greedy acc. (sparse)"
        )
    for key, style in (("reward", "C0"), ("greedy_accuracy", "C1")):
        if _finite(dense.get(key)):
            axes[2].axhline(
                dense[key], color=style, linestyle="--", linewidth=1, label=f"dense {key}"
            )
    axes[2].set_title("sparse actor quality vs budget")
    for ax in axes:
        ax.set_xlabel("sparse.budget (pages)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_figures(runs: list[dict], fig_dir: str, sweep: dict | None) -> list[str]:
    from dsparse_jax.harness import plots  # imports matplotlib

    os.makedirs(fig_dir, exist_ok=True)
    written = []
    first = {}
    for r in runs:  # each variant's lowest seed
        first.setdefault(r["variant"], r)
    wds = [r["workdir"] for r in first.values()]
    kkeys = tuple(sorted({f"mean_at_{r['k']}" for r in runs if r["k"]}))
    panels = (
        (
            "eval",
            ("greedy_accuracy", "sparse_greedy_accuracy"),
            "held-out greedy accuracy: dense policy (solid) / actor (dashed)",
        ),
        ("eval", kkeys, "held-out " + ", ".join(k.replace("_at_", "@") for k in kkeys)),
        ("rl", ("reward",), "rollout reward (all generated samples)"),
        ("rl", ("response_length_mean",), "response length"),
    )
    written.append(
        plots.plot_curves(
            wds,
            os.path.join(fig_dir, "curves.png"),
            panels=panels if kkeys else panels[:1] + panels[2:],
            labels=list(first),
        )
    )
    written += plots.plot_runs(wds, fig_dir)  # reward, mismatch, kl_bins, alpha_bins
    pair = [
        first[v]["workdir"] for v in ("sparse", "distillsparse", "distillsparse_m2n") if v in first
    ]
    if pair:  # the bins figures: naive sparse vs DistillSparse only, early vs late
        plots.plot_bins(pair, fig_dir)
    groups = group(runs)
    main = {v: [r["workdir"] for r in rs] for v, rs in groups.items() if v in MAIN or len(rs) > 1}
    if main:
        written.append(plots.plot_seed_spread(main, os.path.join(fig_dir, "main_seeds.png")))
    bars = {}
    for v, rs in groups.items():
        mean, s, _ = agg(r["rollout_tokens_per_s"] for r in rs)
        if mean is not None:
            bars[v] = (mean, s or 0.0)
    written.append(plots.plot_throughput(wds, os.path.join(fig_dir, "throughput.png"), bars))
    if sweep:
        p = sweep_figure(sweep, os.path.join(fig_dir, "sweep.png"))
        if p:
            written.append(p)
    return written


# -------------------------------------------------------------------------------- report
def preserved_conclusions(path: str) -> str:
    """The human-written block of an existing report (its inner text), or the placeholder."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return PLACEHOLDER
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        return PLACEHOLDER
    inner = text[i + len(BEGIN) : j].strip("\n")
    return inner if inner.strip() else PLACEHOLDER


def _config_name(path: str | None) -> str:
    """The config's path from the checkout's root (<its folder>/<file> when the
    experiment ran from another checkout)."""
    if not path:
        return "?"
    rel = os.path.relpath(path, ROOT)
    return os.path.join(*path.split(os.sep)[-2:]) if rel.startswith("..") else rel


def render(
    expdirs: list[str],
    runs: list[dict],
    fig_rel: str,
    figures: list[str],
    sweep_md: str | None,
    conclusions: str,
) -> str:
    expdir = expdirs[0]  # the settings and the warm start are read from the first
    exp = _read_json(os.path.join(expdir, "experiment.json")) or {}
    sft, sft_s = sft_base(expdir)
    over = exp.get("common_overrides", {})
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Results: dense vs naive sparse vs IS corrections vs DistillSparse",
        "",
        "<!-- Generated by `python -m dsparse_jax.harness.experiment report` "
        "(dsparse_jax/harness/results.py). Edit only "
        "the Conclusions block: everything else is rewritten. -->",
        "",
        f"Experiment{'s' if len(expdirs) > 1 else ''} "
        f"{', '.join(f'`{d}`' for d in expdirs)}, report written {now}. "
        f"Config `{_config_name(exp.get('config'))}`"
        + (" with `--quick`" if exp.get("quick") else "")
        + (
            ", overrides for every run: " + ", ".join(f"`{k}={v}`" for k, v in over.items())
            if over
            else ""
        )
        + ".",
        f"Shared SFT warm start (`sft_base`): held-out greedy accuracy "
        f"{fmt(sft.get('sft_greedy_accuracy'))}, {fmt_time(sft_s)}. "
        "Command and variants: docs/experiments.md.",
        "",
        "## Table 1 (this scale)",
        "",
        *main_table(runs),
        "",
        "Mean ± standard error over the seeds listed (no ± with one seed); "
        "[lo, hi]: 95% bootstrap interval of the final accuracy over seeds x held-out "
        "problems (runs that logged per-problem outcomes). "
        "Accuracies: the last held-out evaluation of the dense policy (greedy, and mean@k "
        "at the rollout temperature); *actor*: the rollout policy's greedy accuracy (sparse "
        "attention, + LoRA in DistillSparse). *Final* KL and α: mean over the last 10% of RL "
        "steps of the exact per-token mismatch of the rollout policy vs the dense policy "
        "(none in dense mode); p5 α: 5th percentile of the acceptance α in the longest "
        "completion-position bin with tokens, and in the bin where it is lowest (worst). "
        "Tokens/s and s per step: medians over RL steps "
        ">= 2 (step 1 compiles). Wall time: the run's processes, all attempts (compile, "
        "evaluations and checkpoints included; the shared SFT warm start not).",
        "",
        cpu_time(runs, expdirs),
        "",
        "## Held-out greedy accuracy over training",
        "",
        *curve_table(runs),
        "",
        "Dense policy / actor at each evaluation, mean ± standard error over the seeds "
        "(n: the seeds evaluated at that step, where not all).",
        "",
        "## Seconds per RL step, by phase",
        "",
        *phase_table(runs),
        "",
        "Each run's median over RL steps >= 2, then mean ± standard error over seeds. "
        "Times are wall-clock on the machine the runs shared (see the conclusions for "
        "what else ran beside them).",
        "",
        "## Mismatch over training and over the completion",
        "",
        *mismatch_table(runs),
        "",
        "Exact KL(actor ‖ dense) per token over all generated rows, and the 5th percentile "
        "of the acceptance α, by thirds of the RL steps and by completion-position ranges "
        "(each the mean of its position bins), mean ± standard error over seeds.",
        "",
        "## Per run",
        "",
        *run_table(runs),
        "",
        "TIS clip, MIS masked: over the final steps, the share of tokens whose TIS weight "
        "was capped and the share MIS would drop at the token and at the sequence level "
        "(`rl.mis_level`), logged in every mode whatever correction the run applies.",
        "",
        "## Numbers behind each claim",
        "",
        *claim_numbers(runs),
        "",
        "## Sparsity sweep",
        "",
        sweep_md.strip()
        if sweep_md
        else "_No sweep yet: `python -m dsparse_jax.harness.experiment sweep --expdir=...`._",
        "",
        "## Figures",
        "",
    ]
    captions = {
        "curves.png": "held-out greedy accuracy (dense policy / actor), mean@k, rollout reward "
        "and response length vs step, every mode (first seed)",
        "reward.png": "reward, response length, held-out accuracy (dense / actor) and rollout "
        "accuracy vs step, every mode (first seed)",
        "mismatch.png": "exact and k3 KL(sparse‖dense), acceptance (mean, p5), log-ratio, TIS "
        "clip / MIS mask fractions vs step",
        "kl_bins.png": "KL(sparse‖dense) per completion-position bin, naive sparse vs "
        "DistillSparse, first third (dashed) vs last third (solid) of training",
        "alpha_bins.png": "5th percentile and mean of acceptance α per position bin, naive "
        "sparse vs DistillSparse, early (dashed) vs late (solid)",
        "main_seeds.png": "the main comparison and every variant with several seeds: mean "
        "over seeds with a ± standard error band",
        "throughput.png": "rollout tokens/s and time per RL step",
        "sweep.png": "sparsity sweep: mismatch and actor quality vs budget",
    }
    names = [os.path.basename(p) for p in figures]
    for n in dict.fromkeys(names):
        lines += [f"![{n}]({fig_rel}/{n})", "", f"*{captions.get(n, n)}*", ""]
    lines += ["## Conclusions", "", BEGIN, conclusions, END, ""]
    return "\n".join(lines)


def write_report(
    expdir: str | list[str], out: str | None = None, fig_dir: str | None = None
) -> str:
    """Write the report of the runs under `expdir` (`a,b`: several experiments; the
    sweep and the settings shown come from the first)."""
    out = out or os.path.join(ROOT, "docs", "results.md")
    fig_dir = fig_dir or os.path.join(os.path.dirname(os.path.abspath(out)), "results")
    expdirs = split_expdirs(expdir)
    runs = find_runs(expdirs)
    if not runs:
        raise UserError(f"no runs with RL metrics under {','.join(expdirs)}")
    sweep = _read_json(os.path.join(expdirs[0], "sweep", "sweep.json"))
    sweep_md = None
    if os.path.exists(os.path.join(expdirs[0], "sweep", "sweep.md")):
        with open(os.path.join(expdirs[0], "sweep", "sweep.md")) as f:
            sweep_md = f.read()
    figures = make_figures(runs, fig_dir, sweep)
    fig_rel = os.path.relpath(fig_dir, os.path.dirname(os.path.abspath(out)))
    text = render(expdirs, runs, fig_rel, figures, sweep_md, preserved_conclusions(out))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    files.write_text_atomic(out, text)
    files.write_json_atomic(os.path.join(expdirs[0], "results_summary.json"), runs, indent=2)
    print(f"[report] {len(runs)} runs -> {out}, figures in {fig_dir}", flush=True)
    return out


def main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.results", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--expdir", required=True, help="an experiment directory, or several: a,b")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    p.add_argument("--fig_dir", default=None)
    a = p.parse_args(argv)
    write_report(a.expdir, a.out, a.fig_dir)
    return 0


if __name__ == "__main__":
    cli.run(main)
