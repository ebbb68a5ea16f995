"""Mechanism diagnostics: lookup and vote steps are found where the facts are, hits are
read off the page record, and the KL/alpha splits average the right tokens."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dsparse_jax.data import math_task as mt
from dsparse_jax.harness import lookups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MECHANISM = [sys.executable, "-m", "dsparse_jax.harness.mechanism"]
TRAIN = [sys.executable, os.path.join(ROOT, "launch", "train.py")]
CFG = mt.ChainTaskConfig(num_vars=6, num_terms=9, name_digits=0, repeat_terms=True, agg_every=4)
PS = 4


def _text(problem, solution=None):
    """BOS + prompt + solution, one character per position (BOS as '\\0')."""
    return "\0" + problem.prompt + (problem.solution if solution is None else solution)


def test_steps_sit_on_the_facts():
    p = mt.make_problem(CFG, "train", 3, seed=0)
    text = _text(p)
    steps = lookups.find_steps(0, text, 1 + len(p.prompt))
    look = [s for s in steps if s.kind == "lookup"]
    votes = [s for s in steps if s.kind == "vote"]
    assert len(look) == 9 and len(votes) == 2
    for s in look:
        assert text[s.fact_pos] == text[s.pos]  # the generated value is the defined one
        assert text[s.fact_pos - 1] == text[s.pos - 1]  # after the same name
        assert s.fact_pos < 1 + len(p.prompt) and s.correct
        for c in s.copy_pos:  # earlier solution lines with the same name
            assert c < s.pos and text[c - 1 : c + 1] == text[s.pos - 1 : s.pos + 1]
    for s in votes:
        assert text[s.pos - 5 : s.pos] == "vote=" and s.correct


def test_steps_of_the_names_order():
    """order="names" ("k+7" definitions, "k+7 :=5" lines): the same steps and facts."""
    cfg = mt.ChainTaskConfig(num_vars=9, num_terms=9, name_digits=0, agg_every=4, order="names")
    p = mt.make_problem(cfg, "train", 5, seed=0)
    text = _text(p)
    steps = lookups.find_steps(0, text, 1 + len(p.prompt))
    look = [s for s in steps if s.kind == "lookup"]
    assert len(look) == 9 and len([s for s in steps if s.kind == "vote"]) == 2
    assert all(s.correct for s in steps)
    for s in look:
        assert text[s.fact_pos - 2 : s.fact_pos + 1] == text[s.pos - 2 : s.pos + 1]  # "k+7"


def test_wrong_values_and_unknown_names():
    p = mt.make_problem(CFG, "train", 3, seed=0)
    lines = p.solution.split("\n")
    name, value = lines[0][1], lines[0][2]
    lines[0] = lines[0][0] + name + str((int(value) + 1) % 10) + lines[0][3:]
    undefined = next(c for c in "abcdefghijklmnopqrstuvwxyz" if f" {c}" not in p.prompt)
    lines[1] = lines[1][0] + undefined + lines[1][2:]
    vote = next(i for i, line in enumerate(lines) if line.startswith("vote="))
    lines[vote] = "vote=" + str(1 - int(lines[vote][5])) + lines[vote][6:]
    steps = lookups.find_steps(0, _text(p, "\n".join(lines)), 1 + len(p.prompt))
    assert not steps[0].correct and steps[0].fact_pos is not None
    assert steps[1].fact_pos is None and not steps[1].correct
    assert not [s for s in steps if s.kind == "vote"][0].correct
    assert all(s.correct for s in steps[2:] if s.kind == "lookup")


def test_hits_and_splits():
    p = mt.make_problem(CFG, "train", 3, seed=0)
    text = _text(p)
    s_len = len(text)
    steps = lookups.find_steps(0, text, 1 + len(p.prompt))
    look = [s for s in steps if s.kind == "lookup"]
    # Layer 2 head 0 reads every fact page; head 1 reads it only for even lookups.
    ids = np.full((1, s_len, 2, 3), -1)
    for i, s in enumerate(look):
        ids[0, s.pos - 1, 0, 0] = s.fact_pos // PS
        ids[0, s.pos - 1, 1, 1] = s.fact_pos // PS if i % 2 == 0 else s.fact_pos // PS + 1
    hit = lookups.hits(steps, {2: ids}, PS)
    assert hit[2].shape == (9, 2)
    assert hit[2][:, 0].all() and list(hit[2][:, 1]) == [i % 2 == 0 for i in range(9)]
    kl = np.zeros((1, s_len))
    alpha = np.ones((1, s_len))
    for i, s in enumerate(look):
        kl[0, s.pos] = 1.0 if i % 2 else 0.1  # the misses cost more
        alpha[0, s.pos] = 0.5 if i % 2 else 0.9
    mask = np.zeros((1, s_len))
    mask[0, 1 + len(p.prompt) :] = 1
    out = lookups.summarize(steps, hit, kl, alpha, mask)
    assert out["hit_rate_L2h0"] == 1.0 and np.isclose(out["hit_rate_L2h1"], 5 / 9)
    assert out["lookups_all_hit"] == 5 and out["lookups_any_miss"] == 4
    assert np.isclose(out["kl_lookup_all_hit"], 0.1) and np.isclose(out["kl_lookup_any_miss"], 1)
    assert np.isclose(out["alpha_lookup_any_miss"], 0.5)
    assert out["kl_miss_L2h0"] is None and np.isclose(out["kl_miss_L2h1"], 1.0)
    assert out["kl_other"] == 0.0 and out["alpha_other"] == 1.0  # lookups excluded
    assert out["correct_lookup_all_hit"] == 1.0 and out["vote_steps"] == 2


@pytest.mark.slow
def test_mechanism_script_end_to_end(tmp_path):
    """harness/mechanism.py on a 2-step SFT of a tiny mini-preset model: every command runs
    and writes its JSON (lookups per budget; distill curves and the selection effect;
    two-level selection against the flat one)."""
    tiny = [
        "--config.model.preset=mini",
        "--config.model.d_model=32",
        "--config.model.num_layers=3",
        "--config.model.head_dim=8",
        "--config.model.mlp_dim=64",
        "--config.task.num_vars=6",
        "--config.task.num_terms=6",
        "--config.task.agg_every=2",
        "--config.task.name_digits=0",
        "--config.sft.max_steps=2",
        "--config.sft.curriculum=",
        "--config.sft.batch_size=4",
        "--config.sft.eval_every=2",
        "--config.eval.num_problems=4",
        "--config.rl.samples_per_prompt=2",
        "--config.log.tensorboard=false",
        "--config.attention.page_size=8",
        "--config.sparse.budget=3",
        "--config.sparse.dense_layers=1",
        "--config.lora.rank=2",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    config = "--config=" + os.path.join(ROOT, "configs", "mini_longchain.py")
    run = lambda command, *a: subprocess.run(
        [*command, *a, config, *tiny],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    w = str(tmp_path / "w")
    p = run(MECHANISM, "lookups", f"--workdir={w}")
    assert p.returncode == 2 and "sft_only" in p.stderr  # no SFT yet: one clear line
    assert run(TRAIN, f"--workdir={w}", "--sft_only").returncode == 0
    p = run(MECHANISM, "lookups", f"--workdir={w}", "--budgets=3,4", "--prompts=2")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.load(open(os.path.join(w, "mechanism", "lookups.json")))
    assert out["sparse_layers"] == [1, 2] and [r["budget"] for r in out["rows"]] == [3, 4]
    assert out["complete"] is True
    for r in out["rows"]:
        assert r["lookup_steps"] + r["vote_steps"] >= 0 and r["kl_mean"] >= 0
    args = ["--steps=2", "--every=1", "--lrs=1e-2", "--replay=1", "--prompts=2"]
    p = run(MECHANISM, "distill", f"--workdir={w}", "--budget=3", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.load(open(os.path.join(w, "mechanism", "distill.json")))
    assert [(r["kl"], len(r["curve"])) for r in out["runs"]] == [("k3", 3), ("exact_reverse", 3)]
    assert out["complete"] is True
    sel = out["runs"][0]["selection"]
    assert 0 <= sel["page_overlap"] <= 1 and sel["kl_phi_on_own_pages"] >= 0
    # Two-level selection on the flat actor's prefixes: candidates covering every page
    # (64 groups) read the flat pages exactly (overlap 1, the same KL to 1e-6).
    p = run(MECHANISM, "selection", f"--workdir={w}", "--budget=3", "--groups=2:64,2:1")
    assert p.returncode == 2 and "--groups: '2:1'" in p.stderr.strip().splitlines()[-1]
    p = run(MECHANISM, "selection", f"--workdir={w}", "--budget=3", "--groups=2:3,2:64")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.load(open(os.path.join(w, "mechanism", "selection.json")))
    assert out["complete"] is True and len(out["rows"]) == 2
    assert 0 <= out["rows"][0]["page_overlap"] <= 1
    assert out["rows"][1]["page_overlap"] == 1.0
    assert abs(out["rows"][1]["kl_mean"] - out["flat"]["kl_mean"]) < 1e-6


def test_distill_refuses_an_estimator_without_a_divergence(tmp_path):
    """k1 on the actor's own samples has a zero gradient in expectation (rl/modes.DISTILL_KL):
    one line naming --kls, exit 2, before any model is built."""
    proc = subprocess.run(
        [*MECHANISM, "distill"] + [f"--workdir={tmp_path}", "--kls=k3,k1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kls" in lines[0] and "k1" in lines[0], proc.stderr
