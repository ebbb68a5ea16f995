"""Every rollout mode runs two RL steps in process (tiny model, real sparsity, shared
compiles), and the step's data path is what the mode says: the actor's twin reproduces
the rollout log-probs on the kept rows, the oversampling filter keeps n of M, phi moves
only in distillsparse, checkpoints round-trip phi."""

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dsparse_jax.config.validate import ConfigError, load_config, validate
from dsparse_jax.data.rewards.rewarder import Scored
from dsparse_jax.rl import modes
from dsparse_jax.train import context, phases, rl_loop, rl_state, trainables
from tests.model_utils import configured

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


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def optimizer_steps_taken(opt_state) -> int:
    """The optimizer steps behind an optimizer state: its Adam count."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    (adam,) = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    return int(adam.count)


def steps_per_rl_step(run, trainable: str) -> int:
    """The optimizer steps `trainable` takes per RL step, as its schedule counts them."""
    return rl_state.optimizer_steps_per_rl_step(run.config.rl)[trainable]


def fake_score(tok, rollout, problems, rewarder=None, where=""):
    """A dense reward an untrained model can earn: the fraction of odd completion tokens
    (the task's exact-match reward is 0 for every random completion: no gradient)."""
    odd = np.asarray((rollout.tokens % 2) * rollout.completion_mask).sum(1)
    r = odd / np.maximum(np.asarray(rollout.completion_mask).sum(1), 1)
    texts = ["<completion>"] * len(r)
    return Scored(r, np.zeros(len(r), bool), {"reward_errors": 0}), texts


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
            metrics__twin_every=0,  # ignored: the sparse trainer's old log-probs are the twin's
        ),
    ),
    (
        "distillsparse",
        dict(rl__rollout_mode="distillsparse", rl__samples_generated=3, metrics__twin_every=0),
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,overrides", CASES, ids=[c[0] for c in CASES])
def test_mode_runs_two_steps(ctx, name, overrides, monkeypatch):
    monkeypatch.setattr(phases, "grade", fake_score)
    run = configured(ctx, **overrides)
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    lora0 = _leaves(st.lora) if st.lora is not None else None
    theta0 = _leaves(st.theta.params)
    rng = jax.random.key(0)
    for step in range(2):
        rng, k = jax.random.split(rng)
        st, m = phases.rl_step(run, setup, st, k, step)
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
    assert any((a != b).any() for a, b in zip(theta0, _leaves(st.theta.params)))  # theta trained
    assert optimizer_steps_taken(st.theta.opt_state) == 2 * steps_per_rl_step(run, "theta")
    # Figures over all generated rows: a copy with M = n, M = 3 rows otherwise.
    assert math.isfinite(m["all_kl_k3"]) and math.isfinite(m["all_mu_dense_max_abs"])
    if name == "dense":
        assert m["all_kl_k3"] == m["kl_k3"]
        assert "alpha_mean" not in m and st.lora is None
        assert m["log_ratio_max_abs"] < 1e-3  # sampler vs teacher-forced dense: numerics
        return
    # Sparse actor: the trainer-side twin reproduces the rollout's log-probs, and the
    # sparse policy really differs from the dense one.
    assert m["twin_mu_max_abs"] < 1e-3, m["twin_mu_max_abs"]
    assert m["kl_exact"] > 1e-6 and 0 < m["alpha_mean"] < 1
    assert m["all_kl_exact"] > 1e-6 and m["all_kl_exact"] != m["kl_exact"]  # M = 3 > n rows
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
        for key in ("phi_loss", "phi_grad_norm", "phi_distill_kl_reverse_k3", "time_update_phi"):
            assert math.isfinite(m[key]), key
        assert m["phi_skipped_updates"] == 0
        assert any((a != b).any() for a, b in zip(lora0, _leaves(st.lora)))  # phi trained
        assert optimizer_steps_taken(st.phi.opt_state) == 2 * steps_per_rl_step(run, "phi")
    else:
        assert st.lora is None and "phi_loss" not in m and "time_update_phi" not in m


TWIN_ONLY = ("kl_exact", "alpha_mean", "alpha_p5_bin0", "twin_mu_max_abs")  # from the twin


@pytest.mark.slow
def test_twin_every_skips_a_metrics_only_twin(ctx, monkeypatch):
    """metrics.twin_every=2 in the sparse mode (the twin serves the figures alone): the
    twin's figures on step 0 (kept and all M rows), none on step 1, where acceptance
    selection and theta's update still run on the dense recompute. The modes that need the
    twin ignore the setting (the table; sparse_train and distillsparse recompute it)."""
    monkeypatch.setattr(phases, "grade", fake_score)
    run = configured(
        ctx,
        rl__rollout_mode="sparse",
        rl__is_correction="mis",
        rl__samples_generated=3,
        rl__selection="acceptance",
        metrics__twin_every=2,
    )
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    rng, got = jax.random.key(0), []
    for step in range(2):
        rng, k = jax.random.split(rng)
        st, m = phases.rl_step(run, setup, st, k, step)
        got.append(m)
    for key in TWIN_ONLY:
        assert math.isfinite(got[0][key]) and math.isfinite(got[0]["all_" + key]), key
        assert key not in got[1] and "all_" + key not in got[1], key
    for m in got:  # the dense recompute and what reads it ran on both steps
        for key in ("kl_k3", "mu_dense_max_abs", "acceptance_frac_kept", "loss", "all_kl_k3"):
            assert math.isfinite(m[key]), key
        assert m["skipped_updates"] == 0
    never = dataclasses.replace(setup.recompute, twin_every=0)
    needs = {"sparse": False, "sparse_train": True, "distillsparse": True, "speculative": True}
    for mode, needed in needs.items():
        s = dataclasses.replace(setup, mode=modes.get(mode))
        s_never = dataclasses.replace(s, recompute=never)
        assert [phases.twin_step(s_never, i) for i in range(3)] == [needed] * 3, mode
        assert phases.twin_step(s, 0) and phases.twin_step(s, 1) == needed, mode


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["sparse_self", "history", "history_tree", "draft_head"])
def test_speculative_mode_runs_two_steps(ctx, draft, monkeypatch, tmp_path):
    """rollout_mode=speculative: the rollout is the dense policy's (its log-probs equal the
    teacher-forced dense ones, so theta's first ratio is 1), acceptance metrics are
    reported, phi trains with sparse_self, the history bank (its latest-match and tree
    drafts) fills across steps and round-trips through the checkpoint, the draft head trains after theta (its loss
    falls) and its warm start runs on SFT solutions, and a resume restores it and its
    optimizer bitwise."""
    from dsparse_jax.reliability import checkpoints

    monkeypatch.setattr(phases, "grade", fake_score)
    history_draft = "tree" if draft == "history_tree" else "latest"
    draft = "history" if draft == "history_tree" else draft
    run = configured(
        ctx,
        rl__rollout_mode="speculative",
        rl__draft=draft,
        rl__history_draft=history_draft,
        rl__draft_tokens=3,
        rl__draft_head__unroll=3,  # trains the head on its own unroll
        rl__samples_generated=3,
    )
    # A finite training set of the step's two prompts: they recur at step 2.
    run = context.RunContext(
        **{**run.__dict__, "task": dataclasses.replace(run.task, train_size=2)}
    )
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    lora0 = _leaves(st.lora) if st.lora is not None else None
    rng = jax.random.key(0)
    for step in range(2):
        rng, k = jax.random.split(rng)
        st, m = phases.rl_step(run, setup, st, k, step)
        assert m["skipped_updates"] == 0
        assert m["mu_dense_max_abs"] < 1e-3  # exact dense rollout: numerics only
        assert m["spec_accept_length"] >= 1.0 and math.isfinite(m["spec_accept_rate_1"])
    if draft == "sparse_self":
        assert math.isfinite(m["phi_loss"]) and math.isfinite(m["kl_exact"])
        assert any((a != b).any() for a, b in zip(lora0, _leaves(st.lora)))  # phi trained
        _check_phi_warm_start(run, setup, st, tmp_path)
        return
    if draft == "draft_head":
        _check_draft_head(run, setup, st, m, rng, tmp_path)
        return
    assert st.lora is None and "phi_loss" not in m
    bank = st.history
    assert bank.owned.sum() == 2 and (np.asarray(bank.lengths) > 0).sum() == 2 * 2 * 3
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    position = rl_loop.RL_DATA_OFFSET + 2 * 2
    ckpt.save(2, rl_loop._saveable(st, rng, 2, position), force=True)
    ckpt.wait()
    fresh = trainables.init_state(run, setup, run.init_params)
    assert not fresh.history.owned.any()
    found = rl_loop._resume(ckpt, fresh, rng, "speculative", 2)
    ckpt.close()
    assert found[2] == 2
    for name, value in bank.state().items():
        np.testing.assert_array_equal(value, found[0].history.state()[name], err_msg=name)


