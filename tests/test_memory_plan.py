"""The device memory plan (train/memory_plan.py) and the chunked rollout it chooses.

- The estimates of the two programs it sizes, the rollout and theta's update, are within
  20% of what XLA reports for them once compiled (argument + output + temp - alias bytes
  of `memory_analysis()`, on CPU), at two sizes each; the programs are lowered from
  abstract parameters (nnx.eval_shape), nothing is allocated.
- A chunked rollout equals the unchunked one: tokens, lengths, masks and page records
  bit for bit, log-probs to float rounding (a chunk's matmuls have fewer rows, which
  XLA:CPU may sum in another order).
- The plan takes the fewest chunks that fit, and a config that fits at no chunk size is
  one error naming the field to change.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import random_params

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.errors import UserError
from dsparse_jax.model import config as C
from dsparse_jax.model.lora import LoRAConfig, init_lora, lora_shapes
from dsparse_jax.model.transformer import Transformer
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig
from dsparse_jax.train import memory_plan as mp
from dsparse_jax.train import steps
from dsparse_jax.train.grpo import GRPOSettings, grpo_update

TOLERANCE = 0.2


def _tx():
    return steps.make_optimizer(
        1e-3, warmup_steps=1, total_steps=10, weight_decay=0.0, max_grad_norm=1.0
    )


def _xla_bytes(compiled) -> int:
    """What the program holds at once by XLA's count: its arguments, outputs and
    temporaries, donated arguments (aliased by outputs) once."""
    m = compiled.memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _graph(cfg):
    return nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))


# Two rollouts: a dense one in one chunk, a sparse one with phi (merged in f32) in 4
# chunks over a Gemma-2-style model (local and global layers, soft-caps).
ROLLOUTS = {
    "dense": dict(
        model=C.mini(vocab_size=64).replace(d_model=64, mlp_dim=256, head_dim=16, num_layers=4),
        prompts=8,
        samples=4,
        new=240,
        sparse=None,
        lora=False,
        chunks=1,
    ),
    "sparse_phi_chunked": dict(
        model=C.tiny(vocab_size=512).replace(d_model=64, mlp_dim=256, head_dim=16),
        prompts=8,
        samples=2,
        new=480,
        sparse=SparseSpec(budget=6, dense_layers=2),
        lora=True,
        chunks=4,
    ),
}


@pytest.mark.parametrize("name", sorted(ROLLOUTS))
def test_rollout_estimate_within_20_percent_of_xla(name):
    r = ROLLOUTS[name]
    cfg, width = r["model"], 16
    lcfg = LoRAConfig(rank=4) if r["lora"] else None
    s = mp.Settings(
        model=cfg,
        prompts=r["prompts"],
        samples=r["samples"],
        kept=r["samples"],
        prompt_width=width,
        max_new_tokens=r["new"],
        sparse=r["sparse"],
        lora=lcfg,
    )
    params = mp.abstract_params(cfg)
    lora = lora_shapes(cfg, lcfg) if lcfg else None
    scfg = SamplingConfig(r["new"], 1, 0, samples_per_prompt=r["samples"])
    prompts = jnp.ones((r["prompts"], width), jnp.int32)
    lengths = jnp.full((r["prompts"],), width - 3)
    lowered = Sampler(_graph(cfg)).lower(
        params, prompts, lengths, jax.random.key(0), scfg, s.spec, lora, chunks=r["chunks"]
    )
    xla = _xla_bytes(lowered.compile())
    est = sum(mp.rollout_program(s, params, lora, r["chunks"]).values())
    assert abs(est / xla - 1) <= TOLERANCE, (est, xla, est / xla)


# Two updates: 2 rows of 1024 tokens in 2 microbatches (6 global layers: the attention
# scores weigh most, as at long context), and 2 rows of 512 tokens of the Gemma-2-style
# model (sliding windows, soft-caps, a 2k vocabulary).
UPDATES = {
    "global_2_microbatches": dict(
        model=C.mini(vocab_size=64).replace(d_model=64, mlp_dim=256, head_dim=16),
        rows=2,
        width=1024,
        microbatches=2,
    ),
    "local_global_softcap": dict(
        model=C.tiny(vocab_size=2048).replace(
            d_model=64, mlp_dim=256, head_dim=16, num_layers=4, sliding_window=64
        ),
        rows=2,
        width=512,
        microbatches=1,
    ),
}


@pytest.mark.parametrize("name", sorted(UPDATES))
def test_update_estimate_within_20_percent_of_xla(name):
    u = UPDATES[name]
    cfg, rows, t = u["model"], u["rows"], u["width"]
    s = mp.Settings(
        model=cfg,
        prompts=rows,
        samples=1,
        kept=1,
        prompt_width=16,
        max_new_tokens=t - 16,
        microbatches=u["microbatches"],
    )
    tx = _tx()
    params = mp.abstract_params(cfg)
    opt_state = jax.eval_shape(tx.init, params)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    batch = {
        "tokens": jax.ShapeDtypeStruct((rows, t), jnp.int32),
        "mask": f32(rows, t),
        "old_logp": f32(rows, t),
        "adv": f32(rows),
    }
    settings = GRPOSettings(microbatches=u["microbatches"])
    lowered = grpo_update.lower(
        params, opt_state, batch, graphdef=_graph(cfg), tx=tx, settings=settings
    )
    xla = _xla_bytes(lowered.compile())
    est = sum(mp.update_program(s, params, opt_state, rows, AttentionSpec()).values())
    assert abs(est / xla - 1) <= TOLERANCE, (est, xla, est / xla)


def test_phi_update_estimate_within_20_percent_of_xla():
    """phi's step: the actor's twin (sparse layers on the recorded pages) with phi."""
    from dsparse_jax.attention.selection import PageRecord
    from dsparse_jax.model.transformer import sparse_layers
    from dsparse_jax.train.distill import DistillSettings, phi_update

    cfg = C.mini(vocab_size=64).replace(d_model=64, mlp_dim=256, head_dim=16, num_layers=4)
    rows, width = 2, 16
    lcfg = LoRAConfig(rank=4)
    s = mp.Settings(
        model=cfg,
        prompts=rows,
        samples=1,
        kept=1,
        prompt_width=width,
        max_new_tokens=512 - width,
        sparse=SparseSpec(budget=8, dense_layers=2),
        lora=lcfg,
        phi_trained=True,
    )
    tx = _tx()
    params = mp.abstract_params(cfg)
    lora = lora_shapes(cfg, lcfg)
    lora_opt = jax.eval_shape(tx.init, lora)
    t, kv, p = s.width, cfg.num_kv_heads, s.sparse.max_pages
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    pages = {
        i: PageRecord(
            jax.ShapeDtypeStruct((rows, t, kv, p), jnp.int32),
            jax.ShapeDtypeStruct((rows, t), jnp.bool_),
            width,
        )
        for i in sparse_layers(cfg, s.spec)
    }
    batch = {
        "tokens": jax.ShapeDtypeStruct((rows, t), jnp.int32),
        "mask": f32(rows, t),
        "rollout_logp": f32(rows, t),
        "teacher_logp": f32(rows, t),
        "adv": f32(rows),
        "pages": pages,
    }
    settings = DistillSettings(spec=s.spec, lora_scale=lcfg.scale)
    lowered = phi_update.lower(
        lora, lora_opt, batch, params, graphdef=_graph(cfg), tx=tx, settings=settings
    )
    xla = _xla_bytes(lowered.compile())
    est = sum(mp.phi_program(s, params, lora, lora_opt, rows).values())
    assert abs(est / xla - 1) <= TOLERANCE, (est, xla, est / xla)


# --------------------------------------------------------------------- chunked rollouts
CHUNK_CFG = C.mini(vocab_size=32).replace(d_model=32, head_dim=8, mlp_dim=64, num_layers=3)
SPARSE = AttentionSpec(
    page_size=4, sparse=SparseSpec(budget=3, dense_layers=1, sink_pages=1, recent_pages=1)
)


@functools.lru_cache(maxsize=None)
def _chunk_setup():
    graphdef, state = random_params(CHUNK_CFG)
    lora = init_lora(CHUNK_CFG, LoRAConfig(rank=2), jax.random.key(3))
    # B != 0: the adapter changes the policy
    lora = jax.tree_util.tree_map_with_path(lambda p, x: x + 0.05 if p[-1].key == "b" else x, lora)
    return Sampler(graphdef), state, lora


@pytest.mark.parametrize("spec", [AttentionSpec(), SPARSE], ids=["dense", "sparse_phi"])
def test_chunked_rollout_equals_unchunked(spec):
    sampler, state, lora = _chunk_setup()
    lora = lora if spec.sparse else None
    rng = np.random.default_rng(0)
    lengths = np.array([7, 3, 5, 1])
    prompts = np.where(np.arange(7) < lengths[:, None], rng.integers(2, 32, (4, 7)), 0)
    cfg = SamplingConfig(40, 1, 0, temperature=1.0, samples_per_prompt=3, top_logprobs=2)
    run = lambda chunks: jax.device_get(
        sampler(state, prompts, lengths, jax.random.key(1), cfg, spec, lora, chunks=chunks)
    )
    whole = run(1)
    assert whole.completion_lengths.max() > 20  # long enough to mean something
    for chunks in (2, 4):
        part = run(chunks)
        for name in ("tokens", "prompt_lengths", "completion_lengths", "completion_mask"):
            np.testing.assert_array_equal(getattr(part, name), getattr(whole, name), name)
        assert part.page_ids.keys() == whole.page_ids.keys()
        for layer in whole.page_ids:
            np.testing.assert_array_equal(part.page_ids[layer], whole.page_ids[layer])
        np.testing.assert_array_equal(part.top_logprobs[1], whole.top_logprobs[1])
        np.testing.assert_allclose(part.logprobs, whole.logprobs, rtol=0, atol=1e-5)
        np.testing.assert_allclose(part.top_logprobs[0], whole.top_logprobs[0], atol=1e-5)


def test_chunked_rollout_on_a_mesh_equals_one_device():
    """On a (2, 2, 2) mesh (tests/conftest.py's 8 CPU devices) each chunk of 2 prompts x 2
    samples is split over the 4 batch shards and the KV heads over tensor; the rollout
    comes back batch-sharded with the single device's tokens and page records."""
    from dsparse_jax.parallel import sharding

    sampler, state, lora = _chunk_setup()
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 8, 8)
    prompts = np.where(np.arange(7) < lengths[:, None], rng.integers(2, 32, (8, 7)), 0)
    cfg = SamplingConfig(30, 1, 0, samples_per_prompt=2)
    one = jax.device_get(sampler(state, prompts, lengths, jax.random.key(2), cfg, SPARSE, lora))
    plan = sharding.MeshPlan(sharding.make_mesh((2, 2, 2)))
    with plan.active():
        out = sampler(
            plan.shard_state(state),
            plan.global_batch(prompts.astype(np.int32)),
            plan.global_batch(lengths.astype(np.int32)),
            jax.random.key(2),
            cfg,
            SPARSE,
            plan.shard_state(lora),
            chunks=4,
        )
    assert out.tokens.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"))
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.tokens, one.tokens)
    for layer in one.page_ids:
        np.testing.assert_array_equal(out.page_ids[layer], one.page_ids[layer])
    np.testing.assert_allclose(out.logprobs, one.logprobs, rtol=0, atol=1e-5)


