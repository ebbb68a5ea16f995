"""Pure functions for the jitted steps: the optimizer, one update (skipping non-finite
steps), exact microbatch accumulation, and the SFT step. The teacher-forced forward they
differentiate is train/recompute.token_logprobs.

Every [B, S] array is aligned with the token buffer: entry s refers to token s (its
log-prob given tokens < s); entry 0 is 0. Params are an nnx.State that enters jit as an
argument, so new weights never recompile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from dsparse_jax.rl import losses
from dsparse_jax.train.recompute import token_logprobs


def make_optimizer(
    learning_rate: float,
    *,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float,
    max_grad_norm: float,
    b1: float = 0.9,
    b2: float = 0.999,
    schedule: str = "cosine",
):
    """AdamW with linear warmup, then cosine decay (to 10%) or constant; global-norm clip."""
    warmup = optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1))
    if schedule == "cosine":
        after = optax.cosine_decay_schedule(
            learning_rate, max(total_steps - warmup_steps, 1), alpha=0.1
        )
    elif schedule == "constant":
        after = optax.constant_schedule(learning_rate)
    else:
        raise ValueError(f"unknown schedule {schedule!r} (cosine | constant)")
    lr = optax.join_schedules([warmup, after], [warmup_steps])
    return optax.chain(
        optax.clip_by_global_norm(max_grad_norm),
        optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay),
    )


def apply_update(tx, params, opt_state, grads, loss=None):
    """One optimizer step; also returns the gradient's global norm and a finite flag.

    A non-finite gradient (or loss, when given) leaves params and optimizer state
    untouched (the step is skipped; callers count it)."""
    gnorm = optax.tree.norm(grads)
    finite = jnp.isfinite(gnorm)
    if loss is not None:
        finite = finite & jnp.all(jnp.isfinite(loss))
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    return keep(new_params, params), keep(new_opt, opt_state), gnorm, finite


def split_microbatches(mb: dict, n: int) -> dict:
    """[B, ...] arrays -> [n, B / n, ...] (clear error when B is not divisible)."""

    def split(x):
        if x.shape[0] % n:
            raise ValueError(
                f"a batch of {x.shape[0]} rows is not divisible into {n} "
                "equal chunks (rl.minibatches x rl.microbatches)"
            )
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(split, mb)


def accumulated_update(terms_fn, wrt, opt_state, mb: dict, microbatches: int, tx):
    """One optimizer step of `wrt` on a minibatch split into microbatches.

    terms_fn(wrt, microbatch) -> (numerator, (denominator, metric sums)). Gradients of the
    numerators and the denominators are summed over microbatches and divided once, so the
    step equals the full-minibatch step for any microbatch count (up to float rounding).
    Returns (wrt, opt_state, metric sums + grad_norm + skipped)."""
    grad_fn = jax.value_and_grad(terms_fn, has_aux=True)
    micro = split_microbatches(mb, microbatches)

    def body(acc, one):
        (num, (den, m)), grads = grad_fn(wrt, one)
        g_acc, num_acc, den_acc, m_acc = acc
        return (
            jax.tree.map(jnp.add, g_acc, grads),
            num_acc + num,
            den_acc + den,
            jax.tree.map(jnp.add, m_acc, m),
        ), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros_m = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: terms_fn(wrt, first)[1][1]))
    init = (jax.tree.map(jnp.zeros_like, wrt), jnp.float32(0.0), jnp.float32(0.0), zeros_m)
    (g_sum, num, den, m), _ = jax.lax.scan(body, init, micro)
    grads = jax.tree.map(lambda g: g / jnp.maximum(den, 1.0), g_sum)
    wrt, opt_state, gnorm, finite = apply_update(tx, wrt, opt_state, grads, loss=num)
    m["grad_norm"] = gnorm
    m["skipped"] = 1.0 - finite.astype(jnp.float32)
    return wrt, opt_state, m


# ---------------------------------------------------------------------------------- SFT
def sft_loss(params, graphdef, tokens_BxS, mask_BxS):
    logp, _ = token_logprobs(graphdef, params, tokens_BxS)
    num, den = losses.masked_sum_count(-logp, mask_BxS)
    return num / jnp.maximum(den, 1.0), den


@functools.partial(jax.jit, static_argnames=("graphdef", "tx"), donate_argnums=(0, 1))
def sft_step(params, opt_state, tokens_BxS, mask_BxS, *, graphdef, tx):
    (loss, ntok), grads = jax.value_and_grad(sft_loss, has_aux=True)(
        params, graphdef, tokens_BxS, mask_BxS
    )
    params, opt_state, gnorm, finite = apply_update(tx, params, opt_state, grads, loss=loss)
    return (
        params,
        opt_state,
        {
            "loss": loss,
            "grad_norm": gnorm,
            "tokens": ntok,
            "skipped": 1.0 - finite.astype(jnp.float32),
        },
    )
