"""theta's objective as two tables, read by the select phase (the advantage estimator), the
theta update (the policy loss), config validation and the docs (docs/objectives.md).

An entry is a function plus its settings, never a branch spread over files: config
rl.advantage and rl.policy_loss pick entries by name; adding one is an entry here plus
its function (rl/advantages.py, rl/losses.py).

  rl.advantage     adv of sample i of a group of G rewards r
  grpo             (r_i - mean r) / (std r + eps)            (GRPO, unbiased std)
  dr_grpo          r_i - mean r                              (Dr. GRPO: no std scaling)
  rloo             r_i - mean of the other G - 1 rewards     (RLOO)

  rl.policy_loss   per-token loss (A: the sequence's advantage)          clip range    agg
  ppo_clip         max(-A r_t, -A clip(r_t, 1-lo, 1+hi)) [dual clip]     rl.clip_*     token-mean
  gspo             max(-A s, -A clip(s, 1-lo, 1+hi)), s = exp(mean_t     rl.gspo_clip_*  seq-mean-
                   log r_t): the sequence's ratio, clipped per sequence                token-mean
  cispo            -sg(clip(r_t, 1-lo, 1+hi)) A log pi(y_t)              rl.cispo_clip_* token-mean

"agg" is the entry's paper's aggregation, taken when rl.loss_agg = auto. phi's L_PPO
(train/distill.py) stays PPO-clip, with rl.clip_* (the DistillSparse method).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from dsparse_jax.rl import advantages, losses


@dataclasses.dataclass(frozen=True)
class Advantage:
    """An advantage estimator: fn(rewards_B, group_size) -> adv_B (a prompt's G samples
    contiguous; a group of equal rewards gets exactly 0)."""

    fn: Callable
    description: str


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy loss: fn(logp, old_logp, adv_B, mask, *, clip_low, clip_high, dual_clip,
    token_weights_BxT, agg) -> (num, den, metrics) (rl/losses.py conventions: exact
    minibatch sums)."""

    fn: Callable
    clip: tuple[str, str]  # the config fields rl.<low>, rl.<high> of its clip range
    agg: str  # its paper's aggregation: rl.loss_agg = auto takes it
    dual_clip: bool  # reads rl.dual_clip
    description: str


ADVANTAGES = {
    "grpo": Advantage(
        functools.partial(advantages.grpo_advantages, scale_by_std=True),
        "GRPO: (r - group mean) / (group std + eps)",
    ),
    "dr_grpo": Advantage(
        functools.partial(advantages.grpo_advantages, scale_by_std=False),
        "Dr. GRPO: r - group mean (no std scaling)",
    ),
    "rloo": Advantage(advantages.rloo_advantages, "RLOO: r - mean of the group's other rewards"),
}

POLICY_LOSSES = {
    "ppo_clip": PolicyLoss(
        losses.policy_loss,
        clip=("clip_low", "clip_high"),
        agg="token-mean",
        dual_clip=True,
        description="PPO-clip on the token ratio (clip-higher, dual clip)",
    ),
    "gspo": PolicyLoss(
        losses.gspo_loss,
        clip=("gspo_clip_low", "gspo_clip_high"),
        agg="seq-mean-token-mean",
        dual_clip=False,
        description="GSPO: the length-normalised sequence ratio, clipped per sequence",
    ),
    "cispo": PolicyLoss(
        losses.cispo_loss,
        clip=("cispo_clip_low", "cispo_clip_high"),
        agg="token-mean",
        dual_clip=False,
        description="CISPO: a clipped, detached importance weight on A log pi",
    ),
}


def advantage_name(name: str, scale_adv_by_std: bool = True) -> str:
    """rl.advantage, with the older spelling rl.scale_adv_by_std=False of grpo read as
    dr_grpo. Raises ValueError naming the field for an unknown name or a contradiction."""
    if name not in ADVANTAGES:
        raise ValueError(f"config.rl.advantage: must be one of {tuple(ADVANTAGES)}, got {name!r}")
    if scale_adv_by_std:
        return name
    if name == "rloo":
        raise ValueError(
            "config.rl.scale_adv_by_std: False is Dr. GRPO (rl.advantage=dr_grpo); "
            "rloo has no std scaling: leave it true"
        )
    return "dr_grpo"


def policy_loss(name: str) -> PolicyLoss:
    """The entry named `name`; ValueError naming the field otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(
            f"config.rl.policy_loss: must be one of {tuple(POLICY_LOSSES)}, got {name!r}"
        )
    return POLICY_LOSSES[name]


def loss_agg(agg: str, loss: str) -> str:
    """rl.loss_agg with "auto" resolved to the policy loss's own aggregation."""
    return policy_loss(loss).agg if agg == "auto" else agg
