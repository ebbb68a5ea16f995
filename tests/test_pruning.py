"""Online rollout pruning (sampling/pruning.py, the sampler's prune path, the quality head):

- the survivors of a pruned rollout are exactly the unpruned rollout's rows with the same
  key (per-row PRNG streams): tokens, lengths, log-probs and page records;
- after compaction the caches and page records still belong to their rows: the
  teacher-forced sparse forward on the recorded pages reproduces the rollout's log-probs
  and the head's features at each checkpoint;
- the keep rule picks the right rows from mocked scores (both ends, ended rows, ties);
- the head learns a synthetic signal (held-out AUC > 0.9); the AUC metric against brute force.

Tiny shapes, CPU, f32: two sampler compiles and one forward.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.model import quality_head
from dsparse_jax.rl import pruning_metrics
from dsparse_jax.sampling import pruning
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig
from dsparse_jax.train import quality
from tests.test_lora import VOCAB, model_cfg, random_params

SPARSE = AttentionSpec(page_size=4, sparse=SparseSpec(budget=3, dense_layers=1))
M, P = 6, 3
PRUNE = pruning.PruneConfig(positions=(3, 7), sizes=(4, 2), rho=0.5, label_rows=1, layer=-1)
SCFG = SamplingConfig(max_new_tokens=14, eos_id=1, pad_id=0, temperature=1.0, samples_per_prompt=M)


@functools.lru_cache(maxsize=None)
def setup():
    cfg = model_cfg()
    graphdef, params = random_params(cfg, seed=3)
    rng = np.random.default_rng(1)
    lengths = np.array([5, 8, 3])
    prompts = np.where(np.arange(8) < lengths[:, None], rng.integers(2, VOCAB, (P, 8)), 0)
    head = quality_head.init_quality_head(
        quality_head.QualityHeadConfig(cfg.d_model, hidden=8), jax.random.key(2)
    )
    head["w2"] = jax.random.normal(jax.random.key(3), head["w2"].shape) * 3.0
    sampler = Sampler(graphdef)
    key = jax.random.key(11)
    plain = jax.device_get(sampler(params, prompts, lengths, key, SCFG, SPARSE))
    pruned, rec = jax.device_get(
        sampler(params, prompts, lengths, key, SCFG, SPARSE, prune=PRUNE, head=head)
    )
    return cfg, graphdef, params, head, plain, pruned, rec


@pytest.mark.slow  # two sampler compiles
def test_survivors_equal_the_unpruned_rows_with_the_same_key():
    _, _, _, _, plain, pruned, rec = setup()
    rows = PRUNE.rows_per_prompt
    assert pruned.tokens.shape == (P * rows, plain.tokens.shape[1])
    src = np.asarray(rec.source_rows)
    # Per prompt [n kept | one label row per checkpoint], each from that prompt's group.
    np.testing.assert_array_equal(src // M, np.repeat(np.arange(P), rows))
    assert len(set(src.tolist())) == len(src)
    np.testing.assert_array_equal(rec.is_label, np.tile([0, 0, 1, 1], P).astype(bool))
    # Labels stand for the rows pruned with them: 6 -> 4 (2 pruned), 4 -> 2 (2 pruned).
    np.testing.assert_array_equal(rec.weight, np.tile([1, 1, 2, 2], P).astype(np.float32))
    np.testing.assert_array_equal(pruned.tokens, plain.tokens[src])
    np.testing.assert_array_equal(pruned.completion_lengths, plain.completion_lengths[src])
    np.testing.assert_array_equal(pruned.prompt_lengths, plain.prompt_lengths[src])
    np.testing.assert_array_equal(pruned.completion_mask, plain.completion_mask[src])
    np.testing.assert_allclose(pruned.logprobs, plain.logprobs[src], atol=1e-6)
    for layer, ids in plain.page_ids.items():
        np.testing.assert_array_equal(pruned.page_ids[layer], ids[src])
    # The runs decode past the last checkpoint (the test covers the compacted loop).
    assert pruned.completion_lengths.max() > PRUNE.positions[-1] + 1
    # Tokens: every decoded one, pruned rows' included; fewer than the unpruned run's.
    assert int(rec.tokens_generated) < int(plain.completion_lengths.sum())
    assert int(rec.tokens_generated) >= int(pruned.completion_lengths.sum())
    # Scored flags: kept rows at both checkpoints, label rows up to the one that drew them.
    np.testing.assert_array_equal(rec.scored, np.tile([[1, 1], [1, 1], [1, 0], [1, 1]], (P, 1)))


@pytest.mark.slow
def test_compacted_caches_pages_and_features_belong_to_their_rows():
    """The teacher-forced sparse forward on the pruned rollout's recorded pages: log-probs
    equal the sampled ones and the final hidden state at the checkpoint's last fed token
    equals the head's recorded features (so the scores were of the right prefix)."""
    _, graphdef, params, head, _, r, rec = setup()
    fwd = jax.jit(
        lambda p, t, pages: nnx.merge(graphdef, p).forward(
            t, SPARSE, pages=pages, return_hidden=True
        )
    )
    logits, hidden = jax.device_get(fwd(params, jnp.asarray(r.tokens), r.pages()))
    lp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    checked = 0
    for b in range(r.tokens.shape[0]):
        p0, c = int(r.prompt_lengths[b]), int(r.completion_lengths[b])
        for j in range(p0, p0 + c):
            assert abs(lp[b, j - 1, r.tokens[b, j]] - r.logprobs[b, j]) < 1e-4, (b, j)
            checked += 1
        for ci, pos in enumerate(PRUNE.positions):
            if not rec.scored[b, ci]:
                continue
            last = p0 + min(pos, c) - 1  # the prefix of `pos` tokens (or the whole completion)
            np.testing.assert_allclose(rec.feats[b, ci], hidden[b, last], atol=1e-4)
            want = quality_head.quality_probs(head, jnp.asarray(hidden[b, last][None]))[0]
            assert abs(rec.scores[b, ci] - float(want)) < 1e-4
    assert checked > 50