def test_chunks_must_divide_the_prompts_and_pruning_is_not_chunked():
    sampler, state, _ = _chunk_setup()
    cfg = SamplingConfig(8, 1, 0)
    prompts, lengths = np.ones((4, 3), np.int32), np.full(4, 3)
    with pytest.raises(ValueError, match="chunks=3 must be >= 1 and divide the 4 prompts"):
        sampler.lower(state, prompts, lengths, jax.random.key(0), cfg, chunks=3)
    from dsparse_jax.sampling.pruning import PruneConfig

    prune = PruneConfig(positions=(2,), sizes=(1,), rho=0.5, label_rows=0, layer=-1)
    with pytest.raises(ValueError, match="chunks=1 only"):
        sampler.lower(
            state,
            prompts,
            lengths,
            jax.random.key(0),
            SamplingConfig(8, 1, 0, samples_per_prompt=2),
            prune=prune,
            head={},
            chunks=2,
        )


# -------------------------------------------------------------------------------- plan
def _settings(**kw):
    base = dict(
        model=C.mini(vocab_size=64),
        prompts=8,
        samples=4,
        kept=2,
        prompt_width=32,
        max_new_tokens=480,
        sparse=SparseSpec(budget=6, dense_layers=2),
        lora=LoRAConfig(rank=4),
        phi_trained=True,
        minibatches=2,
    )
    return mp.Settings(**{**base, **kw})


