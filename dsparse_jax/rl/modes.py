"""The rollout modes (config rl.rollout_mode): one table, read by the RL step's phases
(train/phases.py), config validation and the experiment harness.

A mode is a set of properties, never a branch spread over files: which attention the actor
decodes with, whether it applies the LoRA adapter phi, whether phi is trained, and which
attention the trainer's forward (old log-probs and the theta update) uses. Adding a mode
is one entry here plus the code of any phase that is new.

  mode           actor (rollout)          trainer (old logp, theta update)   phi
  dense          dense, theta             dense                              -
  sparse         sparse, theta            dense                              -
  sparse_train   sparse, theta            sparse twin (the rollout's pages)  -
  distillsparse  sparse, theta + phi      dense (no adapter)                 L_PPO + lambda KL
  speculative    dense theta, exactly     dense                              the drafter's
                 (drafts verified)                                           divergence to
                                                                             the verifier

speculative: the rollout is an exact sample of the dense policy (sampling/speculative.py);
the actor_* properties then describe the drafter (rl.draft, `DRAFTS`): sparse_self drafts
with the sparse + phi actor, whose phi is distilled to the verifier (theta after its
update) with a divergence and no PPO term (`PHI_AUTO`, `phi_objective`), on a twin that is
the drafter itself (train/recompute.py); history drafts without a model; draft_head with a
learned head on the policy's features, trained online (phase update_draft_head).
"""

from __future__ import annotations

import dataclasses

# The phi update's settings (config distill.*); "auto" takes the mode's entry of PHI_AUTO.
DISTILL_LOSSES = ("ppo+kl", "kl_only")
TEACHERS = ("cached", "recomputed")  # dense log-probs before / after theta's update

# distill.kl -> the divergence whose gradient it follows in expectation, used as phi's loss,
# on the actor's own samples (distillsparse) and on the dense policy's samples (speculative:
# rollouts are exact dense samples); None: no divergence (refused in that mode). p: dense,
# q: the actor. rl/losses.sampled_divergence derives the sampled rows; exact_* and tv sum
# over the vocabulary and need no sampler.
DIVERGENCES = {
    "kl_reverse": "KL(actor || dense)",
    "kl_forward": "KL(dense || actor)",
    "tv": "1 - sum_v min(p, q): the rejection rate of a draft from the actor",
}
DISTILL_KL = {
    "k1": {"actor": None, "dense": "kl_forward"},  # on its own samples: zero gradient
    "k2": {"actor": "kl_reverse", "dense": None},
    "k3": {"actor": "kl_forward", "dense": "kl_forward"},
    "exact_reverse": {"actor": "kl_reverse", "dense": "kl_reverse"},
    "exact_forward": {"actor": "kl_forward", "dense": "kl_forward"},
    "tv": {"actor": "tv", "dense": "tv"},
}
KL_KINDS = tuple(DISTILL_KL)
EXACT_KINDS = ("exact_reverse", "exact_forward", "tv")  # full-vocabulary: the teacher's logits

# distill.loss / teacher / kl = "auto": per mode that trains phi. distillsparse keeps the
# paper's L_PPO + lambda KL against the cached teacher (METHOD.md); speculative distils the
# drafter to the verifier of the next rollout (theta after its update), for acceptance
# (docs/speculative.md: the default divergence was chosen by measurement).
PHI_AUTO = {
    "distillsparse": {"loss": "ppo+kl", "teacher": "cached", "kl": "k3"},
    "speculative": {"loss": "kl_only", "teacher": "recomputed", "kl": "tv"},
}


@dataclasses.dataclass(frozen=True)
class PhiObjective:
    """What phi's update minimises, resolved from config.distill for a mode."""

    loss: str  # ppo+kl | kl_only
    teacher: str  # cached | recomputed
    kl: str  # a key of DISTILL_KL
    sampler: str  # actor | dense: whose samples the rollout's tokens are
    divergence: str  # a key of DIVERGENCES: what the gradient descends


def kl_kinds_for(sampler: str) -> list[str]:
    """The distill.kl values with a divergence's gradient on `sampler`'s samples."""
    return [k for k, d in DISTILL_KL.items() if d[sampler] is not None]


