"""LoRA delta tree: shapes and init, a zero-initialised adapter leaves the policy unchanged,
the adapter computes x.(W + A.B * alpha / r) for every targeted map (against the same
model with merged weights), the sampler's one-time merge matches the teacher-forced
forward, and bf16 compute keeps the unmerged (x.A).B path."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import random_params

from dsparse_jax.model import config as C
from dsparse_jax.model.lora import LoRAConfig, init_lora, num_params, parse_targets
from dsparse_jax.model.transformer import LINEAR_NAMES
from dsparse_jax.train.recompute import token_logprobs

VOCAB = 16


def model_cfg():
    return C.tiny(vocab_size=VOCAB).replace(
        d_model=32,
        head_dim=8,
        mlp_dim=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=8,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "lora_scale"))
def logp(params, tokens, lora, *, graphdef, lora_scale=1.0):
    return token_logprobs(graphdef, params, tokens, lora=lora, lora_scale=lora_scale)[0]


TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 12)), jnp.int32)


def test_init_shapes_targets_and_config():
    cfg = model_cfg()
    lcfg = LoRAConfig(rank=3, alpha=6.0)
    assert lcfg.targets == LINEAR_NAMES and lcfg.scale == 2.0
    tree = init_lora(cfg, lcfg, jax.random.key(0))
    assert sorted(tree) == [0, 1]
    d, n, k, h, f = 32, 4, 2, 8, 48
    want = {
        "q": ((d, 3), (3, n, h)),
        "k": ((d, 3), (3, k, h)),
        "v": ((d, 3), (3, k, h)),
        "o": ((n, h, 3), (3, d)),
        "gate": ((d, 3), (3, f)),
        "up": ((d, 3), (3, f)),
        "down": ((f, 3), (3, d)),
    }
    for layer in tree.values():
        assert set(layer) == set(LINEAR_NAMES)
        for name, (a_shape, b_shape) in want.items():
            a, b = np.asarray(layer[name]["a"]), np.asarray(layer[name]["b"])
            assert a.shape == a_shape and b.shape == b_shape, name
            assert not b.any()  # B = 0
            fan_in = math.prod(a_shape[:-1])
            assert np.abs(a).max() <= fan_in**-0.5 and a.std() > 0.3 * fan_in**-0.5
    assert num_params(tree) == 2 * sum(math.prod(a) + math.prod(b) for a, b in want.values())
    # Deterministic per key, different across keys.
    again = init_lora(cfg, lcfg, jax.random.key(0))
    other = init_lora(cfg, lcfg, jax.random.key(1))
    np.testing.assert_array_equal(again[1]["o"]["a"], tree[1]["o"]["a"])
    assert not np.allclose(other[1]["o"]["a"], tree[1]["o"]["a"])
    sub = init_lora(
        cfg, LoRAConfig(rank=2, targets=parse_targets("attn"), layers=(1,)), jax.random.key(0)
    )
    assert list(sub) == [1] and set(sub[1]) == {"q", "k", "v", "o"}
    assert parse_targets("q, v,mlp") == ("q", "v", "gate", "up", "down")
    assert parse_targets("all") == LINEAR_NAMES
    with pytest.raises(ValueError, match="unknown"):
        LoRAConfig(targets=("q", "w"))
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(rank=0)


def test_zero_init_leaves_logprobs_unchanged_and_trained_b_changes_them():
    cfg = model_cfg()
    graphdef, params = random_params(cfg)
    lcfg = LoRAConfig(rank=4, alpha=8.0)
    lora = init_lora(cfg, lcfg, jax.random.key(0))
    base = logp(params, TOKENS, None, graphdef=graphdef)
    with_zero = logp(params, TOKENS, lora, graphdef=graphdef, lora_scale=lcfg.scale)
    # Adding exact zeros; only XLA's fusion order may differ (float rounding).
    np.testing.assert_allclose(np.asarray(with_zero), np.asarray(base), rtol=0, atol=1e-5)
    moved = jax.tree.map(lambda x: x, lora)
    moved[1]["down"]["b"] = jnp.full_like(moved[1]["down"]["b"], 0.05)
    changed = logp(params, TOKENS, moved, graphdef=graphdef, lora_scale=lcfg.scale)
    assert np.abs(np.asarray(changed) - np.asarray(base)).max() > 1e-3


def test_adapter_equals_merged_weights_for_every_target():
    cfg = model_cfg()
    graphdef, params = random_params(cfg, seed=2)
    lcfg = LoRAConfig(rank=4, alpha=8.0)
    rng = np.random.default_rng(3)
    lora = jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.2, x.dtype),
        init_lora(cfg, lcfg, jax.random.key(0)),
    )
    got = logp(params, TOKENS, lora, graphdef=graphdef, lora_scale=lcfg.scale)

    pure = nnx.to_pure_dict(params)
    for i, layer in lora.items():
        for name, ab in layer.items():
            group = "attn" if name in ("q", "k", "v", "o") else "mlp"
            w = pure["layers"][i][group][name]
            delta = jnp.tensordot(ab["a"], ab["b"], axes=1) * lcfg.scale
            assert delta.shape == w.shape
            pure["layers"][i][group][name] = w + delta
    merged = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(merged, pure)
    want = logp(merged, TOKENS, None, graphdef=graphdef)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 1e-4
    base = logp(params, TOKENS, None, graphdef=graphdef)
    assert np.abs(np.asarray(got) - np.asarray(base)).max() > 1e-2  # the adapter matters


def _random_lora(cfg, lcfg, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.2, x.dtype),
        init_lora(cfg, lcfg, jax.random.key(0)),
    )


def test_sampler_merges_adapter_once_and_matches_teacher_forced():
    """The sampler folds phi into the weights before decoding (f32); its log-probs equal
    the teacher-forced forward with the adapter applied inside the linear maps (1e-4)."""
    from dsparse_jax.sampling.sampler import Sampler, SamplingConfig

    cfg = model_cfg()
    graphdef, params = random_params(cfg, seed=4)
    lcfg = LoRAConfig(rank=4, alpha=8.0)
    lora = _random_lora(cfg, lcfg, 5)
    prompts = jnp.asarray(np.random.default_rng(6).integers(1, VOCAB, (2, 5)), jnp.int32)
    scfg = SamplingConfig(max_new_tokens=10, eos_id=-1, pad_id=0, temperature=1.0)
    sampler = Sampler(graphdef)
    r = sampler(
        params,
        prompts,
        jnp.array([5, 3]),
        jax.random.key(7),
        scfg,
        lora=lora,
        lora_scale=lcfg.scale,
    )
    tf = logp(params, r.tokens, lora, graphdef=graphdef, lora_scale=lcfg.scale)
    on = np.asarray(r.completion_mask) > 0
    assert np.abs(np.asarray(r.logprobs) - np.asarray(tf))[on].max() < 1e-4
    plain = logp(params, r.tokens, None, graphdef=graphdef)
    assert np.abs(np.asarray(r.logprobs) - np.asarray(plain))[on].max() > 1e-2


def test_bf16_compute_applies_adapter_unmerged():
    """In bf16 the delta is applied as (x.A).B (a merged bf16 weight would round small
    deltas away): log-probs agree with the f32 merged path to bf16 precision."""
    cfg = model_cfg()
    graphdef, params = random_params(cfg, seed=8)
    lcfg = LoRAConfig(rank=4, alpha=8.0)
    lora = _random_lora(cfg, lcfg, 9)
    want = logp(params, TOKENS, lora, graphdef=graphdef, lora_scale=lcfg.scale)
    bf16_graphdef, bf16_params = random_params(cfg.replace(dtype="bfloat16"), seed=8)
    got = logp(bf16_params, TOKENS, lora, graphdef=bf16_graphdef, lora_scale=lcfg.scale)
    base = logp(bf16_params, TOKENS, None, graphdef=bf16_graphdef)
    err = np.abs(np.asarray(got) - np.asarray(want)).max()
    assert err < 0.1 and np.abs(np.asarray(got) - np.asarray(base)).max() > 5 * err