def _plan_inputs(s):
    tx = _tx()
    params = mp.abstract_params(s.model)
    lora = lora_shapes(s.model, s.lora)
    return params, jax.eval_shape(tx.init, params), lora, jax.eval_shape(tx.init, lora)


def _memory_for(limit: float) -> int:
    """The device memory whose plan limit is `limit` bytes."""
    return int(limit / mp.HEADROOM) + 1


def test_plan_takes_the_fewest_chunks_that_fit():
    s = _settings()
    args = _plan_inputs(s)
    peak = {c: mp.estimate(s, *args, chunks=c)[1]["rollout"] for c in mp.chunk_counts(s)}
    assert list(peak) == [1, 2, 4, 8]
    assert all(peak[a] > peak[b] for a, b in zip(list(peak), list(peak)[1:]))
    whole = mp.plan(s, *args, _memory_for(peak[1]), "(test)")
    assert (whole.chunks, whole.chunk_rows) == (1, 32)
    assert "KV cache" in whole.line() and "1 chunk)" in whole.line()
    quarter = mp.plan(s, *args, _memory_for((peak[4] + peak[2]) / 2), "(test)")
    assert (quarter.chunks, quarter.chunk_rows) == (4, 8)
    assert quarter.peaks["rollout"] == peak[4]
    # A mesh of 4 batch shards: chunks of 8 prompts' rows split evenly only (8 / 4 = 2)
    meshed = _settings(mesh=(2, 2, 1))
    assert mp.chunk_counts(meshed) == [1, 2, 4, 8]
    assert mp.chunk_counts(_settings(mesh=(2, 2, 1), samples=2)) == [1, 2, 4]
    # per device: a quarter of the rows, the same weights with fsdp over 2 halved or less
    one, _ = mp.estimate(s, *args, chunks=1)
    four, _ = mp.estimate(meshed, *args, chunks=1)
    assert four["outputs"] == one["outputs"] / 4 and four["kv_chunk"] == one["kv_chunk"] / 4
    assert four["params"] < one["params"] / 1.9


