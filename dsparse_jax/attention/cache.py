"""The KV cache, laid out for paging.

Per layer a dict with k and v of shape [batch, kv_heads, max_len, head_dim]: token
position j of a sequence sits at index j (prompts are right-padded, sequences of a batch
are ragged), and page p of one KV head is the contiguous slab [16p, 16p + 16) — what a
block-sparse step reads for one (sequence, KV head). Sparse layers also keep per-page
key summaries (see selection.py), updated on every write so selection never rereads keys.
"""

from __future__ import annotations

import jax.numpy as jnp

from dsparse_jax.attention import selection
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo


def init_layer_cache(
    batch: int,
    kv_heads: int,
    max_len: int,
    head_dim: int,
    dtype,
    layer: LayerInfo,
    spec: AttentionSpec,
) -> dict:
    if max_len % spec.page_size:
        raise ValueError(
            f"cache length {max_len} must be a multiple of the page size {spec.page_size}"
        )
    shape = (batch, kv_heads, max_len, head_dim)
    cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
    if spec.is_sparse_layer(layer):
        num_pages = max_len // spec.page_size
        cache.update(
            selection.init_summaries(
                spec.sparse.policy, batch, kv_heads, num_pages, head_dim, spec.sparse.group_pages
            )
        )
    return cache


def write_prefill(
    cache: dict, k_BxTxKxH, v_BxTxKxH, lengths_B, layer: LayerInfo, spec: AttentionSpec
) -> dict:
    """Writes a right-padded prompt batch at positions [0, T); entries >= length are junk
    that decode overwrites before anything can see them (and summaries ignore them)."""
    k_BxKxTxH = k_BxTxKxH.transpose(0, 2, 1, 3).astype(cache["k"].dtype)
    v_BxKxTxH = v_BxTxKxH.transpose(0, 2, 1, 3).astype(cache["v"].dtype)
    t = k_BxKxTxH.shape[2]
    new = dict(cache)
    new["k"] = cache["k"].at[:, :, :t].set(k_BxKxTxH)
    new["v"] = cache["v"].at[:, :, :t].set(v_BxKxTxH)
    if spec.is_sparse_layer(layer):
        new.update(
            selection.summarize_prefill(
                spec.sparse.policy,
                new,
                k_BxKxTxH,
                lengths_B,
                spec.page_size,
                spec.sparse.group_pages,
            )
        )
    return new


def write_decode(
    cache: dict, k_BxKxH, v_BxKxH, pos_B, layer: LayerInfo, spec: AttentionSpec
) -> dict:
    """Writes one token per sequence at its own position pos_B."""
    rows = jnp.arange(k_BxKxH.shape[0])
    new = dict(cache)
    new["k"] = cache["k"].at[rows, :, pos_B].set(k_BxKxH.astype(cache["k"].dtype))
    new["v"] = cache["v"].at[rows, :, pos_B].set(v_BxKxH.astype(cache["v"].dtype))
    if spec.is_sparse_layer(layer):
        new.update(
            selection.summarize_decode(
                spec.sparse.policy, cache, k_BxKxH, pos_B, spec.page_size, spec.sparse.group_pages
            )
        )
    return new


def write_extend(cache: dict, k_BxTxKxH, v_BxTxKxH, pos_BxT) -> dict:
    """Writes T consecutive tokens per sequence at positions pos_BxT (a speculative
    verify). Keys and values only: positions past the buffer are dropped, and the page
    summaries are left to `refresh_summaries` once the caller knows which positions hold
    accepted tokens."""
    rows = jnp.arange(k_BxTxKxH.shape[0])[:, None]
    new = dict(cache)
    for name, x in (("k", k_BxTxKxH), ("v", v_BxTxKxH)):
        x_BxTxKxH = x.astype(cache[name].dtype)
        new[name] = cache[name].at[rows, :, pos_BxT].set(x_BxTxKxH, mode="drop")
    return new


def move_path(cache: dict, start_B, path_BxT, length_B) -> dict:
    """After a tree verify (`dense.Tree`): the keys and values of the accepted path's nodes
    (path_BxT[b, j]: the node at depth j, written at slot start_B + path) moved to their
    positions start_B + j, for j < length_B. The other slots from start_B on hold rejected
    nodes, which nothing reads (the next extend overwrites them before attending); page
    summaries are left to `refresh_summaries`."""
    b, t = path_BxT.shape
    rows = jnp.arange(b)[:, None]
    j_T = jnp.arange(t)[None]
    dest_BxT = jnp.where(j_T < length_B[:, None], start_B[:, None] + j_T, cache["k"].shape[2])
    new = dict(cache)
    for name in ("k", "v"):
        x_BxTxKxH = cache[name][rows, :, start_B[:, None] + path_BxT]
        new[name] = cache[name].at[rows, :, dest_BxT].set(x_BxTxKxH, mode="drop")
    return new


def refresh_summaries(
    cache: dict, first_pos_B, num_pos: int, length_B, layer: LayerInfo, spec: AttentionSpec
) -> dict:
    """Recomputes the summaries of the pages holding positions [first_pos_B, first_pos_B +
    num_pos) from the keys at positions < length_B: entries a speculative step wrote and
    then rejected leave no trace in page selection."""
    if not spec.is_sparse_layer(layer):
        return cache
    new = dict(cache)
    new.update(
        selection.summarize_pages(
            spec.sparse.policy,
            cache,
            first_pos_B,
            num_pos,
            length_B,
            spec.page_size,
            spec.sparse.group_pages,
        )
    )
    return new


def grow_layer_cache(cache: dict, max_len: int, page_size: int, group_pages: int = 0) -> dict:
    """The same cache in a longer buffer of max_len positions: keys and values padded along
    the position axis, page (group) summaries along the page (group) axis, with the zeros
    init_layer_cache starts from (positions past a sequence's end are never read)."""
    if max_len % page_size:
        raise ValueError(f"cache length {max_len} must be a multiple of the page size {page_size}")
    new = {}
    for name, x in cache.items():
        target = max_len if name in ("k", "v") else max_len // page_size
        if name.endswith(selection.GROUP):
            target = selection.num_groups(target, group_pages)
        if target < x.shape[2]:
            raise ValueError(f"cannot shrink cache entry {name!r} from {x.shape[2]} to {target}")
        new[name] = jnp.pad(x, ((0, 0), (0, 0), (0, target - x.shape[2]), (0, 0)))
    return new
