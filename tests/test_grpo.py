"""GRPO end to end on a toy task: a few updates must raise the reward."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.model.config import tiny
from dsparse_jax.model.transformer import Transformer
from dsparse_jax.rl.advantages import grpo_advantages
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig
from dsparse_jax.train import steps
from dsparse_jax.train.grpo import GRPOSettings, grpo_update
from dsparse_jax.train.recompute import logprobs

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


def test_microbatches_give_the_same_update():
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