def test_a_config_that_fits_at_no_chunk_size_names_the_field():
    s = _settings()
    args = _plan_inputs(s)
    parts, peaks = mp.estimate(s, *args, chunks=8)  # the smallest chunk
    rows = parts["outputs"] + parts["kv_chunk"] + parts["chunk_work"]
    fixed = peaks["rollout"] - rows
    cases = [
        (s, fixed / 2, "config.mesh.fsdp: "),
        (s, fixed + parts["outputs"] / 2, "config.rl.prompts_per_step: "),
        (s, fixed + parts["outputs"] + 1, "config.data.max_new_tokens: "),
        (_settings(chunk_rows=16), peaks["rollout"], "config.rl.rollout_chunk_rows: "),
        (
            _settings(unchunkable="rl.prune.enabled"),
            peaks["rollout"],
            "config.rl.prompts_per_step: ",
        ),
    ]
    for settings, limit, field in cases:
        with pytest.raises(UserError) as e:
            mp.plan(settings, *args, _memory_for(limit), "(test)")
        msg = str(e.value)
        assert msg.startswith(field) and "\n" not in msg, msg
        assert "at any chunk size" in msg, msg
    # the same smallest chunk fits with one byte more than its peak
    assert mp.plan(s, *args, _memory_for(peaks["rollout"]), "(test)").chunks == 8


def test_estimates_follow_the_model_and_the_cache():
    """Parameters come from the abstract model (every leaf it has), the KV cache from
    attention/cache.py's shapes (summaries of sparse layers included)."""
    cfg = C.mini(vocab_size=64)
    params = mp.abstract_params(cfg)
    assert mp.tree_bytes(params) == 4 * sum(
        x.size for x in jax.tree.leaves(nnx.state(Transformer(cfg, nnx.Rngs(0)), nnx.Param))
    )
    dense = _settings(sparse=None, lora=None, phi_trained=False)
    row = 2 * cfg.num_layers * cfg.num_kv_heads * dense.width * cfg.head_dim * 4
    assert mp.cache_row_bytes(dense, dense.width) == row
    assert mp.cache_row_bytes(_settings(), dense.width) > row  # + page summaries
    # bf16 weights, tensor = 2 splits the MLP and the KV heads (2 of them)
    half = _settings(model=cfg.replace(param_dtype="bfloat16", dtype="bfloat16"))
    assert mp.tree_bytes(mp.abstract_params(half.model)) * 2 == mp.tree_bytes(params)
    split = _settings(sparse=None, lora=None, phi_trained=False, mesh=(1, 1, 2))
    assert mp.cache_row_bytes(split, dense.width) == row / 2
