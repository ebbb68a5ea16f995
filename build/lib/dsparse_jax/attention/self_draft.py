"""Teacher-forced attention of the self-speculative drafter (sampling/speculative.py,
drafter sparse_self): the function the drafter computes, recomputed over a whole rollout.

The drafter has no cache of its own. In the draft block that starts at position c (the
row's last verified token, not yet in the cache), its step at position t >= c reads the
verifier's cache: at positions u < c the dense theta's keys and values (the prompt's
prefill and every verified token), at c <= u <= t its own (theta + phi, written by the
draft steps of this block). So the query at t sees the `base` keys (the dense stream's)
before start[t] and its `own` keys (the draft stream's) from start[t] on, each under the
causal / window mask and, in a sparse layer, only on the pages the drafter recorded.

[T, 2T] scores per query head: the cost of the dense teacher-forced attention, twice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparse_jax.attention.dense import MASK_VALUE, softcap, visible_mask
from dsparse_jax.attention.spec import LayerInfo


def own_key_mask(start_BxT):
    """bool [B, T, T]: key u of query t is the drafter's own (u >= start[t] >= 0); a
    position the drafter never ran (start -1: the prompt) sees only base keys."""
    t = start_BxT.shape[1]
    start = start_BxT[:, :, None]
    return (start >= 0) & (jnp.arange(t)[None, None, :] >= start)


def draft_attention(
    q_BxTxNxH,
    k_own_BxTxKxH,
    v_own_BxTxKxH,
    k_base_BxTxKxH,
    v_base_BxTxKxH,
    start_BxT,
    layer: LayerInfo,
    allowed_BxKxTxT=None,
):
    """Causal attention of the draft stream's queries over base keys before start[t] and
    its own keys from start[t] on. allowed_BxKxTxT: the recorded pages of a sparse layer
    (selection.allowed_key_mask), None in a dense or local layer."""
    b, t, n, h = q_BxTxNxH.shape
    kv = k_own_BxTxKxH.shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv, n // kv, h) * layer.scale

    def scores(k_BxTxKxH):
        logits = jnp.einsum(
            "btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxTxKxH, preferred_element_type=jnp.float32
        )
        return softcap(logits, layer.softcap)

    pos = jnp.arange(t)
    visible_BxTxT = visible_mask(pos[:, None], pos[None, :], layer.window)[None]
    own_BxTxT = own_key_mask(start_BxT)
    base_ok, own_ok = visible_BxTxT & ~own_BxTxT, visible_BxTxT & own_BxTxT
    base_ok, own_ok = base_ok[:, None], own_ok[:, None]  # [B, 1, T, T]
    if allowed_BxKxTxT is not None:
        base_ok, own_ok = base_ok & allowed_BxKxTxT, own_ok & allowed_BxKxTxT
    logits = jnp.concatenate(
        [
            jnp.where(base_ok[:, :, None], scores(k_base_BxTxKxH), MASK_VALUE),
            jnp.where(own_ok[:, :, None], scores(k_own_BxTxKxH), MASK_VALUE),
        ],
        axis=-1,
    )
    probs = jax.nn.softmax(logits, axis=-1).astype(v_own_BxTxKxH.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs[..., :t], v_base_BxTxKxH) + jnp.einsum(
        "bkgts,bskh->btkgh", probs[..., t:], v_own_BxTxKxH
    )
    return out.reshape(b, t, n, h)
