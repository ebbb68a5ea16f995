"""Which rows train (docs/objectives.md): the select phase's order (overlong shaping before
the top-n of M, advantages over the kept n, overlong filtering) and DAPO's dynamic
sampling (further draws until P informative groups, the cap, the masked fill, fixed shapes
that compile once), alone and composed with oversampling and with pruning.

The order tests run the phases on synthetic rollouts (no model); the end-to-end tests run
rl_step on the tiny model of tests/test_modes.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.config.validate import validate
from dsparse_jax.data.rewards.rewarder import Scored
from dsparse_jax.sampling.sampler import Rollout
from dsparse_jax.train import context, phases, rl_state, trainables
from dsparse_jax.train.rl_state import RL_DATA_OFFSET
from tests.model_utils import configured
from tests.test_modes import base_config


@pytest.fixture(scope="module")
def ctx():
    c = base_config()
    c.rl.rollout_mode = "dense"
    validate(c)
    return context.build(c)


def synthetic_rollout(lengths, eos_rows, eos_id, mark=10, prompt=2, width=None):
    """Rows of `lengths` completion tokens (all `mark`), EOS last in `eos_rows`."""
    b, width = len(lengths), width or prompt + max(lengths) + 1
    pos = np.arange(width)[None]
    lengths = np.asarray(lengths, np.int32)
    mask = (pos >= prompt) & (pos < prompt + lengths[:, None])
    tokens = np.where(mask, mark, 3).astype(np.int32)
    for r in eos_rows:
        tokens[r, prompt + lengths[r] - 1] = eos_id
    return Rollout(
        tokens=jnp.asarray(tokens),
        prompt_lengths=jnp.full(b, prompt, jnp.int32),
        completion_lengths=jnp.asarray(lengths),
        completion_mask=jnp.asarray(mask, jnp.float32),
        logprobs=jnp.zeros((b, width), jnp.float32),
        page_ids={},
        prompt_width=prompt,
    )


# ---------------------------------------------------------------- the select phase's order
def test_select_shapes_rewards_before_the_top_n_and_filters_truncated_rows(ctx):
    """Equal task rewards; the overlong penalty (buffer = the whole budget: -|y| / L_max)
    makes the shortest completions best, so the top 2 of 4 are the 2 shortest: shaping ran
    before the oversampling filter. Advantages are GRPO's over the kept shaped rewards;
    the kept row without EOS is masked (overlong filtering), the others train."""
    L = ctx.task.completion_budget()
    run = configured(
        ctx,
        rl__samples_generated=4,
        rl__overlong__buffer=L,
        rl__overlong__filter=True,
        metrics__all_rows_every=0,
    )
    setup = rl_state.make_setup(run)
    assert (setup.n, setup.m, setup.sampling.max_new_tokens) == (2, 4, L)
    lengths = [L - 1, 3, L - 2, 5, 4, L, 6, L - 3]  # prompt 0: rows 1, 3 shortest; 1: 4, 6
    r = synthetic_rollout(lengths, eos_rows=[0, 2, 3, 4, 5, 6, 7], eos_id=setup.sampling.eos_id)
    gen = phases.Generated([None, None], r)
    sel, m = phases.select(run, setup, None, gen, np.ones(8), jax.random.key(0), 0)
    kept = (
        sorted(np.asarray(sel.kept.completion_lengths).tolist()[:2]),
        sorted(np.asarray(sel.kept.completion_lengths).tolist()[2:]),
    )
    assert kept == ([3, 5], [4, 6])
    shaped = 1.0 - np.asarray(sel.kept.completion_lengths) / L
    np.testing.assert_allclose(sel.rewards, shaped, rtol=1e-6)
    g = shaped.reshape(2, 2)  # GRPO over each kept pair: +-1/sqrt(2) (unbiased std)
    want = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(sel.adv), want.reshape(-1), rtol=1e-4)
    # Row with 3 tokens (prompt 0) has no EOS: truncated, its loss masked.
    np.testing.assert_array_equal(sel.train_rows, np.asarray(sel.kept.completion_lengths) != 3)
    assert m["overlong_truncated_frac"] == 0.25 and m["tokens_trained"] == 5 + 4 + 6
    assert math.isclose(m["overlong_penalty_mean"], -np.mean(lengths) / L, rel_tol=1e-6)
    batch, _ = phases.theta_batch(
        setup.mode, sel.kept, sel.adv, sel.kept.logprobs, None, setup.correction, sel.train_rows
    )
    np.testing.assert_array_equal(
        np.asarray(batch["mask"]).sum(1), np.asarray(sel.kept.completion_lengths) * sel.train_rows
    )


# ------------------------------------------------------------------ dynamic sampling
class Draws:
    """Stands in for the rollout and score phases: draw d's rollout has completions of
    token 10 + d, and its rewards are the given ones; records each draw's prompts."""

    def __init__(self, rewards_per_draw, eos_id, n):
        self.rewards, self.eos_id, self.n = rewards_per_draw, eos_id, n
        self.starts = []

    def rollout(self, ctx, setup, st, key, step, data_start=None, draw=0):
        p = setup.prompts_per_step
        self.starts.append(RL_DATA_OFFSET + (step * setup.selection.max_draws + draw) * p)
        lengths = [4 + draw] * (p * self.n)
        r = synthetic_rollout(lengths, range(p * self.n), self.eos_id, mark=10 + draw, width=16)
        return phases.Generated([None] * p, r), {}

    def grade(self, tok, rollout, problems, rewarder=None, where=""):
        draw = int(np.asarray(rollout.tokens)[0, 2]) - 10
        r = np.asarray(self.rewards[draw], np.float64)
        return Scored(r, np.zeros(len(r), bool), {"reward_errors": 0}), ["x"] * len(r)


