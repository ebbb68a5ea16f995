"""The rollout quality head (ARRoL-style pruning, docs/pruning.md): a small MLP, or a linear
probe, on the policy's residual stream at a generated position, predicting
P(reward = 1 | prefix).

Plain pytrees and pure functions (no nnx module): the head's parameters enter the jitted
sampler as an argument next to the policy's weights, and its update is one jitted step
(train/quality.py). The features are RMS-normalised first (parameter-free), so the head
does not depend on the residual stream's scale, which grows with depth and training.
The design is ours: the paper (arXiv 2603.24840) publishes no head architecture.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class QualityHeadConfig:
    d_model: int
    hidden: int = 64  # 0: a linear probe
    layer: int = -1  # the transformer layer whose output it reads (negative: from the end)


def init_quality_head(cfg: QualityHeadConfig, key) -> dict:
    """{"w1", "b1", "w2", "b2"} (MLP) or {"w2", "b2"} (linear probe); the output layer
    starts at zero, so the untrained head predicts 0.5 for every row."""
    if cfg.hidden:
        w1 = jax.random.normal(key, (cfg.d_model, cfg.hidden), jnp.float32) * cfg.d_model**-0.5
        return {
            "w1": w1,
            "b1": jnp.zeros((cfg.hidden,), jnp.float32),
            "w2": jnp.zeros((cfg.hidden,), jnp.float32),
            "b2": jnp.zeros((), jnp.float32),
        }
    return {"w2": jnp.zeros((cfg.d_model,), jnp.float32), "b2": jnp.zeros((), jnp.float32)}


def quality_logits(head: dict, feats_NxD):
    """Logits of P(reward = 1) [N] from features [N, D] (any leading shape)."""
    x = feats_NxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    if "w1" in head:
        x = jax.nn.gelu(x @ head["w1"] + head["b1"])
    return x @ head["w2"] + head["b2"]


def quality_probs(head: dict, feats_NxD):
    return jax.nn.sigmoid(quality_logits(head, feats_NxD))


def bce_loss(head: dict, feats_NxD, labels_N, weights_N):
    """Weighted binary cross-entropy (mean over the weights) of the head's logits."""
    z = quality_logits(head, feats_NxD)
    per = jnp.maximum(z, 0) - z * labels_N + jnp.log1p(jnp.exp(-jnp.abs(z)))
    return jnp.sum(per * weights_N) / jnp.maximum(jnp.sum(weights_N), 1e-6)
