"""One SPMD program on a device mesh (8 fake CPU devices, tests/conftest.py): a full
distillsparse RL step (rollout, filter, dense recompute, theta update, phi update) on the
meshes (8,1,1), (2,4,1), (2,2,2) matches the single-device step; params, LoRA and both
optimizer states carry the rules' shardings; a sharded checkpoint restores onto another
mesh shape. docs/scaling.md."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from model_utils import random_params
from test_modes import base_config, fake_score

from dsparse_jax.config.validate import validate
from dsparse_jax.parallel import sharding
from dsparse_jax.reliability import checkpoints
from dsparse_jax.sampling.sampler import Sampler
from dsparse_jax.train import context, phases, rl_loop, rl_state, trainables
from dsparse_jax.train.evaluation import Evaluator

# Float tolerance of sharded vs single-device results: f32 reductions (matmuls, softmax
# sums, the gradient all-reduce, the global grad norm) are reordered by the partitioner.
RTOL, ATOL = 1e-4, 1e-5
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]
TIMING = ("time_", "rollout_tokens_per_s")


def mesh_config(shape=(1, 1, 1)):
    c = base_config()
    c.rl.rollout_mode = "distillsparse"
    c.rl.prompts_per_step, c.rl.samples_generated = 8, 3  # 24 rollout rows, 16 kept
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
    validate(c)
    return c


@pytest.fixture(scope="module")
def base_ctx():
    """The tiny model with 2 KV heads (4 query heads, mlp 64, d_model 32: all split by 2;
    the tiny preset's single KV head would stay replicated over tensor)."""
    ctx = context.build(mesh_config())
    model_cfg = ctx.model_cfg.replace(num_kv_heads=2)
    graphdef, params = random_params(model_cfg, seed=1)
    sampler = Sampler(graphdef)
    evaluator = Evaluator(sampler, ctx.tok, ctx.task, ctx.evaluator.problems, ctx.spec)
    return context.RunContext(
        **{
            **ctx.__dict__,
            "model_cfg": model_cfg,
            "graphdef": graphdef,
            "init_params": params,
            "sampler": sampler,
            "evaluator": evaluator,
        }
    )


def _ctx(base_ctx, shape):
    return context.RunContext(**{**base_ctx.__dict__, "config": mesh_config(shape)})


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _trees(st, *names) -> dict:
    """The parameters and optimizer states of the named entries of a TrainState."""
    return {
        f"{name}.{part}": getattr(getattr(st, name), part)
        for name in names
        for part in ("params", "opt_state")
    }


def _one_step(ctx):
    setup = rl_state.make_setup(ctx)
    st = trainables.init_state(ctx, setup, jax.tree.map(jnp.copy, ctx.init_params))
    new, m = phases.rl_step(ctx, setup, st, jax.random.key(7), 0)
    return setup, new, m


@pytest.fixture(scope="module")
def reference(base_ctx):
    mp = pytest.MonkeyPatch()
    mp.setattr(phases, "grade", fake_score)
    setup, st, m = _one_step(base_ctx)
    mp.undo()
    assert setup.plan is None  # mesh 1 x 1 x 1: the unsharded path
    return st, m


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_rl_step_on_mesh_matches_single_device(base_ctx, reference, shape, monkeypatch):
    monkeypatch.setattr(phases, "grade", fake_score)
    ref_st, ref_m = reference
    setup, st, m = _one_step(_ctx(base_ctx, shape))
    mesh = setup.plan.mesh
    assert dict(mesh.shape) == dict(zip(sharding.AXES, shape))
    # Same losses and metrics.
    assert set(m) == set(ref_m)
    for k, v in ref_m.items():
        if k.startswith(TIMING) or (isinstance(v, float) and math.isnan(v)):
            continue
        np.testing.assert_allclose(m[k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    assert ref_m["phi_loss"] != 0 and ref_m["skipped_updates"] == 0
    # Same updated theta, phi and optimizer states.
    want_trees = _trees(ref_st, "theta", "phi")
    for name, tree in _trees(st, "theta", "phi").items():
        got, want = _host(tree), _host(want_trees[name])
        assert len(got) == len(want)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)
    # The state carries the rules' shardings (after two donated, constrained updates).
    _check_state_shardings(st, mesh)


def _p(*axes):
    """PartitionSpec without trailing replicated dims (how the rules write them)."""
    axes = list(axes)
    while axes and axes[-1] is None:
        axes.pop()
    return P(*axes)


def _check_state_shardings(st, mesh):
    d, f, t = (mesh.shape[a] for a in sharding.AXES)
    fsdp = "fsdp" if f > 1 else None
    tp = "tensor" if t > 1 else None
    layer = st.theta.params["layers"][1]
    want = {  # d_model 32, heads 4, KV heads 2, mlp 64: every split divides
        "q": _p(fsdp, tp),
        "k": _p(fsdp, tp),
        "o": _p(tp, None, fsdp),
        "gate": _p(fsdp, tp),
        "down": _p(tp, fsdp),
    }
    for name, spec in want.items():
        sub = layer["attn"] if name in ("q", "k", "o") else layer["mlp"]
        assert sub[name][...].sharding.spec == spec, (name, sub[name][...].sharding)
    assert layer["pre_attn_norm"]["scale"][...].sharding.is_fully_replicated
    # Every leaf of all four trees matches the rule (and is on the whole mesh).
    for tree in _trees(st, "theta", "phi").values():
        specs = sharding.state_specs(tree, mesh)
        for x, spec in zip(
            jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        ):
            assert x.sharding.mesh.shape == mesh.shape
            assert x.sharding.spec == spec, (x.shape, x.sharding.spec, spec)
    # LoRA follows its base weight: a over W's input dims, b over W's output dims.
    q = st.lora[1]["q"]
    assert q["a"].sharding.spec == _p(fsdp)
    assert q["b"].sharding.spec == _p(None, tp)
    # Adam moments follow their parameter.
    mu = st.theta.opt_state[1][0].mu
    assert mu["layers"][1]["mlp"]["gate"][...].sharding.spec == _p(fsdp, tp)


def _dynamic_ctx(base_ctx, shape):
    c = mesh_config(shape)
    c.rl.dynamic_sampling.enabled, c.rl.dynamic_sampling.max_draws = True, 2
    c.rl.overlong.buffer, c.rl.overlong.filter = 4, True
    validate(c)
    return context.RunContext(**{**base_ctx.__dict__, "config": c})


def _first_draw_flat():
    """fake_score, with one reward for every row of a step's first draw (its groups are all
    uninformative: dynamic sampling draws again)."""
    calls = []

    def grade(tok, rollout, problems, rewarder=None, where=""):
        calls.append(where)
        scored, texts = fake_score(tok, rollout, problems, rewarder, where)
        if len(calls) == 1:
            scored = dataclasses.replace(scored, rewards=np.zeros_like(scored.rewards))
        return scored, texts

    return grade


@pytest.mark.slow
def test_dynamic_sampling_on_mesh_matches_single_device(base_ctx, monkeypatch):
    """DAPO's dynamic sampling (a second draw, the merge of 2P groups, the masked rows of
    overlong filtering) on the mesh (2, 2, 2) gives the single-device step."""
    out = []
    for shape in ((1, 1, 1), (2, 2, 2)):
        monkeypatch.setattr(phases, "grade", _first_draw_flat())
        out.append(_one_step(_dynamic_ctx(base_ctx, shape)))
    (_, ref_st, ref_m), (setup, st, m) = out
    assert setup.plan is not None and ref_m["dynamic_draws"] == m["dynamic_draws"] == 2
    for k, v in ref_m.items():
        if k.startswith(TIMING) or (isinstance(v, float) and math.isnan(v)):
            continue
        np.testing.assert_allclose(m[k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    for a, b in zip(_host(st.theta.params), _host(ref_st.theta.params)):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_speculative_draft_head_step_on_mesh(base_ctx, monkeypatch):
    """rollout_mode=speculative with the learned draft head on a (2, 2, 2) mesh: the same
    metrics, theta and head (and its optimizer) as on one device, and the head's weights
    carry the policy's partition rules."""
    monkeypatch.setattr(phases, "grade", fake_score)

    def run(shape):
        c = mesh_config(shape)
        c.rl.rollout_mode, c.rl.draft, c.rl.samples_generated = "speculative", "draft_head", 0
        c.rl.draft_tokens = c.rl.draft_head.unroll = 3
        validate(c)
        return _one_step(context.RunContext(**{**base_ctx.__dict__, "config": c}))

    _, ref_st, ref_m = run((1, 1, 1))
    setup, st, m = run((2, 2, 2))
    for k, v in ref_m.items():
        if k.startswith(TIMING) or (isinstance(v, float) and math.isnan(v)):
            continue
        np.testing.assert_allclose(m[k], v, rtol=RTOL, atol=ATOL, err_msg=k)
    assert ref_m["draft_head_loss_after"] < ref_m["draft_head_loss"]
    want_trees = _trees(ref_st, "theta", "draft_head")
    for name, tree in _trees(st, "theta", "draft_head").items():
        if name == "theta.opt_state":
            continue
        for a, b in zip(_host(tree), _host(want_trees[name])):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=name)
    mesh = setup.plan.mesh
    head = st.draft_head.params
    assert head["block"]["attn"]["q"][...].sharding.spec == _p("fsdp", "tensor")
    assert head["block"]["mlp"]["down"][...].sharding.spec == _p("tensor", "fsdp")
    for tree in _trees(st, "draft_head").values():
        specs = sharding.state_specs(tree, mesh)
        for x, spec in zip(
            jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
        ):
            assert x.sharding.spec == spec, (x.shape, x.sharding.spec, spec)


def test_rules_and_divisibility(base_ctx):
    plan = rl_state.make_setup(_ctx(base_ctx, (2, 2, 2))).plan
    mesh = plan.mesh
    assert sharding.batch_spec(mesh, (8, 5)) == P(("data", "fsdp"))
    assert sharding.batch_spec(mesh, (6, 5)) == P()  # 6 rows on 4 batch shards: replicated
    assert sharding.cache_spec(mesh, (8, 2, 64, 16)) == P(("data", "fsdp"), "tensor")
    assert sharding.cache_spec(mesh, (8, 1, 64, 16)) == P(("data", "fsdp"))  # 1 KV head
    with pytest.raises(ValueError, match="not divisible by the mesh's batch shards"):
        c = mesh_config((8, 1, 1))
        c.rl.prompts_per_step = 4
        rl_state.make_setup(context.RunContext(**{**base_ctx.__dict__, "config": c}))
    with pytest.raises(ValueError, match="3 x 1 x 1 = 3 but there are 8 devices"):
        sharding.mesh_shape({"data": 3, "fsdp": 1, "tensor": 1}, 8)
    assert sharding.mesh_shape({"data": -1, "fsdp": 2, "tensor": 2}, 8) == (2, 2, 2)


def _phi_warm_start(base_ctx, shape, workdir):
    """phi after one warm-start step (distill.row_stride=2: 8 of the 16 kept rows)."""
    from dsparse_jax.report.metrics import MetricsWriter

    c = mesh_config(shape)
    c.distill.warmup_steps, c.distill.row_stride = 1, 2
    validate(c)
    ctx = context.RunContext(**{**base_ctx.__dict__, "config": c})
    setup = rl_state.make_setup(ctx)
    st = trainables.init_state(ctx, setup, jax.tree.map(jnp.copy, ctx.init_params))
    workdir.mkdir()
    writer = MetricsWriter(str(workdir), tensorboard=False)
    st = rl_loop.warm_start_phi(ctx, setup, st, writer)
    writer.close()
    return _host(st.lora)


@pytest.mark.slow
def test_phi_warm_start_with_row_stride_on_mesh_matches_single_device(base_ctx, tmp_path):
    want = _phi_warm_start(base_ctx, (1, 1, 1), tmp_path / "one")
    got = _phi_warm_start(base_ctx, (2, 2, 2), tmp_path / "mesh")
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_sharded_checkpoint_restores_onto_another_mesh(base_ctx, tmp_path):
    a = _ctx(base_ctx, (2, 2, 2))
    setup_a = rl_state.make_setup(a)
    st = trainables.init_state(a, setup_a, jax.tree.map(jnp.copy, a.init_params))
    lora = setup_a.plan.shard_state(jax.tree.map(lambda x: x + 0.5, st.lora))  # B no longer 0
    st.phi = st.phi.replace(lora, st.phi.opt_state)
    ckpt = checkpoints.Checkpointer(str(tmp_path), "ck")
    rng = setup_a.plan.replicate(jax.random.key(3))  # as train_rl places it
    ckpt.save(1, rl_loop._saveable(st, rng, 1, 5), force=True)
    ckpt.wait()
    b = _ctx(base_ctx, (8, 1, 1))  # data-parallel only: params replicated
    setup_b = rl_state.make_setup(b)
    fresh = trainables.init_state(b, setup_b, jax.tree.map(jnp.copy, b.init_params))
    got, rng_b, step = rl_loop._restore(ckpt, 1, fresh, setup_b.plan.replicate(jax.random.key(0)))
    ckpt.close()
    assert step == 1
    np.testing.assert_array_equal(jax.random.key_data(rng_b), jax.random.key_data(rng))
    want_trees = _trees(st, "theta", "phi")
    for name, tree in _trees(got, "theta", "phi").items():
        for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(want_trees[name])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            assert x.sharding.mesh.shape == setup_b.plan.mesh.shape
    _check_state_shardings(got, setup_b.plan.mesh)
    # (2,2,2) placed q as (fsdp, tensor); on (8,1,1) it comes back replicated.
    assert st.theta.params["layers"][1]["attn"]["q"][...].sharding.spec == P("fsdp", "tensor")
    assert got.theta.params["layers"][1]["attn"]["q"][...].sharding.is_fully_replicated


def test_distributed_settings(monkeypatch):
    from dsparse_jax.parallel import distributed

    for var in ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    c = base_config()
    assert distributed.initialize(c) is False  # auto, no coordinator: one process
    c.mesh.distributed = "sometimes"
    with pytest.raises(ValueError, match="config.mesh.distributed"):
        distributed.initialize(c)
    c.mesh.distributed = "off"
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    assert distributed.initialize(c) is False  # off wins over the environment


def test_family_weights_follow_the_rules_on_mesh():
    """Qwen2's q/k/v biases and an untied lm_head are sharded by the rules on (2, 2, 2), and
    a forward on the mesh equals the single-device one (RTOL, ATOL)."""
    from flax import nnx

    from dsparse_jax.model.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        family="qwen2",
        tie_embeddings=False,
    )
    graphdef, params = random_params(cfg, seed=3)
    mesh = sharding.make_mesh((2, 2, 2))
    plan = sharding.MeshPlan(mesh)
    placed = plan.shard_state(params)
    tree = nnx.to_pure_dict(placed)
    assert tree["lm_head"].sharding.spec == P("tensor", "fsdp")
    assert tree["layers"][0]["attn"]["q_bias"].sharding.spec == P("tensor")
    assert tree["layers"][1]["attn"]["k_bias"].sharding.spec == P("tensor")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 12)), jnp.int32)

    def forward(p, t):
        return nnx.merge(graphdef, p).forward(t)

    want = jax.jit(forward)(params, tokens)
    with plan.active():
        got = jax.jit(forward)(placed, plan.shard_batch(tokens))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)
