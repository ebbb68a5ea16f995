"""The experiment harness (harness/experiment.py, harness/results.py): a tiny end-to-end
sweep of two variants from one shared SFT warm start, its resume (a finished run is
skipped, an unfinished one resumes from its checkpoint) and the generated report."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.harness import experiment as ex
from dsparse_jax.harness import results as res

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "model.d_model=32",
    "model.num_layers=2",
    "model.mlp_dim=64",
    "task.num_vars=4",
    "task.num_terms=2",
    "sft.max_steps=2",
    "sft.batch_size=4",
    "sft.eval_every=2",
    "eval.num_problems=4",
    "eval.every=1",
    "eval.mean_at_k=2",
    "rl.prompts_per_step=2",
    "rl.samples_per_prompt=2",
    "rl.minibatches=2",
    "checkpoint.every=1",
    "log.tensorboard=false",
    "attention.page_size=8",
    "sparse.budget=3",
    "sparse.dense_layers=1",
    "lora.rank=2",
]


def _experiment(*args):
    cmd = [sys.executable, "-m", "dsparse_jax.harness.experiment", *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _steps(workdir, phase):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if r["phase"] == phase]


def test_plan_variants_and_overrides():
    assert ex.resolve_variants("dense,sparse+tis,distillsparse+M=2n", False) == [
        "dense",
        "sparse_tis",
        "distillsparse_m2n",
    ]
    assert ex.resolve_variants(None, True) == list(ex.MAIN)
    assert ex.resolve_variants(None, False) == list(ex.VARIANTS)
    with pytest.raises(UserError):
        ex.resolve_variants("nope", False)
    # every variant at the first seed, then the main comparison's other seeds
    assert ex.plan_runs(["dense", "sparse_tis", "distillsparse"], [0, 1]) == [
        ("dense", 0),
        ("sparse_tis", 0),
        ("distillsparse", 0),
        ("dense", 1),
        ("distillsparse", 1),
    ]
    cfg = os.path.join(ROOT, "configs", "gemma_math.py")
    over = ex.run_overrides(cfg, {"rl.samples_per_prompt": 4}, "distillsparse_m2n", 3)
    assert over["rl.samples_generated"] == 8 and over["seed"] == 3
    assert over["rl.rollout_mode"] == "distillsparse"
    assert cli.load_config(cfg, over).rl.samples_generated == 8
    assert ex.run_overrides(cfg, {}, "sparse_mis", 0)["rl.is_correction"] == "mis"

    class A:
        quick, overrides, steps = True, {"rl.learning_rate": "1e-4"}, 5

    common = ex.common_overrides(A)
    assert common["rl.num_steps"] == 5 and common["rl.learning_rate"] == "1e-4"
    assert common["sparse.budget"] == ex.QUICK["sparse.budget"]
    assert common["eval.every"] == ex.QUICK["eval.every"]
    A.overrides = {"rl.rollout_mode": "dense"}  # defines the variants: refused
    with pytest.raises(UserError):
        ex.common_overrides(A)


def test_every_variant_is_a_valid_config_and_documented():
    """Each variant's overrides give a config that validates (on the miniature of issue
    39's comparison), and docs/experiments.md's table of variants lists it."""
    from dsparse_jax.config.validate import validate

    cfg = os.path.join(ROOT, "configs", "mini_longchain.py")
    with open(os.path.join(ROOT, "docs", "experiments.md")) as f:
        section = f.read().split("\n## The variants\n")[1].split("\n## ")[0]
    rows = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    for name in ex.VARIANTS:
        validate(cli.load_config(cfg, ex.run_overrides(cfg, {}, name, 0)))
        assert name in rows, f"docs/experiments.md lists no variant {name}"


@pytest.mark.slow
def test_tiny_experiment_resumes_and_reports(tmp_path):
    exp = str(tmp_path / "exp")
    sets = [f"--config.{s}" for s in TINY]
    args = [
        "run",
        f"--expdir={exp}",
        "--seeds=0",
        "--steps=2",
        "--variants=dense,distillsparse",
        *sets,
    ]
    first = _experiment(*args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert os.path.exists(os.path.join(exp, "sft_base", "sft", "DONE.json"))
    for name in ("dense_s0", "distillsparse_s0"):
        wd = os.path.join(exp, name)
        assert _steps(wd, "rl") == [1, 2]
        assert _steps(wd, "eval") == [0, 1, 2]
        assert os.path.exists(os.path.join(wd, "sft", "DONE.json"))
        assert os.path.exists(os.path.join(wd, "summary.json"))
        with open(os.path.join(wd, "train.log")) as f:
            assert "reusing cached warm start" in f.read()  # the shared SFT, not retrained
    with open(os.path.join(exp, "distillsparse_s0", "config.json")) as f:
        cfg = json.load(f)
    assert cfg["rl"]["rollout_mode"] == "distillsparse"
    assert cfg["metrics"]["position_bin"] == 16  # experiment.BASE: several position bins

    # Second invocation: the finished run is skipped, the unfinished one (summary.json
    # gone, as after a kill before the end) resumes from its checkpoint.
    os.remove(os.path.join(exp, "distillsparse_s0", "summary.json"))
    second = _experiment(*args)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "dense_s0: finished, skipped" in second.stdout
    assert "distillsparse_s0: resuming (step 2)" in second.stdout
    with open(os.path.join(exp, "distillsparse_s0", "train.log")) as f:
        assert "resuming from checkpoint at step 2" in f.read()
    with open(os.path.join(exp, "dense_s0", "experiment_run.json")) as f:
        assert len(json.load(f)["attempts"]) == 1
    assert _steps(os.path.join(exp, "distillsparse_s0"), "rl") == [1, 2]

    # Other settings in the same expdir are refused, not mixed.
    bad = _experiment(*args, "--config.rl.learning_rate=1e-5", "--dry_run")
    assert bad.returncode == 0  # --dry_run only lists
    bad = _experiment(*args, "--config.rl.learning_rate=1e-5")
    assert bad.returncode != 0 and "other settings" in bad.stdout + bad.stderr

    # Sparsity sweep on the shared warm start (reused, not retrained): one budget.
    sweep = _experiment(
        "sweep", f"--expdir={exp}", *sets, "--budgets=3", "--batches=1", "--no_greedy"
    )
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    with open(os.path.join(exp, "sweep", "sweep.json")) as f:
        rows = json.load(f)["rows"]
    assert [r["budget"] for r in rows] == [None, 3]
    assert rows[1]["kl_exact"] > 0 and 0 < rows[1]["alpha_p5"] <= 1

    # Report: table rows, figures, and a human-written Conclusions block kept.
    out = str(tmp_path / "docs" / "results.md")
    rep = _experiment("report", f"--expdir={exp}", f"--out={out}")
    assert rep.returncode == 0, rep.stdout[-3000:] + rep.stderr[-3000:]
    with open(out) as f:
        text = f.read()
    table = [l for l in text.splitlines() if l.startswith("| ") and "(`" in l]
    assert any("(`dense`)" in l for l in table) and any("(`distillsparse`)" in l for l in table)
    row = next(l for l in table if "(`distillsparse`)" in l).split("|")
    assert row[7].strip() != "-"  # final KL(sparse || dense) of the sparse actor
    assert "| 3 |" in text  # the sweep's row
    for png in (
        "curves.png",
        "reward.png",
        "mismatch.png",
        "kl_bins.png",
        "alpha_bins.png",
        "main_seeds.png",
        "throughput.png",
        "sweep.png",
    ):
        assert os.path.getsize(os.path.join(tmp_path, "docs", "results", png)) > 0
        assert f"results/{png}" in text
    edited = text.replace(res.PLACEHOLDER, "Claim 1 held: KL 0.1.")
    with open(out, "w") as f:
        f.write(edited)
    res.write_report(exp, out)
    with open(out) as f:
        again = f.read()
    assert "Claim 1 held: KL 0.1." in again and res.PLACEHOLDER not in again


def test_bootstrap_interval_over_seeds_and_problems():
    """The interval resamples problems too (one seed of 400 fair coins: the binomial
    interval, +-1.96 sqrt(p (1 - p) / P)) and seeds (seeds that disagree widen it)."""
    coins = np.random.default_rng(0).integers(0, 2, (1, 400))
    lo, hi = res.bootstrap_interval(coins)
    half = 1.96 * np.sqrt(0.25 / 400)
    assert lo < coins.mean() < hi and abs((hi - lo) / 2 - half) < 0.2 * half
    assert res.bootstrap_interval(np.ones((3, 50))) == (1.0, 1.0)
    agree = np.tile(coins[:, :100], (3, 1))
    apart = np.stack([coins[0, :100], 1 - coins[0, :100], np.ones(100)]).astype(int)
    width = lambda x: np.subtract(*res.bootstrap_interval(x)[::-1])
    assert width(apart) > 2 * width(agree)
    rs = [{"greedy_correct": list(row)} for row in apart]
    assert res.interval_cell(rs, "greedy_correct").startswith(" [")
    assert res.interval_cell(rs + [{"greedy_correct": None}], "greedy_correct") == ""


def _fake_run(expdir, name, rl, ev, attempts=(), bin_width=16):
    """A run directory as harness/experiment.py leaves it: metrics, config, run record."""
    wd = os.path.join(expdir, name)
    os.makedirs(wd)
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        for r in rl:
            f.write(json.dumps({"phase": "rl", **r}) + "\n")
        for r in ev:
            f.write(json.dumps({"phase": "eval", **r}) + "\n")
    with open(os.path.join(wd, "config.json"), "w") as f:
        json.dump({"rl": {"num_steps": len(rl)}, "metrics": {"position_bin": bin_width}}, f)
    with open(os.path.join(wd, "experiment_run.json"), "w") as f:
        json.dump({"attempts": [{"wall_s": w} for w in attempts]}, f)


def test_report_tables_over_experiments_seeds_phases_and_windows(tmp_path):
    """Several experiment directories read as one; per-phase medians over steps >= 2;
    accuracy by step as mean ± standard error over seeds; the mismatch by thirds of
    training and by position range; a killed run's wall time bounded by what it logged;
    a warm start copied between experiments counted once."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for d in (a, b):
        os.makedirs(os.path.join(d, "sft_base"))
        with open(os.path.join(d, "sft_base", "summary.json"), "w") as f:
            json.dump({"wall_time_s": 600.0}, f)  # the same warm start, copied

    def rl_records(seed):
        out = []
        for step in range(1, 7):  # thirds: steps 1-2, 3-4, 5-6; step 1 compiles
            kl = 0.1 * ((step + 1) // 2)  # 0.1, 0.2, 0.3 by third
            out.append(
                {
                    "step": step,
                    "time_rollout": {1: 100.0, 5: 9.0, 6: 9.0}.get(step, 2.0 + seed),
                    "time_update_theta": 3.0,
                    "time_step": 5.0 + seed,
                    "kl_exact": kl,
                    "kl_exact_bin0": kl / 10,
                    "kl_exact_bin3": kl,
                    "tokens_bin0": 5,
                    "tokens_bin3": 5,
                    "alpha_p5_bin0": 1.0,
                    "alpha_p5_bin3": 0.5,
                    "mis_masked_frac": 0.25,
                    "mis_seq_masked_frac": 0.5,
                }
            )
        return out

    ev = lambda acc: [  # noqa: E731
        {"step": 0, "greedy_accuracy": 0.5, "sparse_greedy_accuracy": 0.25, "time": 10.0},
        {"step": 6, "greedy_accuracy": acc, "sparse_greedy_accuracy": acc, "time": 10.0},
    ]
    _fake_run(a, "sparse_s0", rl_records(0), ev(0.2), attempts=[1000.0])
    _fake_run(b, "sparse_s1", rl_records(1), ev(0.6))  # killed: no attempt recorded

    runs = res.find_runs(f"{a},{b}")
    assert [r["name"] for r in runs] == ["a/sparse_s0", "b/sparse_s1"]
    assert runs[0]["phase_s"] == {"rollout": 2.0, "update_theta": 3.0}
    assert runs[1]["wall_s"] == 6 * 6.0 + 2 * 10.0  # its steps and evaluations
    assert [w["steps"] for w in runs[0]["mismatch_windows"]] == [(1, 2), (3, 4), (5, 6)]
    assert [w["kl_exact"] for w in runs[0]["mismatch_windows"]] == pytest.approx([0.1, 0.2, 0.3])

    curve = res.curve_table(runs)
    se = np.std([0.2, 0.6], ddof=1) / np.sqrt(2)
    assert curve[-1].startswith("| `sparse` | 0,1 (unfinished) |")  # neither run finished
    assert curve[-1].split("|")[4].strip() == f"0.400 ± {se:.3f} / 0.400 ± {se:.3f}"
    phases = res.phase_table(runs)
    assert phases[0].split("|")[3:5] == [" rollout ", " update_theta "]
    assert phases[-1].split("|")[3].strip() == "2.50 ± 0.50"
    mismatch = res.mismatch_table(runs)
    assert len(mismatch) == 2 + 3  # header, rule, three windows
    assert mismatch[-1].startswith("| `sparse` (n=2, unfinished) |")
    cells = [c.strip() for c in mismatch[-1].split("|")]
    assert cells[3] == "0.300 ± 0.000" and cells[4] == "0.030 ± 0.000"  # range 0: bin 0
    assert cells[5] == cells[6] == "-"  # bins 1, 2: no tokens
    assert cells[7] == "0.300 ± 0.000" and cells[11] == "0.500 ± 0.000"  # bin 3: KL, p5 α
    assert res.run_table(runs)[-1].split("|")[13].strip() == "0.250 / 0.500"  # MIS token / seq.
    line = res.cpu_time(runs, [a, b, str(tmp_path / "no_warm_start")])
    assert "over 2 runs" in line and "10m00s for 1 SFT warm start" in line
    # Neither run finished: both in the means. Once one has, the other (in progress)
    # leaves the means and is counted as unfinished.
    assert [len(rs) for rs in res.group(runs).values()] == [2]
    runs[0]["done"] = True
    assert res.group(runs) == {"sparse": [runs[0]]}
    assert res.seeds_cell(runs, "sparse", [runs[0]]) == "0 (+1 unfinished)"
    assert res.curve_table(runs)[-1].startswith("| `sparse` | 0 (+1 unfinished) |")
    assert res.mismatch_table(runs)[-1].startswith("| `sparse` (n=1) |")
