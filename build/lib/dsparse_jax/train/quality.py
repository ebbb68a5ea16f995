"""Online training of the rollout quality head (model/quality_head.py; docs/pruning.md).

Every RL step the head takes `steps` full-batch Adam steps of weighted BCE on the
features its sampler recorded at each checkpoint of the completed rows (the kept rows
and the label rows), labelled with reward >= 1. Label rows stand for the pruned rows
they were drawn from (weight = pruned rows per label row), so the weighted sample is
the population the head scored. Its own optimizer, checkpointed with the run.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax

from dsparse_jax.model import quality_head


def make_tx(learning_rate: float, max_grad_norm: float = 1.0):
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate))


@functools.partial(jax.jit, static_argnames=("tx", "steps"))
def quality_head_update(head, opt_state, feats_NxD, labels_N, weights_N, *, tx, steps: int):
    """`steps` Adam steps of weighted BCE; returns (head, opt_state, loss before, after)."""
    loss_grad = jax.value_and_grad(quality_head.bce_loss)

    def one(carry, _):
        head, opt_state = carry
        loss, g = loss_grad(head, feats_NxD, labels_N, weights_N)
        updates, opt_state = tx.update(g, opt_state, head)
        return (optax.apply_updates(head, updates), opt_state), loss

    (head, opt_state), losses = jax.lax.scan(one, (head, opt_state), None, length=steps)
    after = quality_head.bce_loss(head, feats_NxD, labels_N, weights_N)
    return head, opt_state, losses[0], after


def training_pairs(record, rewards_B, pad_to: int | None = None):
    """(feats [N, D], labels [N], weights [N], scores [N]) of every (row, checkpoint) a
    completed row was scored at, as numpy; padded with weight-0 rows to `pad_to` (a fixed
    shape: one compile of quality_head_update)."""
    feats = np.asarray(record.feats)
    scored = np.asarray(record.scored)
    b, c, d = feats.shape
    rows, cps = np.nonzero(scored)
    y = (np.asarray(rewards_B)[rows] >= 1.0).astype(np.float32)
    w = np.asarray(record.weight)[rows].astype(np.float32)
    f = feats[rows, cps]
    s = np.asarray(record.scores)[rows, cps]
    if pad_to is not None and pad_to > len(rows):
        extra = pad_to - len(rows)
        f = np.concatenate([f, np.zeros((extra, d), f.dtype)])
        y, w, s = (np.concatenate([a, np.zeros(extra, a.dtype)]) for a in (y, w, s))
    return f, y, w, s


def init(cfg: quality_head.QualityHeadConfig, tx, key):
    head = quality_head.init_quality_head(cfg, key)
    return head, tx.init(head)
