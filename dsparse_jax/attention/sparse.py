"""Plain-JAX block-sparse decode attention: gather the selected pages, attend to them.

The reference for the Pallas/Triton kernels. Reads only len(page_ids) pages of the cache
per (sequence, KV head), so its cost follows the budget, not the context length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparse_jax.attention.dense import MASK_VALUE, softcap
from dsparse_jax.attention.selection import NO_PAGE
from dsparse_jax.attention.spec import LayerInfo


def gather_pages(x_BxKxSxH, page_ids_BxKxP, page_size: int):
  """[B, K, P, page_size, H] slabs of the cache at the given page ids (NO_PAGE -> page 0)."""
  b, kv, s, h = x_BxKxSxH.shape
  pages = x_BxKxSxH.reshape(b, kv, s // page_size, page_size, h)
  ids = jnp.maximum(page_ids_BxKxP, 0)[..., None, None]
  return jnp.take_along_axis(pages, ids, axis=2)


def sparse_decode_attention(q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, page_ids_BxKxP,
                            layer: LayerInfo, page_size: int):
  """Decode attention restricted to the selected pages (global layers: no window)."""
  b, n, h = q_BxNxH.shape
  kv = k_BxKxSxH.shape[1]
  q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h) * layer.scale
  k_BxKxPxSxH = gather_pages(k_BxKxSxH, page_ids_BxKxP, page_size)
  v_BxKxPxSxH = gather_pages(v_BxKxSxH, page_ids_BxKxP, page_size)
  logits = jnp.einsum("bkgh,bkpsh->bkgps", q_BxKxGxH, k_BxKxPxSxH,
                      preferred_element_type=jnp.float32)
  logits = softcap(logits, layer.softcap)
  key_pos = page_ids_BxKxP[..., None] * page_size + jnp.arange(page_size)  # [B, K, P, S]
  ok = (page_ids_BxKxP[..., None] != NO_PAGE) & (key_pos <= pos_B[:, None, None, None])
  logits = jnp.where(ok[:, :, None], logits, MASK_VALUE)
  p = logits.shape[3] * page_size
  probs = jax.nn.softmax(logits.reshape(b, kv, n // kv, p), axis=-1)
  probs = probs.reshape(logits.shape).astype(v_BxKxSxH.dtype)
  out = jnp.einsum("bkgps,bkpsh->bkgh", probs, v_BxKxPxSxH)
  return out.reshape(b, n, h)
