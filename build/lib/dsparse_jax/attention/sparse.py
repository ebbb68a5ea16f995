"""Plain-JAX block-sparse attention: gather the selected pages, attend to them.

sparse_decode_attention is one decode step; sequence_attention is its teacher-forced
twin (the same step at every decode position of a sequence, on the recorded pages). The
references for the Pallas/Triton kernels. They read only len(page_ids) pages of the
cache per (sequence, KV head) and query, so their cost follows the budget, not the
context length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsparse_jax.attention import dense, selection
from dsparse_jax.attention.dense import MASK_VALUE, softcap
from dsparse_jax.attention.selection import NO_PAGE, PageRecord
from dsparse_jax.attention.spec import LayerInfo


def _page_rows(page_ids_BxKxP, num_pages: int):
    """Row of each selected page in the cache viewed as [B * K * num_pages, page_size * H]
    (NO_PAGE -> page 0; those slots are masked by the caller)."""
    b, kv, _ = page_ids_BxKxP.shape
    base = (jnp.arange(b * kv, dtype=jnp.int32) * num_pages).reshape(b, kv, 1)
    return base + jnp.maximum(page_ids_BxKxP, 0).astype(jnp.int32)


# The page gather runs as this many independent gathers, each over a slice of the page
# slots (concatenated): XLA:CPU runs one gather on one thread, and independent ops on the
# threads of its pool. The slots axis is never sharded (the batch and KV-head axes can
# be), so the slices need no data movement on a mesh; the output is bitwise the same. The
# teacher-forced twin (the step vmapped over positions, and its gradient) gathers in one
# piece. Why 2, and why not the twin: docs/benchmarks.md, "Page gather over both cores".
GATHER_SLICES = 2


def _gather_rows(x_BxKxSxH, rows_BxKxP, page_size: int, slices: int = 1):
    """The pages at rows_BxKxP as [B, K, P * page_size, H]: one contiguous page_size * H
    row per page (a row gather, in `slices` independent slices of the P slots).

    Rows are in range by construction (_page_rows). The gather runs in FILL_OR_DROP mode
    (a row out of range would read as NaN, never another row's keys): the same values as
    CLIP mode for every in-range row, and on XLA:CPU (jax 0.10.2) the fusion it lowers to
    (the gather under a select) runs 1.6-1.9x faster than CLIP's (a gather under a layout
    copy): K and V of 32 rows x 32 pages, 2.3 -> 1.2 ms at 1k context, 4.2 -> 2.6 ms at 16k
    (issue 22, docs/benchmarks.md)."""
    b, kv, s, h = x_BxKxSxH.shape
    p = rows_BxKxP.shape[-1]
    flat = x_BxKxSxH.reshape(b * kv * (s // page_size), page_size * h)
    dnums = jax.lax.GatherDimensionNumbers(
        offset_dims=(3,), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    parts = [
        jax.lax.gather(
            flat,
            rows[..., None],
            dnums,
            (1, page_size * h),
            mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
        )
        for rows in jnp.array_split(rows_BxKxP, min(slices, p), axis=2)
    ]
    return jnp.concatenate(parts, axis=2).reshape(b, kv, p * page_size, h)


def _sort_rows(rows_BxKxP, ids_BxKxP):
    """rows_BxKxP in increasing order along the slots, ids_BxKxP moved with them; stable
    (tied rows, NO_PAGE and page 0, keep their slot order).

    A sort by rank: slot i goes to position #{j : row_j < row_i, or row_j == row_i and
    j < i}, placed by a one-hot sum: O(P^2) element-wise work per (sequence, KV head), P
    the few dozen slots of a budget. On XLA:CPU (jax 0.10.2) `lax.sort` of the same rows
    ran ~80 us per sparse layer in the decode step at B = 32, the rank sort ~25 us: the
    step 1-6% cheaper at 1k-16k context in 16 of 18 A/B pairs, the same logits bit for
    bit (issue 22, docs/benchmarks.md)."""
    p = rows_BxKxP.shape[-1]
    slot = jnp.arange(p)
    row_i, row_j = rows_BxKxP[..., :, None], rows_BxKxP[..., None, :]
    before_BxKxPxP = (row_j < row_i) | ((row_j == row_i) & (slot[None, :] < slot[:, None]))
    rank_BxKxP = jnp.sum(before_BxKxPxP, axis=-1, dtype=jnp.int32)
    to_BxKxPxP = rank_BxKxP[..., :, None] == slot  # slot i lands at position rank_i

    def place(x_BxKxP):
        return jnp.sum(
            jnp.where(to_BxKxPxP, x_BxKxP[..., :, None], 0), axis=-2, dtype=x_BxKxP.dtype
        )

    return place(rows_BxKxP), place(ids_BxKxP)


def sparse_decode_attention(
    q_BxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    pos_B,
    page_ids_BxKxP,
    layer: LayerInfo,
    page_size: int,
    gather_slices: int | None = None,
):
    """Decode attention restricted to the selected pages (global layers: no window).
    gather_slices: the page gather's slices (None: GATHER_SLICES); the same values either way."""
    slices = GATHER_SLICES if gather_slices is None else gather_slices
    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    p = page_ids_BxKxP.shape[-1]
    q_BxKxGxH = q_BxNxH.reshape(b, kv, n // kv, h) * layer.scale
    # The pages are read in increasing address order (attention over a set of keys does
    # not depend on their order, up to float rounding). Sorting also materialises the row
    # indices: XLA does not fuse the sort (its reductions) into the gathers (checked in
    # the compiled HLO of the step: a fusion of its own), which would otherwise re-derive
    # each page's row (selection masking, NO_PAGE handling) for every gathered element;
    # on XLA:CPU that halves the cost of the two gathers, the largest part of a sparse
    # step at long context.
    rows_BxKxP, ids_BxKxP = _sort_rows(
        _page_rows(page_ids_BxKxP, s // page_size), page_ids_BxKxP.astype(jnp.int32)
    )
    k_BxKxTxH = _gather_rows(k_BxKxSxH, rows_BxKxP, page_size, slices)
    v_BxKxTxH = _gather_rows(v_BxKxSxH, rows_BxKxP, page_size, slices)
    # Key-major product ([T, H] . [H, G] per row, the gathered keys as the left operand, as
    # in dense.decode_attention), then a transpose of the small [T, G] result: on XLA:CPU
    # about 2x faster than contracting into [G, T] directly (in the decode step at B = 32,
    # 512 keys: 0.22-0.40 vs 0.59-0.82 ms per layer).
    logits = jnp.einsum("bkth,bkgh->bktg", k_BxKxTxH, q_BxKxGxH, preferred_element_type=jnp.float32)
    logits = jnp.swapaxes(softcap(logits, layer.softcap), 2, 3)
    key_pos = (ids_BxKxP[..., None] * page_size + jnp.arange(page_size)).reshape(
        b, kv, p * page_size
    )
    ok = jnp.repeat(ids_BxKxP != NO_PAGE, page_size, axis=-1) & (key_pos <= pos_B[:, None, None])
    logits = jnp.where(ok[:, :, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxKxSxH.dtype)
    out = jnp.einsum("bkgt,bkth->bkgh", probs, v_BxKxTxH)
    return out.reshape(b, n, h)


def sequence_attention(
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, layer: LayerInfo, record: PageRecord, page_size: int
):
    """The teacher-forced twin of sparse decode: causal attention of a sequence in which
    every query flagged in record.sparse_query sees only the keys of its recorded pages.

    Queries before record.dense_prefix (the prompt buffer) run as one masked block over
    the prefix's keys (selection.allowed_key_mask: the prompt's own dense attention, plus
    any short-prompt row's first decode steps). Every later query is, by the record's
    contract, a decode step (or past the end): it runs as exactly that decode step,
    sparse_decode_attention over its P recorded pages, vmapped over positions. Memory and
    work past the prefix are O(T * P * page_size) per row and KV head, never [T, T].
    """
    t = q_BxTxNxH.shape[1]
    w = t if record.dense_prefix is None else min(t, record.dense_prefix)
    ids_BxTxKxP, sparse_BxT = record.page_ids, record.sparse_query
    allowed = selection.allowed_key_mask(ids_BxTxKxP[:, :w], sparse_BxT[:, :w], w, page_size)
    head = dense.sequence_attention(
        q_BxTxNxH[:, :w], k_BxTxKxH[:, :w], v_BxTxKxH[:, :w], layer, allowed
    )
    if w == t:
        return head
    pad = ((0, 0), (0, 0), (0, -t % page_size), (0, 0))
    k_BxKxSxH = jnp.pad(k_BxTxKxH.transpose(0, 2, 1, 3), pad)
    v_BxKxSxH = jnp.pad(v_BxTxKxH.transpose(0, 2, 1, 3), pad)
    b = q_BxTxNxH.shape[0]
    pos_TxB = jnp.broadcast_to(jnp.arange(w, t, dtype=jnp.int32)[:, None], (t - w, b))
    step = lambda q_BxNxH, pos_B, ids_BxKxP: sparse_decode_attention(
        q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, ids_BxKxP, layer, page_size, gather_slices=1
    )
    tail = jax.vmap(step, in_axes=(1, 0, 1), out_axes=1)(
        q_BxTxNxH[:, w:], pos_TxB, ids_BxTxKxP[:, w:]
    )
    return jnp.concatenate([head, tail], axis=1)
