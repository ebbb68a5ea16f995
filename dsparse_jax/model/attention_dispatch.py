"""The one attention interface of the model: training/prefill over a sequence, and decode.

The model hands q/k/v (or the cache), positions and a static AttentionSpec; which
implementation runs (XLA reference, Pallas TPU, Triton GPU) and whether decode is sparse
is decided here from the spec, never in the model.

Dispatch by `spec.impl` (see docs/kernels.md):
  xla         the plain-JAX reference everywhere (any platform);
  pallas_tpu  the Pallas kernels for the sparse layers (block-sparse decode, and the
              teacher-forced sparse forward + backward); compiled with Mosaic on TPU,
              run in Pallas interpret mode on any other platform (`interpret` below);
  triton_gpu  the jax-triton split-K decode kernel for sparse decode on GPU; the
              teacher-forced sparse forward uses the XLA reference there (documented
              fallback); needs the GPU extras, else a clear error at trace time;
  auto        by platform: TPU -> pallas_tpu, GPU -> triton_gpu when triton and
              jax-triton import (else xla), anything else (CPU) -> xla.
Dense layers and prefill always use the XLA reference. The kernel modules are imported
on first use, so optional packages never break `import dsparse_jax`.
"""

from __future__ import annotations

import functools

from dsparse_jax.attention import dense, selection, self_draft, sparse
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo, interpret_mode, target_platform


@functools.lru_cache(maxsize=None)
def _gpu_kernels_available() -> bool:
    from pallas_kernels import triton_decode

    return triton_decode.triton_available()


def resolve_impl(impl: str, platform: str | None = None) -> str:
    """The implementation that runs for `impl` on `platform` (default: jax's backend)."""
    if impl != "auto":
        return impl
    platform = platform or target_platform()
    if platform == "tpu":
        return "pallas_tpu"
    if platform == "gpu" and _gpu_kernels_available():
        return "triton_gpu"
    return "xla"


def kernel_shape_error(impl: str, page_size: int, dtype) -> str | None:
    """Why the kernels of `impl` cannot run pages of `page_size` tokens of `dtype` (None if
    they can): config validation reports it before anything is compiled. Only pallas_tpu
    has such a rule (its page tiles); auto resolves to it on TPU only, so it is checked
    where the platform is known, when the kernel is traced."""
    if impl != "pallas_tpu":
        return None
    from pallas_kernels import common

    return common.tpu_page_size_error(page_size, dtype)


def attend_sequence(
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo, spec: AttentionSpec, pages=None
):
    """Causal attention of a right-padded sequence batch over itself.

    pages: None (dense: training, prefill) or this layer's decode record
    (selection.PageRecord) for the teacher-forced sparse forward; it only applies to the
    spec's sparse layers.
    """
    if pages is None or not spec.is_sparse_layer(layer):
        return dense.sequence_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer)
    if resolve_impl(spec.impl) == "pallas_tpu":
        from pallas_kernels import sparse_train

        return sparse_train.sparse_sequence_attention(
            q_BxTxNxH,
            k_BxTxKxH,
            v_BxTxKxH,
            layer,
            pages.page_ids,
            pages.sparse_query,
            spec.page_size,
            interpret=interpret_mode(),
        )
    return sparse.sequence_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer, pages, spec.page_size)


def sparse_decode(
    q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, page_ids_BxKxP, layer: LayerInfo, spec: AttentionSpec
):
    """Block-sparse decode attention over the selected pages, by implementation."""
    impl = resolve_impl(spec.impl)
    if impl == "pallas_tpu":
        from pallas_kernels import paged_decode

        return paged_decode.sparse_decode_attention(
            q_BxNxH,
            k_BxKxSxH,
            v_BxKxSxH,
            pos_B,
            page_ids_BxKxP,
            layer,
            spec.page_size,
            interpret=interpret_mode(),
        )
    if impl == "triton_gpu":
        from pallas_kernels import triton_decode

        return triton_decode.sparse_decode_attention(
            q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, page_ids_BxKxP, layer, spec.page_size
        )
    return sparse.sparse_decode_attention(
        q_BxNxH,
        k_BxKxSxH,
        v_BxKxSxH,
        pos_B,
        page_ids_BxKxP,
        layer,
        spec.page_size,
        spec.sparse.gather_slices,
    )


def attend_decode(q_BxNxH, cache: dict, pos_B, layer: LayerInfo, spec: AttentionSpec):
    """One decode step over the (already written) cache. Returns (out_BxNxH, page_ids)
    where page_ids is int32 [B, K, P] for sparse layers and None for dense ones."""
    if not spec.is_sparse_layer(layer):
        return dense.decode_attention(q_BxNxH, cache["k"], cache["v"], pos_B, layer), None
    b, n, h = q_BxNxH.shape
    kv, s = cache["k"].shape[1], cache["k"].shape[2]
    q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h)
    page_ids = selection.select_pages(
        spec.sparse, cache, q_BxKxGxH, pos_B, spec.page_size, s // spec.page_size
    )
    out = sparse_decode(q_BxNxH, cache["k"], cache["v"], pos_B, page_ids, layer, spec)
    return out, page_ids


def attend_draft(
    q_BxTxNxH,
    k_own_BxTxKxH,
    v_own_BxTxKxH,
    k_base_BxTxKxH,
    v_base_BxTxKxH,
    start_BxT,
    layer: LayerInfo,
    spec: AttentionSpec,
    pages=None,
):
    """The self-speculative drafter's attention, teacher-forced (attention/self_draft.py):
    base keys before each query's draft-block start, its own from there; a sparse layer
    only on its recorded pages. The XLA path on every backend."""
    allowed = None
    if pages is not None and spec.is_sparse_layer(layer):
        t = q_BxTxNxH.shape[1]
        allowed = selection.allowed_key_mask(
            pages.page_ids[:, :t], pages.sparse_query[:, :t], t, spec.page_size
        )
    return self_draft.draft_attention(
        q_BxTxNxH,
        k_own_BxTxKxH,
        v_own_BxTxKxH,
        k_base_BxTxKxH,
        v_base_BxTxKxH,
        start_BxT,
        layer,
        allowed,
    )


def attend_extend(q_BxTxNxH, cache: dict, pos_BxT, layer: LayerInfo, tree=None):
    """T consecutive queries per row (or a token tree's nodes, `dense.Tree`) over the
    (already written) cache, dense (the speculative verifier; no kernel dispatch yet: the
    XLA path on every backend)."""
    return dense.extend_attention(q_BxTxNxH, cache["k"], cache["v"], pos_BxT, layer, tree)