def dynamic_run(ctx, monkeypatch, rewards_per_draw, max_draws=3, step=0):
    run = configured(
        ctx,
        rl__prompts_per_step=3,
        rl__minibatches=1,
        rl__dynamic_sampling__enabled=True,
        rl__dynamic_sampling__max_draws=max_draws,
    )
    setup = rl_state.make_setup(run)
    draws = Draws(rewards_per_draw, setup.sampling.eos_id, setup.n)
    monkeypatch.setattr(phases, "rollout", draws.rollout)
    monkeypatch.setattr(phases, "grade", draws.grade)
    log = phases.PhaseLog()
    keys = jax.random.split(jax.random.key(0))
    gen = log.run("rollout", phases.rollout, run, setup, None, keys[0], step)
    scored = log.run("score", phases.score, run, setup, gen, step)
    sel = log.run("select", phases.select, run, setup, None, gen, scored.rewards, keys[1], step)
    sel = phases.dynamic_sampling(run, setup, None, log, sel, tuple(keys), step)
    return sel, log.summary(), draws


def test_dynamic_sampling_draws_until_informative(ctx, monkeypatch):
    """P = 3 groups of n = 2. Draw 0: group 1 informative; draw 1: groups 0 and 2; so after
    two draws the batch is draw 0's group 1, then draw 1's groups 0 and 2, all training."""
    rewards = [[1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 0.5, 0], [0, 1, 0, 1, 0, 1]]
    sel, m, draws = dynamic_run(ctx, monkeypatch, rewards)
    marks = np.asarray(sel.kept.tokens)[:, 2].reshape(3, 2)[:, 0] - 10  # each group's draw
    np.testing.assert_array_equal(marks, [0, 1, 1])
    np.testing.assert_array_equal(sel.rewards, [0, 1, 1, 0, 0.5, 0])
    a = 1 / math.sqrt(2)  # GRPO of a pair: +-1/sqrt(2) (unbiased std)
    np.testing.assert_allclose(np.asarray(sel.adv), [-a, a, a, -a, a, -a], rtol=1e-4)
    np.testing.assert_array_equal(sel.train_rows, np.ones(6))
    assert draws.starts == [RL_DATA_OFFSET, RL_DATA_OFFSET + 3]  # fresh prompts per draw
    assert (m["dynamic_draws"], m["dynamic_groups_drawn"]) == (2, 6)
    assert (m["dynamic_groups_informative"], m["dynamic_groups_kept"]) == (3, 3)
    assert m["groups_mixed_drawn"] == 0.5 and m["groups_mixed"] == 1.0
    assert m["tokens_generated"] == 6 * 4 + 6 * 5 and m["dynamic_extra_tokens"] == 6 * 5
    assert m["tokens_trained"] == 2 * 4 + 4 * 5


