"""The one attention interface of the model: training/prefill over a sequence, and decode.

The model hands q/k/v (or the cache), positions and a static AttentionSpec; which
implementation runs (XLA reference, Pallas TPU, Triton GPU) and whether decode is sparse
is decided here from the spec, never in the model.
"""

from __future__ import annotations

from dsparse_jax.attention import dense, selection, sparse
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo


def attend_sequence(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo,
                    spec: AttentionSpec, pages=None):
  """Causal attention of a right-padded sequence batch over itself.

  pages: None (dense: training, prefill) or this layer's decode record
  (page_ids_BxTxKxP, sparse_query_BxT) for the teacher-forced sparse forward; it only
  applies to the spec's sparse layers.
  """
  allowed = None
  if pages is not None and spec.is_sparse_layer(layer):
    page_ids, sparse_query = pages
    allowed = selection.allowed_key_mask(page_ids, sparse_query, q_BxTxNxH.shape[1],
                                         spec.page_size)
  return dense.sequence_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer, allowed)


def attend_decode(q_BxNxH, cache: dict, pos_B, layer: LayerInfo, spec: AttentionSpec):
  """One decode step over the (already written) cache. Returns (out_BxNxH, page_ids)
  where page_ids is int32 [B, K, P] for sparse layers and None for dense ones."""
  if not spec.is_sparse_layer(layer):
    return dense.decode_attention(q_BxNxH, cache["k"], cache["v"], pos_B, layer), None
  b, n, h = q_BxNxH.shape
  kv, s = cache["k"].shape[1], cache["k"].shape[2]
  q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h)
  page_ids = selection.select_pages(spec.sparse, cache, q_BxKxGxH, pos_B, spec.page_size,
                                    s // spec.page_size)
  out = sparse.sparse_decode_attention(q_BxNxH, cache["k"], cache["v"], pos_B, page_ids,
                                       layer, spec.page_size)
  return out, page_ids
