"""Shared test helpers: random model weights drawn with numpy (no eager-init compiles),
an attention's output and gradients compiled as one program, a launch/ script as a module,
a run context with some config fields changed."""

import copy
import importlib.util
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.model.transformer import Transformer


def random_params(cfg, seed=0, *, model_cls=Transformer, embed_std=1.0, norm_scale=0.3):
    """(graphdef, state) of `model_cls(cfg)` with N(0, 1/fan_in) weights, embeddings of std
    embed_std / sqrt(d_model), and non-zero norm scales (std norm_scale) so the (1 + scale)
    convention is exercised."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: model_cls(cfg, nnx.Rngs(0))))
    rng = np.random.default_rng(seed)

    def init(path, x):
        name = path[-1].key
        if name == "scale":
            v = rng.normal(size=x.shape) * norm_scale
        elif name == "embed":
            v = rng.normal(size=x.shape) * embed_std / math.sqrt(cfg.d_model)
        else:
            fan_in = x.shape[0] * x.shape[1] if name == "o" else x.shape[0]
            v = rng.normal(size=x.shape) / math.sqrt(fan_in)
        return jnp.asarray(v, x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(init, nnx.to_pure_dict(state)))
    return graphdef, state


def out_and_grads(attention, q, k, v, weight=1.0):
    """(attention(q, k, v) * weight, gradients of sum(sin(that)) by q, k and v), compiled
    as one program: run eagerly, every op of a blocked or vmapped attention is compiled
    and dispatched on its own (hundreds of compiles per test)."""
    f = lambda q, k, v: attention(q, k, v) * weight
    grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1, 2))
    return jax.jit(lambda q, k, v: (f(q, k, v), grads(q, k, v)))(q, k, v)


def load_launch(name: str):
    """launch/<name>.py imported as a module (launch/ is no package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        f"_{name}", os.path.join(root, "launch", f"{name}.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configured(ctx, **fields):
    """A copy of the RunContext `ctx` with config fields set (section__field: rl__draft=...,
    rl__draft_head__unroll=3), validated."""
    from dsparse_jax.config.validate import validate
    from dsparse_jax.train import context

    c = copy.deepcopy(ctx.config)
    for key, v in fields.items():
        *sections, name = key.split("__")
        section = c
        for part in sections:
            section = section[part]
        section[name] = v
    validate(c)
    return context.RunContext(**{**ctx.__dict__, "config": c})