def test_dynamic_sampling_stops_at_the_cap_and_masks_the_fill(ctx, monkeypatch):
    """Only one informative group in 2 draws (max_draws = 2): the batch holds it and two
    uninformative groups of draw 0 whose loss is masked; the step's prompts are its own."""
    rewards = [[1, 1, 0, 0, 1, 1], [0, 1, 0, 0, 1, 1]]
    sel, m, draws = dynamic_run(ctx, monkeypatch, rewards, max_draws=2, step=1)
    marks = np.asarray(sel.kept.tokens)[:, 2].reshape(3, 2)[:, 0] - 10
    np.testing.assert_array_equal(marks, [1, 0, 0])
    np.testing.assert_array_equal(sel.train_rows, [1, 1, 0, 0, 0, 0])
    assert draws.starts == [RL_DATA_OFFSET + 6, RL_DATA_OFFSET + 9]  # step 1 owns 2 draws
    assert (m["dynamic_draws"], m["dynamic_groups_kept"], m["dynamic_groups_informative"]) == (
        2,
        1,
        1,
    )
    assert m["tokens_trained"] == 2 * 5


# -------------------------------------------------------------------- end to end (model)
def first_draw_constant(score):
    """A grader whose first call (a step's first draw) gives every row the same reward, so
    dynamic sampling must draw again; later calls are `score`'s."""
    calls = []

    def grade(tok, rollout, problems, rewarder=None, where=""):
        calls.append(where)
        scored, texts = score(tok, rollout, problems, rewarder, where)
        if len(calls) == 1:
            scored = Scored(np.zeros_like(scored.rewards), scored.errors, scored.metrics)
        return scored, texts

    return grade, calls


def binary_score(tok, rollout, problems, rewarder=None, where=""):
    """0/1: more odd than even completion tokens (an untrained model earns it half the time)."""
    m = np.asarray(rollout.completion_mask)
    r = (np.asarray((rollout.tokens % 2) * m).sum(1) * 2 > m.sum(1)).astype(np.float64)
    return Scored(r, np.zeros(len(r), bool), {"reward_errors": 0}), ["x"] * len(r)


@pytest.mark.slow
def test_rl_step_dynamic_sampling_with_oversampling_and_overlong(ctx, monkeypatch):
    """rl_step with M = 3 > n = 2, dynamic sampling (the first draw all uninformative: at
    least one more), overlong shaping and filtering: the update runs on P * n rows, the
    sampler compiles once for every draw, the figures are finite."""
    grade, calls = first_draw_constant(binary_score)
    monkeypatch.setattr(phases, "grade", grade)
    run = configured(
        ctx,
        rl__samples_generated=3,
        rl__dynamic_sampling__enabled=True,
        rl__dynamic_sampling__max_draws=3,
        rl__overlong__buffer=8,
        rl__overlong__filter=True,
    )
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    sizes = []
    real_rollout = phases.rollout

    def counted(*a, **k):
        out = real_rollout(*a, **k)
        sizes.append(run.sampler._jitted._cache_size())
        return out

    monkeypatch.setattr(phases, "rollout", counted)
    st, m = phases.rl_step(run, setup, st, jax.random.key(3), 0)
    assert 2 <= m["dynamic_draws"] == len(calls) == len(sizes) <= 3
    assert len(set(sizes)) == 1  # further draws reuse the first draw's compile
    assert m["dynamic_groups_drawn"] == 2 * m["dynamic_draws"]
    assert m["dynamic_groups_kept"] <= 2 and m["dynamic_extra_tokens"] > 0
    assert m["num_tokens"] <= m["tokens_trained"] + 1e-6  # masked rows leave the loss
    for key in (
        "loss",
        "grad_norm",
        "overlong_penalty_mean",
        "overlong_truncated_frac",
        "groups_mixed_drawn",
        "all_kl_k3",
        "time_rollout",
    ):
        assert key in m and math.isfinite(m[key]), (key, m.get(key))
    assert m["overlong_penalty_mean"] < 0 and m["skipped_updates"] == 0


@pytest.mark.slow
def test_rl_step_dynamic_sampling_with_pruning(monkeypatch):
    """Pruning keeps n of M' rows inside the sampler; dynamic sampling then works on those
    groups: the tokens generated are every draw's pruned rollout's."""
    from tests.test_pruning import _prune_run

    grade, calls = first_draw_constant(binary_score)
    monkeypatch.setattr(phases, "grade", grade)
    base = _prune_run()
    run = configured(base, rl__dynamic_sampling__enabled=True, rl__dynamic_sampling__max_draws=2)
    setup = rl_state.make_setup(run)
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    st, m = phases.rl_step(run, setup, st, jax.random.key(4), 0)
    assert m["dynamic_draws"] == len(calls) == 2
    # the first draw's pruned tokens (prune_tokens_generated) + the second's
    assert m["tokens_generated"] == m["prune_tokens_generated"] + m["dynamic_extra_tokens"]
    assert m["dynamic_extra_tokens"] > 0 and math.isfinite(m["loss"])
    run.rewarder.close()
