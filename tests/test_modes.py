"""Every rollout mode runs two RL steps in process (tiny model, real sparsity, shared
compiles), and the step's data path is what the mode says: the actor's twin reproduces
the rollout log-probs on the kept rows, the oversampling filter keeps n of M, phi moves
only in distillsparse, checkpoints round-trip phi."""

import copy
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.config.validate import ConfigError, load_config, validate
from dsparse_jax.data import rewards
from dsparse_jax.train import context, phases, rl_loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_config():
    c = load_config(os.path.join(ROOT, "configs", "gemma_math.py"))
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 2, 64
    c.task.num_vars, c.task.num_terms = 4, 2
    c.attention.page_size = 8  # 72-token buffer = 9 pages; budget 3 pages: really sparse
    c.sparse.budget, c.sparse.dense_layers = 3, 1  # layer 1 (global) is sparse
    c.rl.prompts_per_step, c.rl.samples_per_prompt, c.rl.minibatches = 2, 2, 2
    c.rl.num_steps = 2
    c.rl.warmup_steps = c.lora.warmup_steps = 0
    c.lora.rank = 4
    c.eval.num_problems = 2
    return c


@pytest.fixture(scope="module")
def ctx():
    c = base_config()
    validate(c)
    return context.build(c)


def _with(ctx, **rl):
    c = copy.deepcopy(ctx.config)
    for k, v in rl.items():
        *sections, field = k.split("__")
        section = c
        for part in sections:
            section = section[part]
        section[field] = v
    validate(c)
    return context.RunContext(**{**ctx.__dict__, "config": c})


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def fake_score(tok, rollout, problems, rewarder=None, where=""):
    """A dense reward an untrained model can earn: the fraction of odd completion tokens
    (the task's exact-match reward is 0 for every random completion: no gradient)."""
    odd = np.asarray((rollout.tokens % 2) * rollout.completion_mask).sum(1)
    r = odd / np.maximum(np.asarray(rollout.completion_mask).sum(1), 1)
    texts = ["<completion>"] * len(r)
    return rewards.Scored(r, np.zeros(len(r), bool), {"reward_errors": 0}), texts


