"""phi's update (the LoRA tree of the DistillSparse actor; speculative sparse_self: of
the drafter), theta frozen.

`phi_update` is one optimizer step of phi:
  L = L_PPO(log pi_sparse, adv; old = rollout log-probs mu)              (distill.loss=ppo+kl)
      + lambda * D(pi_sparse, pi_dense) on the rollout's tokens, teacher detached.
The gradient is taken with respect to the LoRA tree only (theta enters as a plain,
stop-gradient argument, so no gradient of theta is ever formed) and theta is not an
output. Divergences (distill.kl, rl/modes.DISTILL_KL): the sampled estimators k1, k2, k3
(METHOD.md clamps) from the teacher's log-probs in the minibatch (`teacher_logp`: cached
before theta's update or recomputed after it, train/recompute.py); exact_reverse
KL(sparse || dense), exact_forward KL(dense || sparse) and tv over the full vocabulary,
from the teacher's full logits (`recompute.teacher_logits` of `teacher_params` inside the
step: the pre-update theta for distill.teacher=cached, the updated one for recomputed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.parallel import sharding
from dsparse_jax.rl import losses
from dsparse_jax.rl.modes import DISTILL_KL, DISTILL_LOSSES, EXACT_KINDS
from dsparse_jax.train.recompute import teacher_logits, token_logprobs
from dsparse_jax.train.steps import accumulated_update


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Static settings of the phi step (hashable: a jit static argument)."""

    spec: AttentionSpec  # the actor's (sparse) attention
    lora_scale: float
    temperature: float = 1.0
    loss: str = "ppo+kl"  # ppo+kl | kl_only
    kl: str = "k3"  # a key of rl/modes.DISTILL_KL
    kl_coef: float = 1e-3  # lambda
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    microbatches: int = 1
    sampler: str = "actor"  # whose samples the tokens are: actor | dense (speculative)
    teacher: str = "cached"  # cached | recomputed (phases.update_phi)

    def __post_init__(self):
        if self.loss not in DISTILL_LOSSES:
            raise ValueError(f"DistillSettings.loss must be one of {DISTILL_LOSSES}")
        if self.kl not in DISTILL_KL or DISTILL_KL[self.kl].get(self.sampler) is None:
            raise ValueError(
                f"DistillSettings.kl={self.kl!r} on {self.sampler!r} samples: no divergence "
                f"(rl/modes.DISTILL_KL)"
            )

    @property
    def exact(self) -> bool:
        return self.kl in EXACT_KINDS

    @property
    def divergence(self) -> str:
        """The divergence (rl/modes.DIVERGENCES) whose gradient the loss term follows."""
        return DISTILL_KL[self.kl][self.sampler]

    @property
    def value_name(self) -> str:
        """What the logged value of the term is: a sampled estimator's value estimates
        KL(sampler || other) (reverse on the actor's samples, forward on dense ones), an
        exact one is its divergence."""
        if self.exact:
            return self.divergence
        return {"actor": "kl_reverse", "dense": "kl_forward"}[self.sampler] + "_" + self.kl


def _divergence_term(s: DistillSettings, logp, logits, mb: dict, teacher_params, graphdef):
    """Per-token [B, S] divergence between the actor (logp, logits) and the detached
    teacher: over the vocabulary from the teacher's logits, or sampled from its log-probs."""
    if not s.exact:
        sampler = "student" if s.sampler == "actor" else "teacher"
        return losses.sampled_divergence(logp, mb["teacher_logp"], s.kl, sampler)
    t_logits = teacher_logits(
        teacher_params, mb["tokens"], graphdef=graphdef, temperature=s.temperature
    )
    exact = {
        "exact_reverse": losses.reverse_kl,
        "exact_forward": losses.forward_kl,
        "tv": losses.tv_distance,
    }
    return exact[s.kl](logits, t_logits)


def phi_loss_terms(lora, params, graphdef, mb: dict, s: DistillSettings, teacher_params=None):
    """(numerator, (denominator, metric sums)) of the phi loss on one microbatch.

    mb: tokens, mask, adv [B], rollout_logp (mu: the PPO term's old log-probs), pages,
    draft_start (speculative sparse_self: the twin is the drafter, Transformer.forward)
    and teacher_logp (sampled estimators) — or teacher_params (exact divergences)."""
    params = jax.lax.stop_gradient(params)
    logp, _, logits = token_logprobs(
        graphdef,
        params,
        mb["tokens"],
        temperature=s.temperature,
        spec=s.spec,
        pages=mb["pages"],
        lora=lora,
        lora_scale=s.lora_scale,
        draft_start=mb.get("draft_start"),
        with_logits=True,
    )
    mask = mb["mask"]
    if s.loss == "ppo+kl":
        num, den, metrics = losses.policy_loss(
            logp,
            mb["rollout_logp"],
            mb["adv"],
            mask,
            clip_low=s.clip_low,
            clip_high=s.clip_high,
            dual_clip=s.dual_clip,
            agg=s.loss_agg,
        )
    else:
        num, den = losses.aggregate(jnp.zeros_like(logp), mask, s.loss_agg)
        metrics = {"num_tokens": jnp.sum(mask.astype(jnp.float32))}
    div = _divergence_term(s, logp, logits, mb, teacher_params, graphdef)
    div_num, _ = losses.aggregate(div, mask, s.loss_agg)
    metrics["ppo_num"] = jax.lax.stop_gradient(num)
    num = num + s.kl_coef * div_num
    value = losses.masked_sum_count(jax.lax.stop_gradient(div), mask)[0]
    metrics[f"distill_{s.value_name}_sum"] = value
    metrics["loss_num"] = jax.lax.stop_gradient(num)
    metrics["loss_den"] = den
    return num, (den, metrics)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "settings"), donate_argnums=(0, 1))
def phi_update(
    lora,
    opt_state,
    mb: dict,
    params,
    teacher_params=None,
    *,
    graphdef,
    tx,
    settings: DistillSettings,
):
    """One optimizer step of phi on a minibatch (theta frozen, not returned).

    Returns (lora, opt_state, metric sums). Microbatches accumulate exactly, as in
    grpo.grpo_update."""
    if settings.exact and teacher_params is None:
        raise ValueError(f"distill.kl={settings.kl} needs teacher_params")
    terms = lambda phi, one: phi_loss_terms(
        phi, params, graphdef, one, settings, teacher_params
    )  # d/d(phi) only
    mb = sharding.constrain_batch(mb)  # on a mesh: outputs pinned to the rules (sharding.py)
    return sharding.constrain_update(
        accumulated_update(terms, lora, opt_state, mb, settings.microbatches, tx)
    )
