"""Plain-JAX (XLA) attention: the reference every other implementation must match.

Layout conventions: a sequence's keys are `k_BxSxKxH` when they come straight from the
projections and `k_BxKxSxH` when they sit in the KV cache (see cache.py). Index j of
either is token position j: sequences are right-padded, so a causal mask by index is
also the padding mask.
"""

from __future__ import annotations

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


def sequence_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo,
                       allowed_BxKxTxT=None):
  """Causal attention of a whole sequence over itself (training and prefill).

  allowed_BxKxTxT: optional extra per-KV-head mask (block-sparse teacher forcing).
  """
  b, t, n, h = q_BxTxNxH.shape
  kv = k_BxTxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv, n // kv, h) * layer.scale
  logits = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxTxKxH,
                      preferred_element_type=jnp.float32)
  logits = softcap(logits, layer.softcap)
  pos = jnp.arange(t)
  ok = visible_mask(pos[:, None], pos[None, :], layer.window)[None, None, None]
  if allowed_BxKxTxT is not None:
    ok = ok & allowed_BxKxTxT[:, :, None]
  probs = _masked_softmax(logits, ok).astype(v_BxTxKxH.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxTxKxH)
  return out.reshape(b, t, n, h)


def decode_attention(q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, layer: LayerInfo):
  """One decode step: each query at position pos_B attends to cache entries <= pos_B."""
  b, n, h = q_BxNxH.shape
  kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
  q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h) * layer.scale
  logits = jnp.einsum("bkgh,bksh->bkgs", q_BxKxGxH, k_BxKxSxH,
                      preferred_element_type=jnp.float32)
  logits = softcap(logits, layer.softcap)
  ok = visible_mask(pos_B[:, None], jnp.arange(s)[None, :], layer.window)[:, None, None]
  probs = _masked_softmax(logits, ok).astype(v_BxKxSxH.dtype)
  out = jnp.einsum("bkgs,bksh->bkgh", probs, v_BxKxSxH)
  return out.reshape(b, n, h)
