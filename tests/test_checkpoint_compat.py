"""RL checkpoints written by earlier code still resume. tests/data/rl_checkpoints_b45c56e
holds run directories written at commit b45c56e (make.py there): phi with the quality
head, the draft head, the history bank. Each resumes through the run's own path (its
config.json, make_setup, init_state, the resume), every trainable read from its old keys
into the right place; trained.load (evaluate.py, export.py) reads them too (at b45c56e it
refused the history run's checkpoint: its template lacked the bank)."""

import os
import shutil

import jax
import numpy as np
import pytest

from dsparse_jax.reliability import checkpoints
from dsparse_jax.train import context, rl_loop, rl_state, trainables, trained
from tests.data.rl_checkpoints_b45c56e.make import BASE, CASES, STEP

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "rl_checkpoints_b45c56e")


def _check_marked(tree, base: float, what: str):
    """make.marked's values: float leaf i = base + 0.001 * i, integer leaves 3."""
    for i, x in enumerate(jax.tree.leaves(tree)):
        x = np.asarray(x)
        want = base + 0.001 * i if np.issubdtype(x.dtype, np.floating) else 3
        np.testing.assert_array_equal(x, np.full(x.shape, want, x.dtype), err_msg=f"{what} {i}")


# checkpoint key of b45c56e -> (TrainState field, part): where each must be read into
# (written out here rather than read from trainables.TRAINABLES: a renamed key must fail)
WHERE = {
    "params": ("theta", "params"),
    "opt_state": ("theta", "opt_state"),
    "lora": ("phi", "params"),
    "lora_opt_state": ("phi", "opt_state"),
    "quality_head": ("quality_head", "params"),
    "quality_head_opt_state": ("quality_head", "opt_state"),
    "draft_head": ("draft_head", "params"),
    "draft_head_opt_state": ("draft_head", "opt_state"),
}


def _entries(st) -> dict:
    """checkpoint key -> the restored tree it must fill (the entries this run has)."""
    out = {}
    for key, (name, part) in WHERE.items():
        if getattr(st, name) is not None:
            out[key] = getattr(getattr(st, name), part)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_checkpoint_of_b45c56e_resumes(case, tmp_path):
    workdir = str(tmp_path / case)
    shutil.copytree(os.path.join(FIXTURES, case), workdir)
    config = trained.workdir_config(workdir)
    ctx = context.build(config)
    setup = rl_state.make_setup(ctx)
    fresh = trainables.init_state(ctx, setup, ctx.init_params)
    ckpt = checkpoints.Checkpointer(workdir, "checkpoints")
    st, rng, step, skips, warmed = rl_loop._resume(
        ckpt, fresh, jax.random.key(0), case, config.rl.prompts_per_step
    )
    ckpt.close()
    assert (step, skips, warmed) == (STEP, 1, config.distill.warmup_steps)
    np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(jax.random.key(5)))
    present = _entries(st)
    want = {"params", "opt_state"} | {
        "distillsparse_prune": {"lora", "lora_opt_state", "quality_head", "quality_head_opt_state"},
        "speculative_draft_head": {"draft_head", "draft_head_opt_state"},
        "speculative_history": set(),
    }[case]
    assert set(present) == want
    for key, tree in present.items():
        _check_marked(tree, BASE[key], key)
    if case == "speculative_history":
        bank = st.history.state()
        assert bank["owned"][:2].all() and bank["keys"][:2].tolist() == [11, 12]
        assert int(bank["clock"]) == 2 and (bank["lengths"] == 5).all()
    t = trained.load(ctx, workdir)  # the evaluator's and the exporter's read too
    assert t.source == f"rl step {STEP}"
    _check_marked(t.params, BASE["params"], "trained params")
    for tree, key in ((t.lora, "lora"), (t.head, "quality_head"), (t.draft_head, "draft_head")):
        if tree is not None:
            _check_marked(tree, BASE[key], "trained " + key)
    ctx.rewarder.close()


@pytest.mark.slow
def test_optional_entries_a_checkpoint_lacks_load_as_initialised(tmp_path):
    """A checkpoint written before an optional trainable existed (here: without the quality
    head, as if rl.prune were newly enabled) resumes; that entry starts as initialised."""
    case = "distillsparse_prune"
    config = trained.workdir_config(os.path.join(FIXTURES, case))
    ctx = context.build(config)
    setup = rl_state.make_setup(ctx)
    st = trainables.init_state(ctx, setup, ctx.init_params)
    st.phi = st.phi.replace(jax.tree.map(lambda x: x + 0.5, st.lora), st.phi.opt_state)
    position = rl_loop.RL_DATA_OFFSET + STEP * config.rl.prompts_per_step
    tree = rl_loop._saveable(st, jax.random.key(5), STEP, position)
    for key in ("quality_head", "quality_head_opt_state", "consecutive_skips"):
        del tree[key]
    ckpt = checkpoints.Checkpointer(str(tmp_path), "checkpoints")
    ckpt.save(STEP, tree, force=True)
    ckpt.wait()
    fresh = trainables.init_state(ctx, setup, ctx.init_params)
    head0 = [np.asarray(x) for x in jax.tree.leaves(fresh.quality_head)]
    got, _, step, skips, _ = rl_loop._resume(ckpt, fresh, jax.random.key(0), case, 2)
    ckpt.close()
    assert (step, skips) == (STEP, 0)
    for a, b in zip(jax.tree.leaves(got.quality_head), head0):
        np.testing.assert_array_equal(np.asarray(a), b)
    for a, b in zip(jax.tree.leaves(got.phi), jax.tree.leaves(st.phi)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ctx.rewarder.close()
