"""Reliability (docs/reliability.md): exact resume after SIGKILLs, corrupt checkpoints,
non-finite guards, unusable workdirs, rewards on arbitrary text.

The slow tests run the main job (launch/train.py) in subprocesses with the tiniest config
that exercises distillsparse with oversampling (M = 3 > n = 2), the test run's jax
compilation cache (tests/conftest.py), and DSPARSE_FAULTS
(dsparse_jax/reliability/faults.py) to kill a run at a chosen point or inject a NaN.
"""

import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsparse_jax.data.rewards import graders
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import checkpoints, faults
from dsparse_jax.report.metrics import MetricsWriter, read_metrics
from dsparse_jax.train import run, steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 6  # RL steps
TINY = [
    "--config.model.d_model=32",
    "--config.model.num_layers=2",
    "--config.model.mlp_dim=64",
    "--config.task.num_vars=4",
    "--config.task.num_terms=2",
    # 80 SFT steps: answers become well formed, so format_reward makes rewards vary within
    # a group (non-zero advantages: theta really moves)
    "--config.task.format_reward=0.5",
    "--config.sft.max_steps=80",
    "--config.sft.eval_every=80",
    "--config.sft.batch_size=8",
    "--config.sft.learning_rate=1e-2",
    "--config.eval.num_problems=4",
    "--config.eval.every=100",
    "--config.eval.mean_at_k=0",
    "--config.eval.sparse=false",
    "--config.rl.prompts_per_step=2",
    "--config.rl.samples_per_prompt=2",
    "--config.rl.samples_generated=3",
    "--config.rl.minibatches=2",
    "--config.log.tensorboard=false",
    "--config.sparse.budget=3",
    "--config.sparse.dense_layers=1",
    "--config.lora.rank=2",
    f"--config.rl.num_steps={N}",
]
TIMING = ("time", "rollout_tokens_per_s")  # metrics that are wall-clock measurements


def _train(workdir, *extra, fault=None):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train.py"),
        "--config=" + os.path.join(ROOT, "configs", "gemma_math.py"),
        f"--workdir={workdir}",
        *TINY,
        *extra,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def _metrics(workdir):
    """RL and eval records without wall-clock timings, in file order."""
    return [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in read_metrics(workdir)
        if r["phase"] in ("rl", "eval")
    ]


def _steps(workdir, name="checkpoints"):
    d = os.path.join(workdir, name)
    return sorted(int(s) for s in os.listdir(d) if s.isdigit())


