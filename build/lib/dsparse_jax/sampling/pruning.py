"""Online rollout pruning (ARRoL-style, docs/pruning.md): the static settings, the keep
rule and the row plan the sampler applies at each checkpoint.

At checkpoint c (after `positions[c]` completion tokens) every prompt's group of g rows is
scored by the quality head; `sizes[c]` rows are kept (the keep rule), `label_rows` of the
others are drawn at random to run to completion as unbiased labels for the head, and the
rest stop. The batch is then gathered into P x (sizes[c] + labels so far) rows, a fixed
shape, so decoding after the checkpoint costs what a rollout of that many rows costs.
Per prompt the rows are laid out [kept group | label rows of earlier checkpoints | new
label rows]; after the last checkpoint [n kept | C x label_rows labels].

Pure jnp on static shapes; the sampler calls these inside its jitted program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PruneConfig:
    """Static pruning settings (a jit static argument of the sampler).

    positions: completion-token counts at which rows are scored (increasing, >= 1).
    sizes: rows kept per prompt after each checkpoint (decreasing; the last is the GRPO
      group n); the sampler generates SamplingConfig.samples_per_prompt = M' > sizes[0].
    rho: target fraction of predicted successes among the kept rows (round(rho * n) rows
      from the top of the ranking, the rest from the bottom).
    label_rows: rows per prompt and checkpoint, drawn uniformly from the would-be-pruned
      ones, that run to completion to give the head unbiased labels (not trained on by GRPO).
    layer: the transformer layer whose output the head reads.
    """

    positions: tuple[int, ...]
    sizes: tuple[int, ...]
    rho: float = 0.5
    label_rows: int = 0
    layer: int = -1

    def __post_init__(self):
        if not self.positions or len(self.positions) != len(self.sizes):
            raise ValueError("PruneConfig: one size per checkpoint position")
        if any(p < 1 for p in self.positions) or list(self.positions) != sorted(
            set(self.positions)
        ):
            raise ValueError("PruneConfig.positions must be increasing and >= 1")
        if self.sizes[-1] < 1 or any(a <= b for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError("PruneConfig.sizes must be decreasing and >= 1")
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError("PruneConfig.rho must be in [0, 1]")
        if self.label_rows < 0:
            raise ValueError("PruneConfig.label_rows must be >= 0")

    @property
    def n(self) -> int:
        return self.sizes[-1]

    @property
    def rows_per_prompt(self) -> int:
        """Rows per prompt in the final rollout: n kept + the label rows of every checkpoint."""
        return self.n + len(self.positions) * self.label_rows

    def check(self, generated: int) -> None:
        """M' (rows generated per prompt) fits: more than sizes[0], and every checkpoint
        prunes enough rows for its label rows."""
        groups = (generated,) + self.sizes
        if generated <= self.sizes[0]:
            raise ValueError(
                f"PruneConfig: M' = {generated} must exceed sizes[0] = {self.sizes[0]}"
            )
        for g, k in zip(groups, groups[1:]):
            if g - k < self.label_rows:
                raise ValueError(
                    f"PruneConfig.label_rows = {self.label_rows} exceeds the {g - k} rows "
                    f"pruned from a group of {g} to {k}"
                )


def keep_rule(scores_PxG, ended_PxG, keep: int, rho: float):
    """Rows kept per group, int32 [P, keep] (ascending indices into the group).

    Rows that ended before the checkpoint are kept as they are (they cost nothing more);
    the other slots are filled from both ends of the live rows' ranking by predicted
    success: round(rho * keep - sum of the ended rows' scores) (clipped to the free
    slots) from the top, the rest from the bottom, so that the group's expected success
    count is as close to rho * keep as the ranking allows. If more than `keep` rows
    ended, the same rule picks among the ended ones. Ties: the lower index first.
    """
    return jax.vmap(functools.partial(_keep_one, keep=keep, rho=rho))(scores_PxG, ended_PxG)


def _keep_one(scores_G, ended_G, *, keep: int, rho: float):
    g = scores_G.shape[0]
    scores_G = scores_G.astype(jnp.float32)
    n_ended = jnp.sum(ended_G)
    overflow = n_ended >= keep  # more ended rows than slots: choose among them
    cand = jnp.where(overflow, ended_G, ~ended_G)
    forced = ended_G & ~overflow
    slots = jnp.where(overflow, keep, keep - n_ended)
    base = jnp.where(overflow, 0.0, jnp.sum(jnp.where(forced, scores_G, 0.0)))
    n_top = jnp.clip(jnp.round(rho * keep - base), 0, slots).astype(jnp.int32)
    # Rank of each candidate by descending score (stable: ties by index); others last.
    order = jnp.argsort(jnp.where(cand, -scores_G, jnp.inf), stable=True)
    rank = jnp.zeros((g,), jnp.int32).at[order].set(jnp.arange(g, dtype=jnp.int32))
    n_cand = jnp.sum(cand)
    take = cand & ((rank < n_top) | (rank >= n_cand - (slots - n_top)))
    kept = take | forced
    return jnp.sort(jnp.argsort(~kept, stable=True)[:keep]).astype(jnp.int32)


def label_pick(kept_PxK, group: int, count: int, key):
    """`count` rows per group drawn uniformly from the rows not kept, int32 [P, count]."""
    p = kept_PxK.shape[0]
    is_kept = jnp.zeros((p, group), bool).at[jnp.arange(p)[:, None], kept_PxK].set(True)
    u = jax.random.uniform(key, (p, group))
    return jnp.argsort(jnp.where(is_kept, 2.0, u), axis=1)[:, :count].astype(jnp.int32)


def plan_rows(scores_B, ended_B, prompts: int, group: int, carried: int, keep: int, cfg, key):
    """The gather of one checkpoint: (rows int32 [P * (keep + carried + label_rows)] into
    the current batch, new_label bool [same], label weight (rows pruned per label row)).

    The current batch holds per prompt [group rows | carried label rows]."""
    width = group + carried
    s = scores_B.reshape(prompts, width)[:, :group]
    e = ended_B.reshape(prompts, width)[:, :group]
    kept = keep_rule(s, e, keep, cfg.rho)
    parts = [kept, jnp.broadcast_to(jnp.arange(group, width, dtype=jnp.int32), (prompts, carried))]
    if cfg.label_rows:
        parts.append(label_pick(kept, group, cfg.label_rows, key))
    local = jnp.concatenate(parts, axis=1)
    rows = (jnp.arange(prompts, dtype=jnp.int32)[:, None] * width + local).reshape(-1)
    new_label = jnp.zeros(local.shape, bool).at[:, keep + carried :].set(True).reshape(-1)
    weight = (group - keep) / cfg.label_rows if cfg.label_rows else 0.0
    return rows, new_label, weight
