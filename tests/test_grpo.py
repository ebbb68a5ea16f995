"""theta's update end to end on a toy task: a few updates must raise the reward; every
policy loss of rl/objectives accumulates microbatches exactly; the trainer's log-probs are
those of the rollout's truncated distribution (rl.top_k / rl.top_p)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsparse_jax.model.config import tiny
from dsparse_jax.model.transformer import Transformer
from dsparse_jax.rl.advantages import grpo_advantages
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig
from dsparse_jax.train import steps
from dsparse_jax.train.grpo import GRPOSettings, grpo_update
from dsparse_jax.train.recompute import TRUNCATED_LOGP, logprobs, token_logprobs

TARGET = 5  # reward: fraction of completion tokens equal to TARGET


def test_grpo_raises_reward_of_toy_task():
    cfg = tiny(vocab_size=8).replace(
        d_model=32, num_layers=2, head_dim=8, mlp_dim=64, sliding_window=8
    )
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    sampler = Sampler(graphdef)
    scfg = SamplingConfig(max_new_tokens=6, eos_id=-1, pad_id=0, samples_per_prompt=8)
    tx = steps.make_optimizer(
        3e-2,
        warmup_steps=1,
        total_steps=20,
        weight_decay=0.0,
        max_grad_norm=1.0,
        schedule="constant",
    )
    opt_state = tx.init(params)
    settings = GRPOSettings()
    prompts = jnp.array([[1, 2, 3, 0], [1, 4, 0, 0]], jnp.int32)
    lengths = jnp.array([3, 2], jnp.int32)

    def reward(rollout):
        hits = (rollout.tokens == TARGET) * rollout.completion_mask
        return np.asarray(hits.sum(1) / rollout.completion_mask.sum(1))

    history = []
    key = jax.random.key(0)
    for _ in range(8):
        key, k = jax.random.split(key)
        r = sampler(params, prompts, lengths, k, scfg)
        rew = reward(r)
        history.append(rew.mean())
        old, _ = logprobs(params, r.tokens, graphdef=graphdef, temperature=1.0)
        batch = {
            "tokens": r.tokens,
            "mask": r.completion_mask,
            "old_logp": old,
            "adv": grpo_advantages(jnp.asarray(rew), 8),
        }
        params, opt_state, m = grpo_update(
            params, opt_state, batch, graphdef=graphdef, tx=tx, settings=settings
        )
        assert float(m["skipped"]) == 0.0
    # Chance level is 1/8; the policy must move clearly towards TARGET.
    assert history[0] < 0.3
    assert np.mean(history[-2:]) > history[0] + 0.25, history


def _microbatch_setup():
    """A one-layer model, its optimizer and a 4-row batch of tokens and a completion mask,
    for comparing updates over microbatch counts."""
    cfg = tiny(vocab_size=8).replace(
        d_model=16, num_layers=1, head_dim=8, mlp_dim=32, layer_pattern=("global",)
    )
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(1)))
    tx = steps.make_optimizer(
        1e-2,
        warmup_steps=1,
        total_steps=2,
        weight_decay=0.0,
        max_grad_norm=1e9,
        schedule="constant",
    )
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, 8, (4, 16)), jnp.int32)
    mask = jnp.asarray(rng.random((4, 16)) < 0.6, jnp.float32).at[:, 0].set(0.0)
    return graphdef, params, tx, rng, tokens, mask


def test_microbatches_give_the_same_update():
    graphdef, params, tx, rng, tokens, mask = _microbatch_setup()
    old, _ = logprobs(params, tokens, graphdef=graphdef, temperature=1.0)
    batch = {
        "tokens": tokens,
        "mask": mask,
        "old_logp": old - 0.05,
        "adv": jnp.array([1.0, -0.5, 0.3, -1.2]),
    }
    out = []
    for micro in (1, 2, 4):
        p = jax.tree.map(jnp.copy, params)
        o = tx.init(p)
        p, _, m = grpo_update(
            p, o, batch, graphdef=graphdef, tx=tx, settings=GRPOSettings(microbatches=micro)
        )
        out.append((p, float(m["pg_num"] / m["pg_den"])))
    for p, loss in out[1:]:
        assert abs(loss - out[0][1]) < 1e-5  # f32 summation order only
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(out[0][0])):
            np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize(
    "settings",
    [
        dict(policy_loss="gspo", clip_low=0.1, clip_high=0.15, loss_agg="seq-mean-token-mean"),
        dict(policy_loss="cispo", clip_low=1.0, clip_high=0.1),
        dict(top_k=3, top_p=0.9),  # PPO-clip on the truncated distribution
    ],
    ids=["gspo", "cispo", "ppo_truncated"],
)
def test_every_objective_accumulates_microbatches_exactly(settings):
    """theta's update through each policy loss of the table (and the truncated log-probs):
    1 or 4 microbatches give the same step, the loss moves the parameters, all finite."""
    graphdef, params, tx, rng, tokens, mask = _microbatch_setup()
    old, _ = token_logprobs(
        graphdef,
        params,
        tokens,
        top_k=settings.get("top_k", 0),
        top_p=settings.get("top_p", 1.0),
    )
    batch = {
        "tokens": tokens,
        "mask": mask,
        "old_logp": old + jnp.asarray(rng.normal(0, 0.2, (4, 16)), jnp.float32),
        "adv": jnp.array([1.0, -0.5, 0.3, -1.2]),
    }
    out = []
    for micro in (1, 4):
        p = jax.tree.map(jnp.copy, params)
        o = tx.init(p)
        s = GRPOSettings(microbatches=micro, **settings)
        p, _, m = grpo_update(p, o, batch, graphdef=graphdef, tx=tx, settings=s)
        assert float(m["skipped"]) == 0.0 and np.isfinite(float(m["grad_norm"]))
        assert float(m["grad_norm"]) > 0
        out.append((p, float(m["pg_num"] / m["pg_den"])))
    assert abs(out[1][1] - out[0][1]) < 1e-5
    for a, b in zip(jax.tree.leaves(out[1][0]), jax.tree.leaves(out[0][0])):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_trainer_logprobs_are_the_truncated_rollouts():
    """With rl.top_k / rl.top_p the sampler draws from the truncated distribution; the
    trainer's teacher-forced log-probs with the same truncation equal the rollout's (the
    untruncated ones do not), tokens outside it get TRUNCATED_LOGP, entropies are finite."""
    cfg = tiny(vocab_size=16).replace(
        d_model=32, num_layers=2, head_dim=8, mlp_dim=64, sliding_window=8
    )
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(2)))
    prompts = jnp.array([[1, 2, 3, 0], [1, 4, 0, 0]], jnp.int32)
    lengths = jnp.array([3, 2], jnp.int32)
    k, p = 4, 0.8
    scfg = SamplingConfig(
        max_new_tokens=10, eos_id=-1, pad_id=0, samples_per_prompt=4, top_k=k, top_p=p
    )
    r = Sampler(graphdef)(params, prompts, lengths, jax.random.key(5), scfg)
    fn = jax.jit(
        lambda t: (
            token_logprobs(graphdef, params, t, top_k=k, top_p=p),
            token_logprobs(graphdef, params, t),
            token_logprobs(graphdef, params, jnp.full_like(t, 15), top_k=1),
        )
    )
    (lp, ent), (lp_full, _), (lp_out, ent_out) = fn(r.tokens)
    m = np.asarray(r.completion_mask) > 0
    got, mu = np.asarray(lp)[m], np.asarray(r.logprobs)[m]
    np.testing.assert_allclose(got, mu, atol=1e-4)
    assert np.max(np.abs(np.asarray(lp_full)[m] - mu)) > 1e-2  # truncation matters here
    assert np.all(np.isfinite(np.asarray(ent))) and np.all(np.asarray(ent)[m] <= np.log(k) + 1e-5)
    # top_k = 1 keeps the argmax only: any other token is outside, entropy 0
    outside = np.asarray(lp_out)[:, 1:]
    assert set(np.unique(outside)) <= {0.0, TRUNCATED_LOGP}
    assert (outside == TRUNCATED_LOGP).any() and np.all(np.asarray(ent_out) == 0.0)