def _check_phi_warm_start(run, setup, st, tmp_path):
    """phi's warm start in speculative sparse_self: the speculative rollout with its draft
    record (the twin is the drafter), the mode's divergence (tv) to theta, which it leaves
    bitwise unchanged; logged with the drafter's figures."""
    from dsparse_jax.report.metrics import MetricsWriter, read_metrics

    run = configured(run, distill__warmup_steps=1)
    theta, lora = _leaves(st.theta.params), _leaves(st.lora)
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    st = rl_loop.warm_start_phi(run, setup, st, writer)
    writer.close()
    for a, b in zip(theta, _leaves(st.theta.params)):
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(lora, _leaves(st.lora)))
    (x,) = read_metrics(str(tmp_path), "phi_warmup")
    for key in ("phi_distill_tv", "twin_accept_rate_1", "spec_accept_rate_1", "kl_exact"):
        assert math.isfinite(x[key]), key
    assert x["twin_draft_max_abs"] < 1e-3 and x["mu_dense_max_abs"] < 1e-3


def _check_draft_head(run, setup, st, m, rng, tmp_path):
    from dsparse_jax.reliability import checkpoints
    from dsparse_jax.report.metrics import MetricsWriter

    assert st.lora is None and "phi_loss" not in m
    assert m["draft_head_loss_after"] < m["draft_head_loss"] and m["time_update_draft_head"] > 0
    want = 2 * steps_per_rl_step(run, "draft_head")  # after two RL steps
    assert optimizer_steps_taken(st.draft_head.opt_state) == want
    fresh = trainables.init_state(run, setup, run.init_params)
    assert any(
        (a != b).any()
        for a, b in zip(_leaves(fresh.draft_head.params), _leaves(st.draft_head.params))
    )
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    ckpt.save(2, rl_loop._saveable(st, rng, 2, rl_loop.RL_DATA_OFFSET + 4), force=True)
    ckpt.wait()
    got = rl_loop._resume(ckpt, fresh, rng, "speculative", 2)[0]
    ckpt.close()
    for name in ("params", "opt_state"):
        want_tree, got_tree = getattr(st.draft_head, name), getattr(got.draft_head, name)
        assert jax.tree.structure(got_tree) == jax.tree.structure(want_tree)
        for a, b in zip(_leaves(got_tree), _leaves(want_tree)):
            np.testing.assert_array_equal(a, b, err_msg=name)
    head = dataclasses.replace(setup.drafting.head, warmup_steps=3)
    warm = dataclasses.replace(setup, drafting=dataclasses.replace(setup.drafting, head=head))
    os.makedirs(tmp_path / "m", exist_ok=True)
    writer = MetricsWriter(str(tmp_path / "m"), tensorboard=False)
    st = rl_loop.warm_start_draft_head(run, warm, fresh, writer)
    writer.close()
    assert any(
        (a != b).any()
        for a, b in zip(_leaves(got.draft_head.params), _leaves(st.draft_head.params))
    )


