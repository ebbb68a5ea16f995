"""The jitted GRPO/PPO update of theta (one minibatch = one optimizer step).

A minibatch is a dict of [B, S] arrays aligned with the token buffer:
  tokens, mask (completion tokens that count), old_logp (trainer log-probs before the
  first update), adv [B], and optionally ref_logp (frozen reference, for the KL term) and
  is_weights (detached off-policy token weights, e.g. TIS) and pages (the rollout's decode
  record, Rollout.pages(): with a sparse `settings.spec` the trainer's forward is the
  teacher-forced sparse twin of the rollout, rl.rollout_mode=sparse_train).
Microbatches accumulate gradients of the loss numerators and divide once by the total
denominator, so any microbatch count gives the same gradient (up to float rounding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.rl import losses
from dsparse_jax.train.steps import apply_update, token_logprobs


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    temperature: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    microbatches: int = 1
    spec: AttentionSpec = AttentionSpec()  # the trainer's attention (dense unless sparse_train)


def loss_terms(params, graphdef, mb: dict, s: GRPOSettings):
    """(numerator, (denominator, metric sums)) of the GRPO loss on one microbatch."""
    logp, entropy = token_logprobs(graphdef, params, mb["tokens"], temperature=s.temperature,
                                   spec=s.spec, pages=mb.get("pages"))
    num, den, metrics = losses.policy_loss(
        logp, mb["old_logp"], mb["adv"], mb["mask"], clip_low=s.clip_low,
        clip_high=s.clip_high, dual_clip=s.dual_clip, token_weights_BxT=mb.get("is_weights"),
        agg=s.loss_agg)
    metrics["entropy_sum"] = losses.masked_sum_count(jax.lax.stop_gradient(entropy),
                                                     mb["mask"])[0]
    if s.kl_coef > 0:
        kl = losses.kl_estimate(logp, mb["ref_logp"], s.kl_kind)
        kl_num, _ = losses.aggregate(kl, mb["mask"], s.loss_agg)
        num = num + s.kl_coef * kl_num
        metrics["kl_ref_sum"] = losses.masked_sum_count(jax.lax.stop_gradient(kl), mb["mask"])[0]
    metrics["pg_num"] = jax.lax.stop_gradient(num)
    metrics["pg_den"] = den
    return num, (den, metrics)


def _split_micro(mb: dict, n: int) -> dict:
    def split(x):
        if x.shape[0] % n:
            raise ValueError(f"minibatch of {x.shape[0]} rows is not divisible into {n} "
                             "microbatches (rl.microbatches)")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])
    return jax.tree.map(split, mb)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "settings"),
                   donate_argnums=(0, 1))
def grpo_update(params, opt_state, mb: dict, *, graphdef, tx, settings: GRPOSettings):
    """One optimizer step on a minibatch. Returns (params, opt_state, metric sums)."""
    grad_fn = jax.grad(loss_terms, has_aux=True)
    micro = _split_micro(mb, settings.microbatches)

    def body(acc, one):
        grads, (den, m) = grad_fn(params, graphdef, one, settings)
        g_acc, den_acc, m_acc = acc
        return (jax.tree.map(jnp.add, g_acc, grads), den_acc + den,
                jax.tree.map(jnp.add, m_acc, m)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros_m = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        lambda: loss_terms(params, graphdef, first, settings)[1][1]))
    init = (jax.tree.map(jnp.zeros_like, params), jnp.float32(0.0), zeros_m)
    (g_sum, den, m), _ = jax.lax.scan(body, init, micro)
    grads = jax.tree.map(lambda g: g / jnp.maximum(den, 1.0), g_sum)
    params, opt_state, gnorm, finite = apply_update(tx, params, opt_state, grads)
    m["grad_norm"] = gnorm
    m["skipped"] = 1.0 - finite.astype(jnp.float32)
    return params, opt_state, m


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "spec"))
def recompute_logprobs(params, tokens_BxS, pages=None, *, graphdef, temperature: float,
                       spec: AttentionSpec = AttentionSpec()):
    """Trainer log-probs (old policy / reference) of a rollout batch, no gradient.
    With a sparse spec and the rollout's pages: the teacher-forced sparse forward."""
    return token_logprobs(graphdef, params, tokens_BxS, temperature=temperature, spec=spec,
                          pages=pages)