def test_keep_rule_from_mocked_scores():
    s = jnp.array([[0.9, 0.1, 0.5, 0.7, 0.3, 0.8]])
    none = jnp.zeros((1, 6), bool)

    def keep(scores, ended, k, rho):
        return np.asarray(pruning.keep_rule(scores, ended, k, rho))[0].tolist()

    assert keep(s, none, 4, 0.5) == [0, 1, 4, 5]  # top 2 (0.9, 0.8) + bottom 2 (0.1, 0.3)
    assert keep(s, none, 4, 1.0) == [0, 2, 3, 5]  # the 4 best
    assert keep(s, none, 4, 0.0) == [1, 2, 3, 4]  # the 4 worst
    assert keep(s, none, 4, 0.25) == [0, 1, 2, 4]  # 1 from the top, 3 from the bottom
    # An ended row (score 0.5) is kept as it is; 2 - 0.5 -> 2 (half to even) from the top.
    ended = jnp.array([[False, False, True, False, False, False]])
    assert keep(s, ended, 4, 0.5) == [0, 1, 2, 5]
    # Ended rows with high scores push the free slots to the bottom of the ranking.
    hi = jnp.array([[0.9, 0.1, 0.95, 0.7, 0.3, 0.8]])
    ended2 = jnp.array([[True, False, True, False, False, False]])
    assert keep(hi, ended2, 4, 0.5) == [0, 1, 2, 4]
    # More ended rows than slots: the rule picks among the ended ones only.
    many = jnp.array([[True, True, True, True, False, True]])
    assert keep(s, many, 2, 0.5) == [0, 1]  # top 0.9 and bottom 0.1 of the ended rows
    # Ties: the lower index first; several groups at once.
    tied = jnp.array([[0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.4, 0.1]])
    got = np.asarray(pruning.keep_rule(tied, jnp.zeros((2, 4), bool), 2, 0.5)).tolist()
    assert got == [[0, 3], [1, 3]]


def test_label_rows_and_row_plan():
    kept = jnp.array([[0, 2], [1, 3]])
    draws = np.stack(
        [np.asarray(pruning.label_pick(kept, 5, 2, jax.random.key(k))) for k in range(200)]
    )
    for g, ks in enumerate([{0, 2}, {1, 3}]):
        rows = draws[:, g]
        assert all(len(set(r)) == 2 and not set(r) & ks for r in rows.tolist())
        counts = np.bincount(rows.reshape(-1), minlength=5)
        free = sorted(set(range(5)) - ks)
        assert counts[free].min() > 100  # uniform over the 3 free rows (400 draws)
    cfg = pruning.PruneConfig(positions=(2, 4), sizes=(3, 2), label_rows=1)
    scores = jnp.array([0.1, 0.9, 0.5, 0.7, 0.0] + [0.3, 0.2, 0.8, 0.6, 0.0])
    rows, new_label, w = pruning.plan_rows(
        scores, jnp.zeros(10, bool), 2, 4, 1, 2, cfg, jax.random.key(0)
    )
    rows, new_label = np.asarray(rows), np.asarray(new_label)
    # Per prompt [2 kept | the carried label row (index 4) | 1 new label row].
    assert rows.reshape(2, 4)[:, :2].tolist() == [[0, 1], [6, 7]]  # 0.9 + 0.1, 0.8 + 0.2
    assert rows.reshape(2, 4)[:, 2].tolist() == [4, 9]
    assert set(rows.reshape(2, 4)[0, 3:]) <= {2, 3} and set(rows.reshape(2, 4)[1, 3:]) <= {5, 8}
    assert new_label.tolist() == [False, False, False, True] * 2 and w == 2.0