@pytest.mark.slow
def test_distillsparse_checkpoint_round_trips_phi(ctx, tmp_path):
    from dsparse_jax.reliability import checkpoints

    run = configured(ctx, rl__rollout_mode="distillsparse")
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, run.init_params)
    st.phi = st.phi.replace(jax.tree.map(lambda x: x + 0.5, st.lora), st.phi.opt_state)  # B != 0
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    ckpt.save(3, rl_loop._saveable(st, jax.random.key(5), 3, 7), force=True)
    ckpt.wait()
    fresh = trainables.init_state(run, setup, run.init_params)
    got, rng, step = rl_loop._restore(ckpt, 3, fresh, jax.random.key(0))
    old = rl_loop._saveable(st, jax.random.key(5), 4, rl_loop.RL_DATA_OFFSET + 4 * 2)
    del old["phi_warmup_steps"]  # written before phi's warm start was marked: loadable
    ckpt.save(4, old, force=True)
    ckpt.wait()
    assert rl_loop._resume(ckpt, fresh, jax.random.key(0), "distillsparse", 2)[2:] == (4, 0, 0)
    ckpt.close()
    assert step == 3
    assert jax.tree.structure(got.lora) == jax.tree.structure(st.lora)
    for a, b in zip(_leaves(got.lora), _leaves(st.lora)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(got.phi.opt_state) == jax.tree.structure(st.phi.opt_state)


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
        ("metrics.twin_every", -1),
        ("distill.warmup_steps", -1),
        ("distill.row_stride", 0),
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


# ------------------------------------------------------------------------ phi's warm start
class Killed(Exception):
    """Stands for a kill right after phi's warm start and its checkpoint."""


def _twin_kl(run, setup, st, lora, r) -> float:
    """Exact KL(twin || dense) per token of rollout `r` with phi = `lora`."""
    rec = phases._recompute(run, setup, dataclasses.replace(st, phi=st.phi.replace(lora, None)), r)
    return float(rec["metrics"]["kl_exact"])


def _spy(monkeypatch, module, name: str) -> list:
    """Records the arguments of every call of module.name (then calls it)."""
    calls, real = [], getattr(module, name)

    def spy(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.slow
def test_phi_warm_start_rolls_out_n_per_prompt_with_oversampling(ctx):
    """phi's warm start samples n per prompt even when RL oversamples (M > n): its setup's
    SamplingConfig, which the rollout phase reads, says n."""
    run = configured(
        ctx, rl__rollout_mode="distillsparse", rl__samples_generated=3, distill__warmup_steps=1
    )
    setup = rl_state.make_setup(run)
    assert setup.m == setup.sampling.samples_per_prompt == 3 > setup.n
    warm = rl_state.phi_warmup_setup(setup)
    assert warm.m == warm.sampling.samples_per_prompt == setup.n
    assert warm.sampling == dataclasses.replace(setup.sampling, samples_per_prompt=setup.n)


def test_phi_warm_start_moves_phi_only_and_a_resume_does_not_repeat_it(ctx, monkeypatch, tmp_path):
    """distill.warmup_steps=3 before RL step 1: theta bitwise unchanged, phi moved, the
    twin's exact KL to dense lower on a fixed rollout, three phi_warmup records; a run
    killed after the warm start's checkpoint resumes at step 0 without repeating it."""
    from dsparse_jax.reliability import checkpoints
    from dsparse_jax.report.metrics import MetricsWriter, read_metrics

    monkeypatch.setattr(phases, "grade", fake_score)
    run = configured(
        ctx,
        rl__rollout_mode="distillsparse",
        rl__num_steps=1,
        distill__warmup_steps=3,
        eval__mean_at_k=0,
        eval__sparse=False,
        log__tensorboard=False,
    )
    setup = rl_state.make_setup(run)
    st0 = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    r = phases.rollout(run, setup, st0, jax.random.key(9), 0)[0].rollout  # RL step 1's prompts
    kl_before = _twin_kl(run, setup, st0, st0.lora, r)
    theta0, lora0 = _leaves(st0.theta.params), _leaves(st0.lora)
    warm = _spy(monkeypatch, phases, "warmup_phi")
    real_eval = rl_loop.evaluate

    def killed(*args):
        raise Killed

    monkeypatch.setattr(rl_loop, "evaluate", killed)  # step 0's evaluation follows the save
    wd = str(tmp_path)
    for attempt in ("killed", "resumed"):
        writer = MetricsWriter(wd, tensorboard=False)
        try:
            rl_loop.train_rl(run, wd, jax.tree.map(jnp.copy, run.init_params), writer)
        except Killed:
            assert attempt == "killed"
        writer.close()
        monkeypatch.setattr(rl_loop, "evaluate", real_eval)
        assert len(warm) == 3, attempt  # the resumed run did not repeat it
        if attempt == "killed":
            ckpt = checkpoints.Checkpointer(wd, "checkpoints")
            assert ckpt.all_steps() == [0]
            fresh = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
            got, _, step, _, warmed = rl_loop._resume(ckpt, fresh, jax.random.key(0), "", 2)
            ckpt.close()
            assert (step, warmed) == (0, 3)
    for a, b in zip(theta0, _leaves(got.theta.params)):  # theta frozen, bitwise
        np.testing.assert_array_equal(a, b)
    assert any((a != b).any() for a, b in zip(lora0, _leaves(got.lora)))  # phi moved
    kl_after = _twin_kl(run, setup, st0, got.lora, r)
    assert kl_after < kl_before, (kl_before, kl_after)
    records = read_metrics(wd)
    logged = [x for x in records if x["phase"] == "phi_warmup"]
    assert [x["step"] for x in logged] == [1, 2, 3]
    for x in logged:
        for key in ("kl_exact", "alpha_mean", "phi_loss", "phi_distill_kl_reverse_k3"):
            assert math.isfinite(x[key]), key
        assert x["phi_skipped_updates"] == 0
    assert [(x["phase"], x["step"]) for x in records if x["phase"] != "phi_warmup"] == [
        ("eval", 0),
        ("rl", 1),
        ("eval", 1),
    ]


@pytest.mark.slow
def test_phi_row_stride_trains_on_every_sth_row_and_lowers_the_kl(ctx, monkeypatch, tmp_path):
    """distill.row_stride=2: phi's batch is kept rows 0 and 2 of 4 (tokens, mask, rollout
    and teacher log-probs alike), split into rl.minibatches of one row, and phi's warm
    start on it still lowers the twin's exact KL to dense on a fixed rollout."""
    from dsparse_jax.report.metrics import MetricsWriter
    from dsparse_jax.train import distill

    run = configured(
        ctx, rl__rollout_mode="distillsparse", distill__row_stride=2, distill__warmup_steps=3
    )
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    r = phases.rollout(run, setup, st, jax.random.key(9), 0)[0].rollout
    kl_before = _twin_kl(run, setup, st, st.lora, r)
    updates = _spy(monkeypatch, phases, "update_phi")
    batches = _spy(monkeypatch, phases, "_minibatch_updates")
    recomputes = _spy(monkeypatch, phases, "_recompute")
    writer = MetricsWriter(str(tmp_path), tensorboard=False)
    warm = rl_loop.warm_start_phi(run, setup, st, writer)
    writer.close()
    assert len(updates) == len(recomputes) == 3
    for upd, mb, rec in zip(updates, batches, recomputes):
        kept, batch = upd[3].kept, mb[2]
        assert mb[0] is distill.phi_update and mb[4] == run.config.rl.minibatches == 2
        assert kept.tokens.shape[0] == 4 and batch["tokens"].shape[0] == 2
        dense_logp = phases._recompute(*rec)["dense_logp"]  # the teacher (cached)
        for name, rows in (
            ("tokens", kept.tokens),
            ("mask", kept.completion_mask),
            ("rollout_logp", kept.logprobs),
            ("teacher_logp", dense_logp),
        ):
            np.testing.assert_array_equal(batch[name], np.asarray(rows)[[0, 2]], err_msg=name)
    kl_after = _twin_kl(run, setup, st, warm.lora, r)
    assert kl_after < kl_before, (kl_before, kl_after)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(rl__rollout_mode="sparse", distill__warmup_steps=2), "distill.warmup_steps"),
        (
            dict(rl__rollout_mode="speculative", rl__draft="history", distill__warmup_steps=2),
            "distill.warmup_steps",
        ),
        (dict(distill__warmup_steps=2, distill__kl_coef=0.0), "distill.kl_coef"),
        (dict(distill__row_stride=3), "distill.row_stride"),  # 4 kept rows
        (dict(distill__row_stride=4), "distill.row_stride"),  # 1 row, 2 minibatches
        (dict(distill__row_stride=2, rl__microbatches=2), "distill.row_stride"),
        (dict(distill__row_stride=2, mesh__data=2), "mesh.data"),  # phi's minibatch: 1 row
    ],
)
def test_phi_setting_refusals(overrides, field):
    """One line naming the field; their allowed neighbours pass (below)."""
    c = base_config()
    for k, v in overrides.items():
        section, name = k.split("__")
        c[section][name] = v
    with pytest.raises(ConfigError, match=f"^config.{field}: ") as e:
        validate(c)
    assert "\n" not in str(e.value)


def test_phi_settings_allowed():
    for overrides in (
        dict(distill__warmup_steps=2),
        dict(rl__rollout_mode="speculative", distill__warmup_steps=2),
        dict(distill__row_stride=2),
        dict(distill__row_stride=2, rl__minibatches=1, rl__microbatches=2),
    ):
        c = base_config()
        for k, v in overrides.items():
            section, name = k.split("__")
            c[section][name] = v
        validate(c)


def test_the_default_correction_is_the_modes(ctx):
    """rl.is_correction=auto (the default): TIS on theta's update in distillsparse (its
    uncorrected update collapsed both policies, issue 39), none for the other modes (naive
    sparse stays the uncorrected baseline); an explicit value wins."""
    assert ctx.config.rl.is_correction == "auto"
    kinds = {
        mode: rl_state.make_setup(configured(ctx, rl__rollout_mode=mode)).correction.kind
        for mode in ("distillsparse", "sparse", "dense", "sparse_train")
    }
    assert kinds == {
        "distillsparse": "tis",
        "sparse": "none",
        "dense": "none",
        "sparse_train": "none",
    }
    explicit = configured(ctx, rl__rollout_mode="distillsparse", rl__is_correction="none")
    assert rl_state.make_setup(explicit).correction.kind == "none"