def phi_objective(mode: "RolloutMode", loss: str, teacher: str, kl: str) -> PhiObjective:
    """phi's objective in `mode` from config.distill (loss, teacher, kl; "auto" allowed).
    Raises ValueError naming the field for a value that is unknown or contradicts the mode."""
    auto = PHI_AUTO["speculative" if mode.speculative else "distillsparse"]
    loss, teacher, kl = (
        auto[f] if v == "auto" else v for f, v in (("loss", loss), ("teacher", teacher), ("kl", kl))
    )
    if loss not in DISTILL_LOSSES:
        raise ValueError(f"config.distill.loss: must be auto or one of {DISTILL_LOSSES}")
    if teacher not in TEACHERS:
        raise ValueError(f"config.distill.teacher: must be auto or one of {TEACHERS}")
    if kl not in DISTILL_KL:
        raise ValueError(f"config.distill.kl: must be auto or one of {KL_KINDS}")
    sampler = "dense" if mode.speculative else "actor"
    divergence = DISTILL_KL[kl][sampler]
    if divergence is None:
        raise ValueError(
            f"config.distill.kl: {kl} on the {sampler} policy's samples "
            f"(rollout_mode={mode.name}) has no divergence's gradient; "
            f"use one of {kl_kinds_for(sampler)}"
        )
    if mode.speculative and loss != "kl_only":
        raise ValueError(
            "config.distill.loss: must be kl_only (or auto) with rollout_mode=speculative: "
            "the drafter is distilled to the verifier, the rollout log-probs are dense"
        )
    if mode.speculative and teacher != "recomputed":
        raise ValueError(
            "config.distill.teacher: must be recomputed (or auto) with rollout_mode="
            "speculative: the drafter serves the next rollout's verifier, theta after its update"
        )
    return PhiObjective(loss, teacher, kl, sampler, divergence)


@dataclasses.dataclass(frozen=True)
class RolloutMode:
    name: str
    actor_sparse: bool  # the actor decodes with block-sparse attention (config.sparse)
    actor_lora: bool  # the actor applies the LoRA adapter phi
    updates_phi: bool  # phase update_phi trains phi (theta frozen) after theta's update
    trainer_sparse: bool  # the trainer runs the actor's sparse twin on the rollout's pages
    description: str
    speculative: bool = False  # the dense policy verifies the actor's drafts (exact rollout)
    # theta's off-policy correction under rl.is_correction=auto (the default): distillsparse
    # weighs the actor's tokens by TIS; without it theta's update on them collapsed both
    # policies (issue 39, docs/miniature.md). naive sparse stays the uncorrected baseline.
    correction: str = "none"

    def __post_init__(self):
        if self.updates_phi and not self.actor_lora:
            raise ValueError(f"mode {self.name}: phi is trained only where the actor uses it")
        if self.trainer_sparse and not self.actor_sparse:
            raise ValueError(f"mode {self.name}: a sparse trainer needs the rollout's pages")

    @property
    def has_twin(self) -> bool:
        """The actor differs from the dense policy, so its teacher-forced twin (sparse
        attention on the recorded pages, + phi) is recomputed for the mismatch metrics."""
        return self.actor_sparse or self.actor_lora

    @property
    def twin_metrics_only(self) -> bool:
        """The twin serves the mismatch figures alone: neither theta's trainer (sparse_train's
        old log-probs) nor phi's training (whose objective its figures measure) reads it, so
        config metrics.twin_every may skip it on some steps."""
        return self.has_twin and not self.trainer_sparse and not self.updates_phi


MODES = {
    m.name: m
    for m in (
        RolloutMode(
            "dense",
            actor_sparse=False,
            actor_lora=False,
            updates_phi=False,
            trainer_sparse=False,
            description="dense rollout, dense training",
        ),
        RolloutMode(
            "sparse",
            actor_sparse=True,
            actor_lora=False,
            updates_phi=False,
            trainer_sparse=False,
            description="sparse rollout + dense training (naive)",
        ),
        RolloutMode(
            "sparse_train",
            actor_sparse=True,
            actor_lora=False,
            updates_phi=False,
            trainer_sparse=True,
            description="sparse rollout + sparse training (trainer on the rollout's pages)",
        ),
        RolloutMode(
            "distillsparse",
            actor_sparse=True,
            actor_lora=True,
            updates_phi=True,
            trainer_sparse=False,
            description="DistillSparse (sparse + LoRA actor, LoRA distillation)",
            correction="tis",
        ),
        RolloutMode(
            "speculative",
            actor_sparse=True,
            actor_lora=True,
            updates_phi=True,
            trainer_sparse=False,
            description="speculative: exact dense rollouts from verified drafts (rl.draft)",
            speculative=True,
        ),
    )
}

# The drafter's properties in the speculative mode (config rl.draft).
DRAFTS = {
    "sparse_self": dict(actor_sparse=True, actor_lora=True, updates_phi=True),
    "history": dict(actor_sparse=False, actor_lora=False, updates_phi=False),
    "draft_head": dict(actor_sparse=False, actor_lora=False, updates_phi=False),
}


CORRECTIONS = ("none", "tis", "mis")  # rl.is_correction; "auto": the mode's `correction`


def correction_for(mode: RolloutMode, setting: str) -> str:
    """theta's correction: rl.is_correction, or with "auto" the mode's."""
    return mode.correction if setting == "auto" else setting


def get(name: str, draft: str = "sparse_self") -> RolloutMode:
    """The mode named `name` (speculative: with the drafter `draft`'s properties); a clear
    error naming the field otherwise."""
    if name not in MODES:
        raise ValueError(f"config.rl.rollout_mode: must be one of {tuple(MODES)}, got {name!r}")
    mode = MODES[name]
    if not mode.speculative:
        return mode
    if draft not in DRAFTS:
        raise ValueError(f"config.rl.draft: must be one of {tuple(DRAFTS)}, got {draft!r}")
    return dataclasses.replace(mode, **DRAFTS[draft])