def test_prune_config_checks():
    with pytest.raises(ValueError, match="decreasing"):
        pruning.PruneConfig(positions=(2, 4), sizes=(2, 3))
    with pytest.raises(ValueError, match="increasing"):
        pruning.PruneConfig(positions=(4, 2), sizes=(3, 2))
    with pytest.raises(ValueError, match="exceed"):
        pruning.PruneConfig(positions=(2,), sizes=(4,)).check(4)
    with pytest.raises(ValueError, match="label_rows"):
        pruning.PruneConfig(positions=(2,), sizes=(4,), label_rows=3).check(6)


def test_head_learns_a_synthetic_signal():
    """Labels from a noisy nonlinear function of the features; AUC on held-out rows."""
    rng = np.random.default_rng(0)
    d = 16
    u = rng.normal(size=d)

    def data(n):
        x = rng.normal(size=(n, d)) * 3.0 + 1.0
        logit = 3.0 * np.tanh(x @ u / np.sqrt(d))
        y = (rng.uniform(size=n) < 1 / (1 + np.exp(-4 * logit))).astype(np.float32)
        return jnp.asarray(x, jnp.float32), jnp.asarray(y)

    x, y = data(1024)
    xt, yt = data(512)
    cfg = quality_head.QualityHeadConfig(d, hidden=32)
    tx = quality.make_tx(1e-2)
    head, opt = quality.init(cfg, tx, jax.random.key(0))
    assert abs(pruning_metrics.weighted_auc(quality_head.quality_probs(head, xt), yt) - 0.5) < 1e-9
    for _ in range(5):
        head, opt, before, after = quality.quality_head_update(
            head, opt, x, y, jnp.ones_like(y), tx=tx, steps=40
        )
        assert float(after) <= float(before)
    auc = pruning_metrics.weighted_auc(np.asarray(quality_head.quality_probs(head, xt)), yt)
    assert auc > 0.9, auc
    cal = pruning_metrics.calibration(np.asarray(quality_head.quality_probs(head, xt)), yt)
    assert cal["ece"] < 0.1, cal


def test_weighted_auc_and_groups_mixed_against_brute_force():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 5, 40) / 4.0  # ties
    y = rng.integers(0, 2, 40)
    w = rng.uniform(0.5, 2.0, 40)
    num = den = 0.0
    for i in np.flatnonzero(y):
        for j in np.flatnonzero(1 - y):
            num += w[i] * w[j] * ((s[i] > s[j]) + 0.5 * (s[i] == s[j]))
            den += w[i] * w[j]
    assert abs(pruning_metrics.weighted_auc(s, y, w) - num / den) < 1e-12
    assert np.isnan(pruning_metrics.weighted_auc(s, np.ones(40)))
    assert pruning_metrics.groups_mixed(np.array([[1, 1], [0, 1], [0, 0], [1, 0]])) == 0.5


# ----------------------------------------------------------------------------- RL integration
def _prune_run(tmp_path=None):
    import copy

    from dsparse_jax.config.validate import validate
    from dsparse_jax.train import context
    from tests.test_modes import base_config

    c = base_config()
    c.rl.rollout_mode = "dense"
    c.rl.prune.enabled = True
    c.rl.prune.generated = 4  # M' = 4 -> n = 2 (+ 1 label row per checkpoint)
    c.rl.prune.positions = "3"
    c.rl.prune.head_hidden = 8
    validate(c)
    return context.build(copy.deepcopy(c))


def binary_score(tok, rollout, problems, rewarder=None, where=""):
    """A 0/1 reward an untrained model earns half the time: more odd than even tokens."""
    from dsparse_jax.data.rewards.rewarder import Scored

    m = np.asarray(rollout.completion_mask)
    odd = np.asarray((rollout.tokens % 2) * m).sum(1)
    r = (odd * 2 > m.sum(1)).astype(np.float64)
    return Scored(r, np.zeros(len(r), bool), {"reward_errors": 0}), ["x"] * len(r)


