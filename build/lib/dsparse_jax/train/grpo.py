"""The jitted update of theta (one minibatch = one optimizer step): the policy loss the
config names (rl/objectives.POLICY_LOSSES: PPO-clip, GSPO, CISPO).

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

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.parallel import sharding
from dsparse_jax.rl import losses, objectives
from dsparse_jax.train.recompute import token_logprobs
from dsparse_jax.train.steps import accumulated_update


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
    policy_loss: str = "ppo_clip"  # a key of rl/objectives.POLICY_LOSSES; clip_*: its range
    top_k: int = 0  # the rollout's truncation: the trainer's log-probs are of the same one
    top_p: float = 1.0


def loss_terms(params, graphdef, mb: dict, s: GRPOSettings):
    """(numerator, (denominator, metric sums)) of theta's loss on one microbatch: the
    policy loss `s.policy_loss` (rl/objectives.py) [+ kl_coef * KL to the reference]."""
    logp, entropy = token_logprobs(
        graphdef,
        params,
        mb["tokens"],
        temperature=s.temperature,
        spec=s.spec,
        pages=mb.get("pages"),
        top_k=s.top_k,
        top_p=s.top_p,
    )
    num, den, metrics = objectives.POLICY_LOSSES[s.policy_loss].fn(
        logp,
        mb["old_logp"],
        mb["adv"],
        mb["mask"],
        clip_low=s.clip_low,
        clip_high=s.clip_high,
        dual_clip=s.dual_clip,
        token_weights_BxT=mb.get("is_weights"),
        agg=s.loss_agg,
    )
    metrics["entropy_sum"] = losses.masked_sum_count(jax.lax.stop_gradient(entropy), mb["mask"])[0]
    if s.kl_coef > 0:
        kl = losses.kl_estimate(logp, mb["ref_logp"], s.kl_kind)
        kl_num, _ = losses.aggregate(kl, mb["mask"], s.loss_agg)
        num = num + s.kl_coef * kl_num
        metrics["kl_ref_sum"] = losses.masked_sum_count(jax.lax.stop_gradient(kl), mb["mask"])[0]
    metrics["pg_num"] = jax.lax.stop_gradient(num)
    metrics["pg_den"] = den
    return num, (den, metrics)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "settings"), donate_argnums=(0, 1))
def grpo_update(params, opt_state, mb: dict, *, graphdef, tx, settings: GRPOSettings):
    """One optimizer step on a minibatch. Returns (params, opt_state, metric sums)."""
    terms = lambda p, one: loss_terms(p, graphdef, one, settings)
    mb = sharding.constrain_batch(mb)  # on a mesh: outputs pinned to the rules (sharding.py)
    return sharding.constrain_update(
        accumulated_update(terms, params, opt_state, mb, settings.microbatches, tx)
    )
