"""Plain-JAX (XLA) attention: the reference every other implementation must match.

Layout conventions: a sequence's keys are `k_BxSxKxH` when they come straight from the
projections and `k_BxKxSxH` when they sit in the KV cache (see cache.py). Index j of
either is token position j: sequences are right-padded, so a causal mask by index is
also the padding mask.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsparse_jax.attention.spec import LayerInfo

MASK_VALUE = -2.3819763e38  # large negative, finite in f32 (as in Gemma)


def softcap(x, cap: float | None):
    return x if cap is None else jnp.tanh(x / cap) * cap


def visible_mask(q_pos, k_pos, window: int | None):
    """Causal (and sliding-window) visibility of key positions to query positions."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= q_pos - k_pos < window
    return ok


def _masked_softmax(logits, ok):
    logits = jnp.where(ok, logits.astype(jnp.float32), MASK_VALUE)
    return jax.nn.softmax(logits, axis=-1)


CAUSAL_BLOCK = 128  # queries per block of the causal-skip path


def sequence_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo, allowed_BxKxTxT=None):
    """Causal attention of a whole sequence over itself (training and prefill).

    allowed_BxKxTxT: optional extra per-KV-head mask (the block-sparse twin's prompt block,
    sparse.sequence_attention). Without it, sliding-window layers over sequences of at least
    4 windows are computed in bands (`_banded_local_attention`, [T, 2W] scores instead of
    [T, T]) and sequences of at least 2 blocks in causal blocks (`_causal_block_attention`,
    the fully masked blocks above the diagonal skipped): the same result up to float
    rounding.
    """
    t = q_BxTxNxH.shape[1]
    if allowed_BxKxTxT is None:
        if layer.window is not None and t >= 4 * layer.window:
            return _banded_local_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer)
        if t >= 2 * CAUSAL_BLOCK:
            return _causal_block_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer)
    return _full_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer, allowed_BxKxTxT)


def _full_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo, allowed_BxKxTxT=None):
    """sequence_attention over the full [T, T] score matrix, masked."""
    return _attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer, 0, 0, allowed_BxKxTxT)


def _attend(
    q_BxTqxNxH, k_BxTkxKxH, v_BxTkxKxH, layer: LayerInfo, q_start: int, k_start: int, allowed=None
):
    """Queries at positions q_start + [0, Tq) over keys at k_start + [0, Tk), with the
    causal (and window) mask and the optional allowed_BxKxTqxTk mask."""
    b, tq, n, h = q_BxTqxNxH.shape
    tk, kv = k_BxTkxKxH.shape[1], k_BxTkxKxH.shape[2]
    q_BxTxKxGxH = q_BxTqxNxH.reshape(b, tq, kv, n // kv, h) * layer.scale
    logits = jnp.einsum(
        "btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxTkxKxH, preferred_element_type=jnp.float32
    )
    logits = softcap(logits, layer.softcap)
    q_pos, k_pos = q_start + jnp.arange(tq), k_start + jnp.arange(tk)
    ok = visible_mask(q_pos[:, None], k_pos[None, :], layer.window)[None, None, None]
    if allowed is not None:
        ok = ok & allowed[:, :, None]
    probs = _masked_softmax(logits, ok).astype(v_BxTkxKxH.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxTkxKxH)
    return out.reshape(b, tq, n, h)


def _causal_block_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo):
    """Causal attention in blocks of CAUSAL_BLOCK queries, each over the keys from the
    first one its window can see to its last query: the key blocks above the diagonal,
    fully masked, are never computed ((n + 1) / 2n of the [T, T] work for n blocks,
    0.56 at T = 1008). Unrolled: one pair of products per block."""
    t, w = q_BxTxNxH.shape[1], layer.window
    outs = []
    for s in range(0, t, CAUSAL_BLOCK):
        e = min(s + CAUSAL_BLOCK, t)
        k0 = 0 if w is None else max(0, s - w + 1)
        outs.append(
            _attend(q_BxTxNxH[:, s:e], k_BxTxKxH[:, k0:e], v_BxTxKxH[:, k0:e], layer, s, k0)
        )
    return jnp.concatenate(outs, axis=1)