@pytest.mark.slow
def test_rl_step_with_pruning_trains_the_head_and_checkpoints_it(tmp_path, monkeypatch):
    import math

    from dsparse_jax.reliability import checkpoints
    from dsparse_jax.train import phases, rl_loop, rl_state, trainables
    from tests.test_modes import optimizer_steps_taken, steps_per_rl_step

    monkeypatch.setattr(phases, "grade", binary_score)
    run = _prune_run()
    setup = rl_state.make_setup(run)
    assert setup.pruning.config.sizes == (2,) and setup.pruning.generated == 4
    st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, run.init_params))
    head0 = jax.tree.map(np.asarray, st.quality_head.params)
    rng = jax.random.key(0)
    for step in range(2):
        rng, k = jax.random.split(rng)
        st, m = phases.rl_step(run, setup, st, k, step)
    for key in (
        "time_update_head",
        "prune_head_loss",
        "prune_groups_mixed_kept",
        "prune_groups_mixed_completed",
        "prune_tokens_generated",
        "prune_token_ratio",
        "groups_mixed",
        "tokens_generated",
        "tokens_trained",
    ):
        assert key in m and math.isfinite(m[key]), (key, m.get(key))
    assert "prune_head_auc" in m and m["skipped_updates"] == 0
    assert m["prune_head_loss_after"] < m["prune_head_loss"]
    steps = 2 * steps_per_rl_step(run, "quality_head")  # after two RL steps
    assert optimizer_steps_taken(st.quality_head.opt_state) == steps
    assert m["tokens_generated"] == m["prune_tokens_generated"] > m["tokens_trained"]
    assert any(
        (np.asarray(a) != b).any()
        for a, b in zip(jax.tree.leaves(st.quality_head.params), jax.tree.leaves(head0))
    )
    # The head and its optimizer state round-trip through a checkpoint.
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    ckpt.save(2, rl_loop._saveable(st, jax.random.key(5), 2, 7), force=True)
    ckpt.wait()
    fresh = trainables.init_state(run, setup, run.init_params)
    got, _, step = rl_loop._restore(ckpt, 2, fresh, jax.random.key(0))
    ckpt.close()
    assert step == 2
    for a, b in zip(
        jax.tree.leaves(got.quality_head),
        jax.tree.leaves(st.quality_head),
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    run.rewarder.close()


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("generated", 2, "rl.prune.generated"),
        ("positions", "8,4", "rl.prune.positions"),
        ("positions", "x", "rl.prune.positions"),
        ("positions", "500", "rl.prune.positions"),
        ("rho", 1.5, "rl.prune.rho"),
        ("label_rows", 9, "rl.prune.label_rows"),
        ("layer", 7, "rl.prune.layer"),
        ("head_learning_rate", 0.0, "rl.prune.head_learning_rate"),
        ("head_steps", 0, "rl.prune.head_steps"),
    ],
)
def test_prune_config_validation(field, value, match):
    from dsparse_jax.config.validate import ConfigError, validate
    from tests.test_modes import base_config

    c = base_config()
    c.rl.prune.enabled = True
    c.rl.prune.positions = "3"
    c.rl.prune[field] = value
    with pytest.raises(ConfigError, match=f"config.{match}"):
        validate(c)


# ----------------------------------------------------------------------------- test time
def test_quality_weighted_majority_vote():
    from dsparse_jax.train.evaluation import maj_at_k

    answers = [["1", "1", "2"], ["3", None, "4"]]
    correct = np.array([[0, 0, 1], [1, 0, 0]])
    assert maj_at_k(answers, correct) == 0.5  # "1" wins 2:1; "3" first seen of a 1:1 tie
    w = np.array([[0.1, 0.2, 0.9], [0.2, 1.0, 0.7]])
    assert maj_at_k(answers, correct, w) == 0.5  # "2" wins 0.9:0.3; "4" wins 0.7:0.2
    assert maj_at_k(answers, correct, np.ones((2, 3))) == maj_at_k(answers, correct)


@pytest.mark.slow
def test_eval_head_scores_equal_the_samplers():
    """The evaluator's teacher-forced head scores (qmaj@k weights) reproduce the scores the
    sampler gave each row at the last checkpoint (same features, same position)."""
    from dsparse_jax.train.evaluation import _quality_scores_fn

    _, graphdef, params, head, _, r, rec = setup()
    fn = _quality_scores_fn(graphdef, PRUNE.layer, SPARSE, 1.0)
    got = np.asarray(
        fn(params, None, head, r.tokens, r.prompt_lengths, r.completion_lengths, r.pages(), 7)
    )
    m = np.asarray(rec.scored)[:, -1]
    assert m.sum() >= P * PRUNE.n
    np.testing.assert_allclose(got[m], np.asarray(rec.scores)[m, -1], atol=1e-4)