def _raw(workdir, step, name="checkpoints"):
    """A checkpoint's leaves by path, read with plain orbax (no template)."""
    tree = ocp.StandardCheckpointer().restore(
        os.path.join(os.path.abspath(workdir), name, str(step), "default")
    )
    return {
        jax.tree_util.keystr(p): np.asarray(x)
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _flip_byte(step_dir):
    """Silent corruption: one bit of the largest data file (orbax reads it without error)."""
    files = [
        f for f in glob.glob(os.path.join(step_dir, "**", "*"), recursive=True) if os.path.isfile(f)
    ]
    big = max(files, key=os.path.getsize)
    b = bytearray(open(big, "rb").read())
    b[len(b) // 2] ^= 0x10
    open(big, "wb").write(bytes(b))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: N steps, checkpoints every 4 steps (so the final one at step
    6 is the end-of-training save)."""
    base = tmp_path_factory.mktemp("reliability")
    wd = str(base / "ref")
    t = time.time()
    res = _train(wd, "--config.checkpoint.every=4")
    assert res.returncode == 0, res.stderr[-3000:]
    print(f"reference run: {time.time() - t:.1f}s")
    return wd


@pytest.mark.slow
def test_exact_resume_after_kills_and_a_corrupt_checkpoint(reference, tmp_path):
    ref = reference
    assert _steps(ref) == [4, 6]  # periodic + final checkpoint (keep 3)
    ref_rl = [r for r in _metrics(ref) if r["phase"] == "rl"]
    assert [r["step"] for r in ref_rl] == list(range(1, N + 1))
    assert any(r["grad_norm"] > 0 for r in ref_rl)  # theta trained: a real comparison
    assert all(r["phi_grad_norm"] > 0 for r in ref_rl)

    wd = str(tmp_path / "killed")
    shutil.copytree(os.path.join(ref, "sft"), os.path.join(wd, "sft"))  # cached warm start
    every = "--config.checkpoint.every=1"
    for point in ("rl_rollout@2", "rl_update@4", "rl_checkpoint@5"):
        res = _train(wd, every, fault=point)
        assert res.returncode == -signal.SIGKILL, (point, res.returncode, res.stderr[-3000:])
        assert f"SIGKILL at {point}" in res.stdout
    # The newest finished checkpoint is corrupted on disk: the restart must detect it,
    # report it, and continue from the one before, exactly.
    latest = _steps(wd)[-1]
    _flip_byte(os.path.join(wd, "checkpoints", str(latest)))
    res = _train(wd, every)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"checkpoint {os.path.abspath(wd)}/checkpoints/{latest} is corrupt" in res.stdout
    assert f"resuming from checkpoint at step {latest - 1}" in res.stdout
    assert os.listdir(os.path.join(wd, "checkpoints.corrupt"))

    assert _metrics(wd) == _metrics(ref)  # every per-step metric and eval, bitwise
    assert _steps(wd) == [4, 5, 6]  # keep-last-3
    got, want = _raw(wd, N), _raw(ref, N)
    assert got.keys() == want.keys()
    for k in want:  # params, both optimizer states, LoRA, RNG, step, data position
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert any(k.startswith("['lora_opt_state']") for k in want)


@pytest.mark.slow
def test_nan_step_is_skipped_and_repeated_nans_halt(reference, tmp_path):
    ref = reference
    wd = str(tmp_path / "nan")
    shutil.copytree(os.path.join(ref, "sft"), os.path.join(wd, "sft"))
    res = _train(
        wd,
        "--config.checkpoint.every=1",
        "--config.checkpoint.keep=10",
        "--config.rl.max_consecutive_skips=2",
        fault="rl_nan@2:nan,rl_nan@4:nan,rl_nan@5:nan",
    )
    assert res.returncode != 0
    assert "halted at step 5: 2 consecutive steps" in res.stderr
    assert "rl.max_consecutive_skips=2" in res.stderr
    rl = {r["step"]: r for r in read_metrics(wd, "rl")}
    assert sorted(rl) == [1, 2, 3, 4, 5]
    ref1 = [r for r in _metrics(ref) if r["phase"] == "rl"][0]
    assert {k: v for k, v in rl[1].items() if not k.startswith(TIMING)} == ref1
    for s, skipped, run_len in ((1, 0, 0), (2, 2, 1), (3, 0, 0), (4, 2, 1), (5, 2, 2)):
        assert rl[s]["skipped_updates"] == skipped, s  # both minibatches of theta
        assert rl[s]["phi_skipped_updates"] == skipped, s  # and of phi
        assert rl[s]["consecutive_skipped_steps"] == run_len, s
        assert math.isnan(rl[s]["loss"]) == bool(skipped), s
    assert math.isfinite(rl[3]["grad_norm"])  # recovered (0 if a batch's rewards all tie)
    assert max(rl[1]["grad_norm"], rl[3]["grad_norm"]) > 0  # the unskipped steps move theta
    assert _steps(wd) == [1, 2, 3, 4]  # the halted step is not checkpointed
    for before, after in ((1, 2), (3, 4)):  # a skipped step leaves theta, phi, Adam alone
        a, b = _raw(wd, before), _raw(wd, after)
        for k in a:
            if k.startswith(("['params']", "['opt_state']", "['lora")):
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert all(np.isfinite(v).all() for v in b.values() if v.dtype.kind == "f")


@pytest.mark.slow
def test_phi_warm_start_is_not_repeated_after_a_kill(reference, tmp_path):
    """distill.warmup_steps=2, killed in RL step 1's rollout (after the warm start's step-0
    checkpoint): the restart resumes at step 0 without repeating the warm start and ends
    bitwise where an uninterrupted run ends (metrics, warm-start records, checkpoint)."""
    warm = ("--config.distill.warmup_steps=2", "--config.rl.num_steps=2")
    runs = {}
    for name in ("ref", "killed"):
        runs[name] = str(tmp_path / name)
        shutil.copytree(os.path.join(reference, "sft"), os.path.join(runs[name], "sft"))
    res = _train(runs["ref"], *warm)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _train(runs["killed"], *warm, fault="rl_rollout@1")
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    assert "[phi_warmup]" in res.stderr and _steps(runs["killed"]) == [0]
    res = _train(runs["killed"], *warm)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming after phi's warm start (2 steps): not repeated" in res.stdout
    assert "[phi_warmup]" not in res.stderr
    warmup = lambda w: [
        {k: v for k, v in r.items() if not k.startswith(TIMING)}
        for r in read_metrics(w, "phi_warmup")
    ]
    assert [r["step"] for r in warmup(runs["killed"])] == [1, 2]
    assert warmup(runs["killed"]) == warmup(runs["ref"])
    assert _metrics(runs["killed"]) == _metrics(runs["ref"])
    got, want = _raw(runs["killed"], 2), _raw(runs["ref"], 2)
    assert got.keys() == want.keys() and int(want["['phi_warmup_steps']"]) == 2
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow
def test_sft_resumes_exactly_after_kills(tmp_path):
    """Killed after SFT step 50 (last checkpoint at 40), then after SFT stopped and saved
    but before DONE.json: the warm start resumes and ends bitwise where an uninterrupted
    SFT ends (checkpoint leaves, DONE.json, every SFT metric), and RL continues alike."""
    args = ("--config.sft.eval_every=20", "--config.rl.num_steps=1")
    ref = str(tmp_path / "ref")
    res = _train(ref, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(ref, "sft", "DONE.json")) as f:
        done = json.load(f)
    final = done["step"]
    assert final > 50  # the first kill lands mid-training

    wd = str(tmp_path / "killed")
    for point in ("sft_step@50", f"sft_done@{final}"):
        res = _train(wd, *args, fault=point)
        assert res.returncode == -signal.SIGKILL, (point, res.returncode, res.stderr[-3000:])
        assert f"SIGKILL at {point}" in res.stdout
        assert not os.path.exists(os.path.join(wd, "sft", "DONE.json"))
    res = _train(wd, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"[sft] resuming from step {final}" in res.stdout  # re-evaluates, trains no more
    with open(os.path.join(wd, "sft", "DONE.json")) as f:
        assert json.load(f) == done
    sft_metrics = lambda w: [
        {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_metrics(w, "sft")
    ]
    assert sft_metrics(wd) == sft_metrics(ref)
    assert [r["step"] for r in read_metrics(wd, "sft")] == list(range(1, final + 1))
    got, want = _raw(wd, final, "sft"), _raw(ref, final, "sft")
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    assert _metrics(wd) == _metrics(ref)


# ---------------------------------------------------------------------- checkpoint units
def _tree(v=0.0):
    return {
        "params": {
            "w": jnp.arange(256, dtype=jnp.float32).reshape(16, 16) / 7 + v,
            "b": jnp.ones(16, jnp.bfloat16),
        },
        "opt_state": [jnp.zeros((), jnp.int32) + 3, jnp.full(8, float(v))],
        "rng": jax.random.key_data(jax.random.key(1)),
        "step": np.asarray(5, np.int64),
    }


def _assert_tree_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _saved(tmp_path, steps_=(1, 2, 3), keep=3):
    ck = checkpoints.Checkpointer(str(tmp_path), "ck", keep=keep)
    for s in steps_:
        ck.save(s, _tree(s))
    ck.close()
    return checkpoints.Checkpointer(str(tmp_path), "ck", keep=keep)


def test_keep_last_k_and_round_trip(tmp_path):
    ck = _saved(tmp_path, range(1, 6), keep=2)
    assert ck.all_steps() == [4, 5]
    step, tree = ck.restore_latest(_tree())
    assert step == 5
    _assert_tree_equal(tree, _tree(5))


def _truncate(d):
    files = [f for f in glob.glob(os.path.join(d, "**", "*"), recursive=True) if os.path.isfile(f)]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 3)


CORRUPTIONS = {
    "bit_flip": _flip_byte,
    "truncated_data": _truncate,
    "no_metadata": lambda d: os.remove(os.path.join(d, "default", "_METADATA")),
    "no_item": lambda d: shutil.rmtree(os.path.join(d, "default")),
    "garbage_manifest": lambda d: open(os.path.join(d, "default", "manifest.ocdbt"), "wb").write(
        b"\0garbage" * 8
    ),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_latest_checkpoint_falls_back(tmp_path, kind, capsys):
    ck = _saved(tmp_path)
    CORRUPTIONS[kind](os.path.join(ck.directory, "3"))
    step, tree = ck.restore_latest(_tree())
    assert step == 2
    _assert_tree_equal(tree, _tree(2))
    out = capsys.readouterr().out
    assert "checkpoint" in out and "/3 is corrupt" in out, out
    assert ck.all_steps() == [1, 2] and len(os.listdir(ck.quarantine)) == 1
    ck.save(3, _tree(30))  # the step can be written again
    ck.wait()
    _assert_tree_equal(ck.restore_latest(_tree())[1], _tree(30))
    ck.close()


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    ck = _saved(tmp_path, (1,))
    _flip_byte(os.path.join(ck.directory, "1"))
    with pytest.raises(checkpoints.CheckpointError, match="no usable checkpoint"):
        ck.restore_latest(_tree())
    ck.close()
    with pytest.raises(checkpoints.CheckpointError, match="Delete that directory"):
        checkpoints.Checkpointer(str(tmp_path), "ck").restore_latest(_tree())


def test_unfinished_write_is_not_a_checkpoint(tmp_path):
    ck = _saved(tmp_path, (1, 2))
    os.makedirs(os.path.join(ck.directory, "3.orbax-checkpoint-tmp", "default"))
    ck.close()
    ck = checkpoints.Checkpointer(str(tmp_path), "ck")
    assert ck.restore_latest(_tree())[0] == 2


def test_checkpoint_of_another_shape_is_incompatible_not_corrupt(tmp_path):
    ck = _saved(tmp_path, (1,))
    other = _tree()
    other["opt_state"].append(jnp.zeros(2))  # e.g. another optimizer or rollout mode
    with pytest.raises(checkpoints.IncompatibleCheckpoint):
        ck.restore_latest(other)
    assert ck.all_steps() == [1]  # left in place


def test_save_refuses_non_finite_values(tmp_path):
    ck = checkpoints.Checkpointer(str(tmp_path), "ck")
    bad = _tree()
    bad["opt_state"][1] = bad["opt_state"][1].at[3].set(jnp.inf)
    with pytest.raises(checkpoints.CheckpointError, match=r"\['opt_state'\]\[1\]"):
        ck.save(1, bad)
    ck.close()
    assert ck.all_steps() == []


def test_checkpoint_without_digest_still_restores(tmp_path):
    """Checkpoints written before the digest existed (and without optional keys)."""
    mgr = ocp.CheckpointManager(str(tmp_path / "ck"))
    mgr.save(4, args=ocp.args.StandardSave(_tree(4)))
    mgr.wait_until_finished()
    mgr.close()
    ck = checkpoints.Checkpointer(str(tmp_path), "ck")
    template = dict(_tree(), consecutive_skips=np.asarray(0))
    step, tree = ck.restore_latest(template, optional=("consecutive_skips",))
    assert step == 4 and "consecutive_skips" not in tree
    _assert_tree_equal(tree, _tree(4))


def test_digest_matches_on_host_and_device():
    tree = _tree(1.5)
    host = {k: np.asarray(v) for k, v in tree["params"].items()}
    assert np.array_equal(checkpoints.digest(tree["params"])[0], checkpoints.digest(host)[0])
    moved = dict(
        tree, params={"w": tree["params"]["w"].at[0, 0].add(1e-3), "b": tree["params"]["b"]}
    )
    assert not np.array_equal(checkpoints.digest(tree)[0], checkpoints.digest(moved)[0])


# ------------------------------------------------------------------------ non-finite guards
@pytest.mark.parametrize("what", ["loss", "grad"])
def test_non_finite_update_is_skipped(what):
    tx = optax.adam(0.1)
    params = {"w": jnp.ones(3)}
    opt = tx.init(params)
    grads = {"w": jnp.array([1.0, jnp.nan if what == "grad" else 2.0, 3.0])}
    loss = jnp.float32(jnp.nan if what == "loss" else 1.0)
    new, new_opt, gnorm, finite = steps.apply_update(tx, params, opt, grads, loss=loss)
    assert not bool(finite)
    _assert_tree_equal(new, params)
    _assert_tree_equal(new_opt, opt)
    new, _, _, finite = steps.apply_update(
        tx, params, opt, {"w": jnp.ones(3)}, loss=jnp.float32(1.0)
    )
    assert bool(finite) and not np.array_equal(new["w"], params["w"])


# ---------------------------------------------------------------------- workdir, metrics
def test_unusable_workdir_is_reported_clearly(tmp_path):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(UserError, match="cannot create workdir .*file/run"):
        run.prepare_workdir(str(afile / "run"))
    with pytest.raises(UserError, match="--workdir: empty"):
        run.prepare_workdir("")
    wd = tmp_path / "wd"
    os.makedirs(wd / "checkpoints")
    run.prepare_workdir(str(wd))
    if os.geteuid() == 0:
        pytest.skip("root ignores permission bits: the unreadable cases need a normal user")
    os.chmod(wd / "checkpoints", 0o000)
    try:
        with pytest.raises(UserError, match="checkpoints.* not readable and writable"):
            run.prepare_workdir(str(wd))
    finally:
        os.chmod(wd / "checkpoints", 0o755)
    os.chmod(wd, 0o500)
    try:
        with pytest.raises(UserError, match="not readable and writable"):
            run.prepare_workdir(str(wd))
    finally:
        os.chmod(wd, 0o755)


def test_metrics_line_cut_short_by_a_kill_is_dropped(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for s in (1, 2, 3):
        w.write("rl", s, {"loss": float(s)})
    with open(w.path, "a") as f:
        f.write('{"phase": "rl", "step": 4, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]
    w.drop_after("rl", 2)
    w.write("rl", 3, {"loss": 3.5})
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.5),
    ]
    assert not os.path.exists(w.path + ".tmp")


def test_faults_are_inert_unless_set(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.action("rl_rollout", 2) is None
    faults.maybe_kill("rl_rollout", 2)  # returns
    monkeypatch.setenv(faults.ENV, "rl_rollout@2,rl_nan@3:nan")
    assert faults.action("rl_rollout", 2) == "kill"
    assert faults.action("rl_nan", 3) == "nan" and faults.action("rl_nan", 2) is None


# ------------------------------------------------------------------------------- rewards
PATHOLOGICAL = [
    "",
    "\n",
    "answer:",
    "answer: ",
    "answer:\n5",
    "answer: 5\nanswer: 6",
    "xanswer: 5",
    "answer: ５",
    "answer: ٣",
    "answer: 1e3",
    "answer: -5",
    "answer: " + "9" * 33,
    "answer: " + "9" * 32,
    "answer:\t5",
    "answer: 5\r\n",
    "\x00answer: 5",
    "\ud800",
    "answer: 5\ud800",
    "answer: " * 10_000,
    "\n" * 100_000 + "answer: 7",
    "a" * 1_000_000,
    "🙂" * 1000 + "\nanswer: 3",
]


@pytest.mark.parametrize("text", PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_reward_on_pathological_completions(text):
    t = time.time()
    got = graders.extract_answer(text)
    assert got is None or (got.isascii() and got.isdigit() and 1 <= len(got) <= 32)
    assert graders.chain_reward(text, "5", 0.25) in (0.0, 0.25, 1.0)
    assert time.time() - t < 1.0  # no catastrophic regex backtracking


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=300),
    answer=st.one_of(st.text(max_size=5), st.integers(), st.just("5")),
    fr=st.floats(0, 0.99),
)
def test_rewards_never_raise_on_arbitrary_text(text, answer, fr):
    for completion in (text, "answer: 5\n" + text, text + "\nanswer: 5", text + "answer: 5"):
        r = graders.chain_reward(completion, answer, fr)
        assert r in (0.0, fr, 1.0)
        got = graders.extract_answer(completion)
        assert got is None or (got.isascii() and got.isdigit() and got in completion)
    assert graders.chain_reward("answer: 5\n" + text, "5", fr) == 1.0
    out = graders.batch_rewards([text, text + "\nanswer: 5"], [answer, "5"], fr)
    assert out.dtype == np.float32 and out.shape == (2,) and np.isfinite(out).all()


@pytest.mark.parametrize("completion", [None, b"answer: 5", 5, ["answer: 5"]])
def test_reward_of_a_non_string_completion_is_zero(completion):
    assert graders.chain_reward(completion, "5") == 0.0