# Options are spread so that compiles are shared: grpo_update compiles twice only (none
# and mis keep the dense batch structure, sparse_train has its own trainer spec and carries
# the TIS weights); sparse and sparse_train share the sampler (M = 3).
CASES = [
    ("dense", dict(rl__rollout_mode="dense")),
    ("sparse", dict(rl__rollout_mode="sparse", rl__is_correction="mis", rl__samples_generated=3)),
    (
        "sparse_train",
        dict(
            rl__rollout_mode="sparse_train",
            rl__is_correction="tis",
            rl__samples_generated=3,
            rl__selection="acceptance",
        ),
    ),
    ("distillsparse", dict(rl__rollout_mode="distillsparse", rl__samples_generated=3)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_mode_runs_two_steps(ctx, name, overrides, monkeypatch):
    monkeypatch.setattr(phases, "grade", fake_score)
    run = _with(ctx, **overrides)
    setup = rl_loop.make_setup(run)
    st = rl_loop.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    lora0 = _leaves(st.lora) if st.lora is not None else None
    theta0 = _leaves(st.params)
    rng = jax.random.key(0)
    for step in range(2):
        rng, k = jax.random.split(rng)
        st, m = rl_loop.rl_step(run, setup, st, k, step)
        for key in (
            "reward",
            "loss",
            "grad_norm",
            "time_rollout",
            "time_score",
            "time_select",
            "time_recompute",
            "time_update_theta",
            "kl_k3",
            "log_ratio_mean_abs",
            "tis_clip_frac",
            "mis_masked_frac",
        ):
            assert key in m and math.isfinite(m[key]), (key, m.get(key))
        assert m["skipped_updates"] == 0
    assert any((a != b).any() for a, b in zip(theta0, _leaves(st.params)))  # theta trained
    if name == "dense":
        assert "alpha_mean" not in m and st.lora is None
        assert m["log_ratio_max_abs"] < 1e-3  # sampler vs teacher-forced dense: numerics
        return
    # Sparse actor: the trainer-side twin reproduces the rollout's log-probs, and the
    # sparse policy really differs from the dense one.
    assert m["twin_mu_max_abs"] < 1e-3, m["twin_mu_max_abs"]
    assert m["kl_exact"] > 1e-6 and 0 < m["alpha_mean"] < 1
    for key in (
        "alpha_p5",
        "kl_exact_fwd",
        "alpha_p5_bin0",
        "alpha_mean_bin0",
        "kl_exact_bin0",
        "seq_log_ratio_mean",
    ):
        assert math.isfinite(m[key]), key
    if name in ("sparse", "distillsparse"):
        assert m["reward_kept"] >= m["reward"]  # top-n of M by reward
    if name == "sparse_train":  # top-n of M by acceptance rate
        assert m["acceptance_frac_kept"] >= m["acceptance_frac_generated"]
    if name == "distillsparse":
        for key in ("phi_loss", "phi_grad_norm", "phi_distill_kl", "time_update_phi"):
            assert math.isfinite(m[key]), key
        assert m["phi_skipped_updates"] == 0
        assert any((a != b).any() for a, b in zip(lora0, _leaves(st.lora)))  # phi trained
    else:
        assert st.lora is None and "phi_loss" not in m and "time_update_phi" not in m


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["sparse_self", "history", "draft_head"])
def test_speculative_mode_runs_two_steps(ctx, draft, monkeypatch, tmp_path):
    """rollout_mode=speculative: the rollout is the dense policy's (its log-probs equal the
    teacher-forced dense ones, so theta's first ratio is 1), acceptance metrics are
    reported, phi trains with sparse_self, the history bank fills across steps and
    round-trips through the checkpoint, the draft head trains after theta (its loss
    falls) and its warm start runs on SFT solutions, and a resume restores it and its
    optimizer bitwise."""
    from dsparse_jax.reliability import checkpoints

    monkeypatch.setattr(phases, "grade", fake_score)
    run = _with(
        ctx,
        rl__rollout_mode="speculative",
        rl__draft=draft,
        rl__draft_tokens=3,
        rl__draft_head__unroll=3,  # <= draft_tokens; trains the head on its own unroll
        rl__samples_generated=3,
    )
    # A finite training set of the step's two prompts: they recur at step 2.
    run = context.RunContext(
        **{**run.__dict__, "task": dataclasses.replace(run.task, train_size=2)}
    )
    setup = rl_loop.make_setup(run)
    st = rl_loop.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    lora0 = _leaves(st.lora) if st.lora is not None else None
    rng = jax.random.key(0)
    for step in range(2):
        rng, k = jax.random.split(rng)
        st, m = rl_loop.rl_step(run, setup, st, k, step)
        assert m["skipped_updates"] == 0
        assert m["mu_dense_max_abs"] < 1e-3  # exact dense rollout: numerics only
        assert m["spec_accept_length"] >= 1.0 and math.isfinite(m["spec_accept_rate_1"])
    if draft == "sparse_self":
        assert math.isfinite(m["phi_loss"]) and math.isfinite(m["kl_exact"])
        assert any((a != b).any() for a, b in zip(lora0, _leaves(st.lora)))  # phi trained
        return
    if draft == "draft_head":
        _check_draft_head(run, setup, st, m, rng, tmp_path)
        return
    assert st.lora is None and "phi_loss" not in m
    bank = setup.history
    assert bank.owned.sum() == 2 and (np.asarray(bank.lengths) > 0).sum() == 2 * 2 * 3
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    position = rl_loop.RL_DATA_OFFSET + 2 * 2
    ckpt.save(2, rl_loop._saveable(st, rng, 2, position, bank=bank), force=True)
    ckpt.wait()
    fresh = rl_loop.make_setup(run).history
    found = rl_loop._resume(ckpt, st, rng, "speculative", 2, fresh)
    ckpt.close()
    assert found[2] == 2
    for name, value in bank.state().items():
        np.testing.assert_array_equal(value, fresh.state()[name], err_msg=name)


def _check_draft_head(run, setup, st, m, rng, tmp_path):
    from dsparse_jax.reliability import checkpoints
    from dsparse_jax.report.metrics import MetricsWriter

    assert st.lora is None and "phi_loss" not in m
    assert m["draft_head_loss_after"] < m["draft_head_loss"] and m["time_update_draft_head"] > 0
    fresh = rl_loop.init_state(run, setup, run.init_params)
    assert any((a != b).any() for a, b in zip(_leaves(fresh.draft_head), _leaves(st.draft_head)))
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    ckpt.save(2, rl_loop._saveable(st, rng, 2, rl_loop.RL_DATA_OFFSET + 4), force=True)
    ckpt.wait()
    got = rl_loop._resume(ckpt, fresh, rng, "speculative", 2)[0]
    ckpt.close()
    for name in ("draft_head", "draft_head_opt_state"):
        assert jax.tree.structure(getattr(got, name)) == jax.tree.structure(getattr(st, name))
        for a, b in zip(_leaves(getattr(got, name)), _leaves(getattr(st, name))):
            np.testing.assert_array_equal(a, b, err_msg=name)
    warm = dataclasses.replace(
        setup, draft_head=dataclasses.replace(setup.draft_head, warmup_steps=3)
    )
    os.makedirs(tmp_path / "m", exist_ok=True)
    writer = MetricsWriter(str(tmp_path / "m"), tensorboard=False)
    st = rl_loop.warm_start_draft_head(run, warm, fresh, writer)
    writer.close()
    assert any((a != b).any() for a, b in zip(_leaves(got.draft_head), _leaves(st.draft_head)))


@pytest.mark.slow
def test_distillsparse_checkpoint_round_trips_phi(ctx, tmp_path):
    from dsparse_jax.reliability import checkpoints

    run = _with(ctx, rl__rollout_mode="distillsparse")
    setup = rl_loop.make_setup(run)
    st = rl_loop.init_state(run, setup, run.init_params)
    st.lora = jax.tree.map(lambda x: x + 0.5, st.lora)  # B no longer zero
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    ckpt.save(3, rl_loop._saveable(st, jax.random.key(5), 3, 7), force=True)
    ckpt.wait()
    fresh = rl_loop.init_state(run, setup, run.init_params)
    got, rng, step = rl_loop._restore(ckpt, 3, fresh, jax.random.key(0))
    ckpt.close()
    assert step == 3
    assert jax.tree.structure(got.lora) == jax.tree.structure(st.lora)
    for a, b in zip(_leaves(got.lora), _leaves(st.lora)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(got.lora_opt_state) == jax.tree.structure(st.lora_opt_state)


@pytest.mark.parametrize(
    "field,value",
    [
        ("rl.rollout_mode", "sparsest"),
        ("rl.samples_generated", 1),
        ("rl.is_correction", "ppo"),
        ("rl.selection", "best"),
        ("distill.kl", "k4"),
        ("distill.teacher", "stale"),
        ("lora.targets", "q,qq"),
        ("sparse.budget", 2),
        ("lora.rank", 0),
        ("rl.draft", "oracle"),
        ("rl.draft_tokens", 0),
        ("rl.draft_head.layers", "1,7"),
        ("rl.draft_head.steps", 0),
    ],
)
def test_mode_config_validation(field, value):
    c = base_config()
    *sections, name = field.split(".")
    section = c
    for part in sections:
        section = section[part]
    section[name] = value
    if field.startswith("rl.draft"):
        c.rl.rollout_mode = "speculative"
    if field.startswith("rl.draft_head"):
        c.rl.draft = "draft_head"
    with pytest.raises(ConfigError, match=f"config.{field}"):
        validate(c)
