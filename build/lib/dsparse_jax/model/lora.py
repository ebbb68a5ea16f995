"""LoRA delta tree phi for the sparse rollout policy pi_sparse(theta, phi).

phi is a plain nested dict, separate from theta (the model's nnx.State):

    {layer_index: {name: {"a": A, "b": B}}}     name in q, k, v, o, gate, up, down

which Transformer.forward / prefill / decode take as `lora=` with `lora_scale=alpha / r`;
each targeted linear map computes x.W + (x.A).B * alpha / r, as x.(W + A.B * alpha / r)
in f32 (transformer.linear; the sampler merges once per call, Transformer.merge_lora).
Tensordot convention (as in
transformer.linear): W has shape (in_dims..., out_dims...), A (in_dims..., r) and
B (r, out_dims...). The attention output map `o` contracts two input dims (heads,
head_dim); every other map contracts one.

Initialisation follows the LoRA paper / peft: B = 0, so a fresh adapter leaves the
policy exactly unchanged, and A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (fan_in = product
of the input dims).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.model.config import ModelConfig
from dsparse_jax.model.transformer import ATTN_NAMES, LINEAR_NAMES, MLP_NAMES


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LINEAR_NAMES
    layers: tuple[int, ...] | None = None  # None: every layer

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be >= 1, got {self.rank}")
        if not self.targets:
            raise ValueError("LoRAConfig.targets must name at least one linear map")
        bad = [t for t in self.targets if t not in LINEAR_NAMES]
        if bad:
            raise ValueError(f"LoRAConfig.targets: unknown {bad}; choose from {LINEAR_NAMES}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRAConfig.targets has duplicates: {self.targets}")

    @property
    def scale(self) -> float:
        """The factor on (x.A).B: alpha / r."""
        return float(self.alpha) / self.rank


def parse_targets(spec: str | tuple | list) -> tuple[str, ...]:
    """'q,k,v' or 'all' (every linear map) or 'attn' / 'mlp' -> a tuple of names."""
    if isinstance(spec, (tuple, list)):
        return tuple(spec)
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        out.extend({"all": LINEAR_NAMES, "attn": ATTN_NAMES, "mlp": MLP_NAMES}.get(part, (part,)))
    return tuple(out)


def weight_shape(cfg: ModelConfig, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input dims, output dims) of a linear map of the model."""
    d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    return {
        "q": ((d,), (n, h)),
        "k": ((d,), (k, h)),
        "v": ((d,), (k, h)),
        "o": ((n, h), (d,)),
        "gate": ((d,), (f,)),
        "up": ((d,), (f,)),
        "down": ((f,), (d,)),
    }[name]


def lora_shapes(model_cfg: ModelConfig, lcfg: LoRAConfig, dtype=jnp.float32) -> dict:
    """The delta tree init_lora makes, as jax.ShapeDtypeStructs (nothing allocated)."""
    layers = range(model_cfg.num_layers) if lcfg.layers is None else lcfg.layers
    tree = {}
    for i in layers:
        tree[int(i)] = {}
        for name in lcfg.targets:
            ins, outs = weight_shape(model_cfg, name)
            tree[int(i)][name] = {
                "a": jax.ShapeDtypeStruct(ins + (lcfg.rank,), dtype),
                "b": jax.ShapeDtypeStruct((lcfg.rank,) + outs, dtype),
            }
    return tree


def init_lora(model_cfg: ModelConfig, lcfg: LoRAConfig, key, dtype=jnp.float32) -> dict:
    """A fresh delta tree: B = 0, A uniform in +-1/sqrt(fan_in). Drawn with numpy from the
    key's bits (no per-leaf compiles)."""
    layers = range(model_cfg.num_layers) if lcfg.layers is None else lcfg.layers
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint64).ravel()
    rng = np.random.default_rng(seed.tolist())
    tree = {}
    for i in layers:
        if not 0 <= i < model_cfg.num_layers:
            raise ValueError(f"LoRA layer {i} out of range [0, {model_cfg.num_layers})")
        tree[int(i)] = {}
        for name in lcfg.targets:
            ins, outs = weight_shape(model_cfg, name)
            bound = 1.0 / math.sqrt(math.prod(ins))
            a = rng.uniform(-bound, bound, ins + (lcfg.rank,))
            tree[int(i)][name] = {
                "a": jnp.asarray(a, dtype),
                "b": jnp.zeros((lcfg.rank,) + outs, dtype),
            }
    return tree


def num_params(lora: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(lora))