def _banded_local_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo):
    """Sliding-window attention in blocks of W = window queries: block i sees the keys of
    blocks i-1 and i (every key within the window of its queries), so the scores are
    [T, 2W] instead of [T, T]; the keys outside the window are masked as in
    _full_attention and contribute exactly zero probability."""
    b, t, n, h = q_BxTxNxH.shape
    kv, w = k_BxTxKxH.shape[2], layer.window
    nb = -(-t // w)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, nb * w - t), (0, 0), (0, 0)))
    q = pad(q_BxTxNxH).reshape(b, nb, w, kv, n // kv, h) * layer.scale
    k_BxNBxWxKxH = pad(k_BxTxKxH).reshape(b, nb, w, kv, h)
    v_BxNBxWxKxH = pad(v_BxTxKxH).reshape(b, nb, w, kv, h)
    prev = lambda x: jnp.pad(x, ((0, 0), (1, 0), (0, 0), (0, 0), (0, 0)))[:, :-1]
    k2 = jnp.concatenate([prev(k_BxNBxWxKxH), k_BxNBxWxKxH], axis=2)  # [B, NB, 2W, K, H]
    v2 = jnp.concatenate([prev(v_BxNBxWxKxH), v_BxNBxWxKxH], axis=2)
    logits = jnp.einsum("bnqkgh,bnskh->bnkgqs", q, k2, preferred_element_type=jnp.float32)
    logits = softcap(logits, layer.softcap)
    blk = jnp.arange(nb)[:, None, None]
    q_pos = blk * w + jnp.arange(w)[None, :, None]
    k_pos = (blk - 1) * w + jnp.arange(2 * w)[None, None, :]
    ok = visible_mask(q_pos, k_pos, w) & (k_pos >= 0)  # [NB, W, 2W]
    probs = _masked_softmax(logits, ok[None, :, None, None]).astype(v_BxTxKxH.dtype)
    out = jnp.einsum("bnkgqs,bnskh->bnqkgh", probs, v2)
    return out.reshape(b, nb * w, n, h)[:, :t]


def _window_slice(x_BxKxSxH, start_B, size: int):
    """x[b, :, start_B[b] : start_B[b] + size] for every row b: [B, K, size, H]."""
    return jax.vmap(lambda x, s0: jax.lax.dynamic_slice_in_dim(x, s0, size, axis=1))(
        x_BxKxSxH, start_B
    )


def decode_attention(q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, layer: LayerInfo):
    """One decode step: each query at position pos_B attends to cache entries <= pos_B.

    Sliding-window layers read only the `window` cache entries a query can see (a per-row
    slice starting at pos_B - window + 1), not the whole cache: the masked-out entries
    contribute exactly zero probability, so the result is the same up to float rounding.
    The logits are laid out key-major ([B, K, S, G], contracting the cache's minor H axis
    with the cache as the left operand): on XLA:CPU this reads the cache as one
    well-shaped matrix product, about 1.6x faster at long context than [B, K, G, S].
    """
    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    k_pos = jnp.arange(s)[None, :]
    if layer.window is not None and layer.window < s:
        start_B = jnp.clip(pos_B - layer.window + 1, 0, s - layer.window)
        k_BxKxSxH = _window_slice(k_BxKxSxH, start_B, layer.window)
        v_BxKxSxH = _window_slice(v_BxKxSxH, start_B, layer.window)
        k_pos = start_B[:, None] + jnp.arange(layer.window)[None, :]
    q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h) * layer.scale
    logits = jnp.einsum("bksh,bkgh->bksg", k_BxKxSxH, q_BxKxGxH, preferred_element_type=jnp.float32)
    logits = softcap(logits, layer.softcap)
    ok = visible_mask(pos_B[:, None], k_pos, layer.window)[:, None, :, None]
    logits = jnp.where(ok, logits.astype(jnp.float32), MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=2).astype(v_BxKxSxH.dtype)
    out = jnp.einsum("bksg,bksh->bkgh", probs, v_BxKxSxH)
    return out.reshape(b, n, h)


class Tree(NamedTuple):
    """A token tree verified in one extend from slot start_B: node t's keys and values sit
    at slot start_B + t, its position (RoPE, window) is start_B + depth[t], and it sees the
    cache before start_B and the nodes u with ancestor[t, u] (itself included). A chain
    is depth = arange(T), ancestor = lower triangle."""

    depth: jax.Array  # int32 [B, T]
    ancestor: jax.Array  # bool [B, T, T]


def tree_visible(pos_BxT, start_B, tree: Tree, s: int, window: int | None):
    """[B, S, T]: whether cache slot s is visible to tree node t (slots before start_B by
    position, the tree's slots by ancestry; the window on positions either way)."""
    t = pos_BxT.shape[1]
    slot_S = jnp.arange(s)
    rel_BxS = slot_S[None] - start_B[:, None]
    in_tree_BxS = (rel_BxS >= 0) & (rel_BxS < t)
    rel_BxS = jnp.clip(rel_BxS, 0, t - 1)
    anc_BxSxT = jnp.take_along_axis(tree.ancestor.transpose(0, 2, 1), rel_BxS[..., None], 1)
    depth_BxS = jnp.take_along_axis(tree.depth, rel_BxS, 1)
    key_pos_BxS = jnp.where(in_tree_BxS, start_B[:, None] + depth_BxS, slot_S[None])
    before_BxS = slot_S[None] < start_B[:, None]
    ok_BxSxT = jnp.where(in_tree_BxS[..., None], anc_BxSxT, before_BxS[..., None])
    return ok_BxSxT & visible_mask(pos_BxT[:, None, :], key_pos_BxS[..., None], window)


def extend_attention(
    q_BxTxNxH, k_BxKxSxH, v_BxKxSxH, pos_BxT, layer: LayerInfo, tree: Tree | None = None
):
    """T consecutive queries per row against the (already written) cache: the query at
    pos_BxT[b, t] attends to cache entries <= its position (and inside the window of a
    sliding-window layer). The multi-token step a speculative verify runs; with T = 1 it
    is decode_attention over the whole buffer (equal up to float rounding). The T queries
    join the GQA group axis, so the logits keep decode_attention's key-major layout
    ([B, K, S, T * G]; 1.7x faster on XLA:CPU than [B, K, T, G, S] at T = 5).
    tree: the T queries are a token tree's nodes from slot pos_BxT[:, 0] on (`Tree`)."""
    b, t, n, h = q_BxTxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    q_BxKxTGxH = q_BxTxNxH.reshape(b, t, kv, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * g, h)
    logits = jnp.einsum(
        "bksh,bkgh->bksg", k_BxKxSxH, q_BxKxTGxH * layer.scale, preferred_element_type=jnp.float32
    )
    logits = softcap(logits, layer.softcap)
    if tree is None:
        ok_BxSxT = visible_mask(pos_BxT[:, None, :], jnp.arange(s)[None, :, None], layer.window)
    else:
        ok_BxSxT = tree_visible(pos_BxT, pos_BxT[:, 0], tree, s, layer.window)
    ok = jnp.repeat(ok_BxSxT, g, axis=2)[:, None]  # [B, 1, S, T * G]
    logits = jnp.where(ok, logits.astype(jnp.float32), MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=2).astype(v_BxKxSxH.dtype)
    out = jnp.einsum("bksg,bksh->bkgh", probs, v_BxKxSxH)
    return out.reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
