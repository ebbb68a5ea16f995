"""The console and run logs: one self-rewriting progress line on a terminal, one line
every log.every steps otherwise, the SFT ETA as an upper bound, samples.jsonl, and the
optional Weights & Biases mirror (offline)."""

import io
import json
import os
import re
import time

import pytest

from dsparse_jax.report.metrics import MetricsWriter, Progress


def test_not_a_terminal_prints_every_n_steps_and_the_last():
    out = io.StringIO()
    p = Progress("rl", 7, every=3, stream=out)
    assert not p.tty
    for step in range(1, 8):
        p.update(step, {"reward": 0.5}, ("reward",))
    p.close()
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["3/7", "6/7", "7/7"]
    assert "reward 0.5" in lines[0] and "ETA" in lines[0] and "\r" not in out.getvalue()


def test_a_terminal_gets_one_line_rewritten_in_place():
    out = io.StringIO()
    p = Progress("rl", 5, every=3, stream=out, tty=True)
    for step in range(1, 6):
        p.update(step, {})
    assert "\n" not in out.getvalue() and out.getvalue().count("\r") == 5
    p.close()
    p.close()  # idempotent
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1


def test_sft_eta_is_an_upper_bound():
    p = Progress("sft", 1500, every=1, stream=io.StringIO(), upper_bound=True)
    p.t0 -= 10.0  # 10 s for 10 steps: at most 1490 s left
    assert "ETA <= 24m50s (may stop earlier)" in p.line(10, {})
    q = Progress("rl", 1500, stream=io.StringIO())
    q.t0 -= 10.0
    assert "ETA 24m50s" in q.line(10, {})  # a loop that runs every step: a plain ETA


def test_progress_stays_silent_while_the_loop_is_quick():
    out = io.StringIO()
    p = Progress("eval", 3, stream=out, after_s=60.0)
    p.update(1, {})
    assert out.getvalue() == ""
    p.t0 -= 61.0  # a minute later: it reports
    p.update(2, {})
    assert " 2/3 " in out.getvalue()


def test_a_long_evaluation_prints_progress(monkeypatch, capsys):
    """Without a caller's on_batch, an evaluation longer than PROGRESS_AFTER_S prints a
    line per batch (here the threshold is 0 s: every batch)."""
    from test_modes import base_config

    from dsparse_jax.config.validate import validate
    from dsparse_jax.train import context, evaluation

    c = base_config()
    c.eval.num_problems = 3
    validate(c)
    ctx = context.build(c)
    ev = evaluation.Evaluator(
        ctx.sampler, ctx.tok, ctx.task, ctx.evaluator.problems, ctx.spec, batch_size=2
    )
    monkeypatch.setattr(evaluation, "PROGRESS_AFTER_S", 0.0)
    capsys.readouterr()
    ev.greedy(ctx.init_params)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[eval")]
    assert [line.split("] ")[0] for line in lines] == ["[eval 3 problems x 1"] * 2
    assert [line.split()[6] for line in lines] == ["1/2", "2/2"]


def test_samples_jsonl_and_drop_after(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3):
        w.write_samples(step, [{"prompt": "p", "completion": f"c{step}", "reward": 1.0}])
    w.drop_after("rl", 2)  # a resumed run redoes step 3
    with open(tmp_path / "samples.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["completion"]) for r in rows] == [(1, "c1"), (2, "c2")]


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (optional)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    w = MetricsWriter(
        str(tmp_path),
        tensorboard=False,
        wandb={"project": "dsparse_test", "name": "t", "config": {"seed": 0}},
    )
    w.write("sft", 1, {"loss": 2.0})
    w.write("rl", 1, {"reward": 0.5, "note": [1, 2]})
    w.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1
    files = os.listdir(tmp_path / "wandb" / runs[0])
    assert any(f.endswith(".wandb") for f in files)
    # A resumed run (a new writer on the same workdir) continues the same wandb run.
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert runs[0].endswith("-" + run_id)
    again = MetricsWriter(
        str(tmp_path),
        tensorboard=False,
        wandb={"project": "dsparse_test", "name": "t", "config": {"seed": 0}},
    )
    assert again._wandb.id == run_id  # pylint: disable=protected-access
    again.write("rl", 2, {"reward": 0.7})
    again.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    # offline-run-<time>-<id>, with "-1" added when both writers started in the same second
    name = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?")
    assert len(runs) == 2 and all(name.fullmatch(r) for r in runs), runs


def test_a_long_phase_says_it_is_still_running(capsys):
    from dsparse_jax.train import phases

    with phases.still_running("rl step 3 rollout", after_s=0.05, every_s=0.05):
        time.sleep(1.5)  # ~30 reports; 2 even on a loaded machine
    with phases.still_running("rl step 3 score", after_s=5.0):
        pass  # quick: silent
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 2 and all(x.startswith("[rl step 3 rollout] running, ") for x in lines)
