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
  speculative    dense theta, exactly     dense                              as the draft's
                 (drafts verified)

speculative: the rollout is an exact sample of the dense policy (sampling/speculative.py);
the actor_* properties then describe the drafter (rl.draft, `DRAFTS`): sparse_self drafts
with the sparse + phi actor, whose phi keeps training towards the dense policy (L_PPO +
lambda KL: a higher acceptance rate); history drafts without a model; draft_head with a
learned head on the policy's features, trained online (phase update_draft_head).
"""

from __future__ import annotations

import dataclasses

# The phi update's settings (config distill.*).
KL_KINDS = ("k1", "k2", "k3", "exact_reverse", "exact_forward")
DISTILL_LOSSES = ("ppo+kl", "kl_only")
TEACHERS = ("cached", "recomputed")  # dense log-probs before / after theta's update


@dataclasses.dataclass(frozen=True)
class RolloutMode:
    name: str
    actor_sparse: bool  # the actor decodes with block-sparse attention (config.sparse)
    actor_lora: bool  # the actor applies the LoRA adapter phi
    updates_phi: bool  # phase update_phi trains phi (theta frozen) after theta's update
    trainer_sparse: bool  # the trainer runs the actor's sparse twin on the rollout's pages
    description: str
    speculative: bool = False  # the dense policy verifies the actor's drafts (exact rollout)

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
