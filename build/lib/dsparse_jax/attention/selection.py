"""Page selection: which KV pages a sparse decode step reads. One source of truth.

The sampler calls `select_pages` at every decode step of every sparse layer and records
the result; the teacher-forced sparse forward turns those recorded ids into a key mask
with `allowed_key_mask`, so training recomputes exactly the distribution the actor
sampled from.

Policies (scores are per (sequence, KV head); the query is averaged over the query heads
of its GQA group):
  centroid:      page centroid c = mean of the page's keys; score = q_mean . c.
  quest:         per-page channel-wise key min m and max M; score = sum_i max(q_i m_i, q_i M_i).
  streaming:     no scores: sink pages plus the most recent pages.
Reserved pages (always read): the first `sink_pages` pages and the `recent_pages` most
recent ones (the current, possibly partial page among them). The budget counts them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dsparse_jax.attention.spec import SparseSpec

NO_PAGE = -1  # padding in page-id arrays (fewer valid pages than slots)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["page_ids", "sparse_query"],
    meta_fields=["dense_prefix"],
)
@dataclasses.dataclass(frozen=True)
class PageRecord:
    """One sparse layer's decode record, what the teacher-forced twin replays.

    page_ids: int32 [B, T, K, P], the pages read by the decode step whose query sits at t.
    sparse_query: bool [B, T], the positions whose query ran as a sparse decode step;
      the others (the prompt, as in the dense prefill) see every page.
    dense_prefix: static; every query at a position >= dense_prefix is sparse or past the
      sequence's end (its output is never used): the sampler's prompt buffer width. The
      twin then attends densely only within the prefix (see sparse.sequence_attention).
      None: unknown, the whole sequence is treated as a prefix.
    """

    page_ids: jax.Array
    sparse_query: jax.Array
    dense_prefix: int | None = None


# ----------------------------------------------------------------------------- summaries
SUMMARY_NAMES = {"centroid": ("ksum",), "quest": ("kmin", "kmax")}  # per scored policy
GROUP = "_group"  # suffix of the group-level summaries (two-level selection)


def num_groups(num_pages: int, group_pages: int) -> int:
    """Groups of group_pages consecutive pages covering num_pages pages (the last may be partial)."""
    return -(-num_pages // group_pages)


def init_summaries(
    policy: str, batch: int, kv_heads: int, num_pages: int, head_dim: int, group_pages: int = 0
) -> dict:
    """Zero summaries of every page; with group_pages > 0 also of every group of pages."""
    names = SUMMARY_NAMES.get(policy, ())
    out = {name: jnp.zeros((batch, kv_heads, num_pages, head_dim), jnp.float32) for name in names}
    if group_pages:
        shape = (batch, kv_heads, num_groups(num_pages, group_pages), head_dim)
        out.update({name + GROUP: jnp.zeros(shape, jnp.float32) for name in names})
    return out


def _page_summaries(policy: str, k_BxKxPxSxH, valid) -> dict:
    """Summaries of whole pages from their keys; `valid` (broadcastable to the keys) masks
    the positions that hold no key yet. A page without keys summarises to zeros."""
    if policy == "centroid":
        return {"ksum": jnp.where(valid, k_BxKxPxSxH, 0).sum(3)}
    any_valid = valid.any(3)
    kmin = jnp.where(valid, k_BxKxPxSxH, jnp.inf).min(3)
    kmax = jnp.where(valid, k_BxKxPxSxH, -jnp.inf).max(3)
    return {"kmin": jnp.where(any_valid, kmin, 0), "kmax": jnp.where(any_valid, kmax, 0)}


def _group_summaries(policy: str, pages: dict, page_ok_BxN, group_pages: int) -> dict:
    """Summaries of groups of group_pages consecutive pages from their pages' summaries
    ([B, K, N, H] each, N a multiple of group_pages); page_ok_BxN marks the pages that hold
    a key. The same reduction as _page_summaries one level up (sum, min, max)."""
    b, kv, n, h = next(iter(pages.values())).shape
    grouped = lambda x: x.reshape(b, kv, n // group_pages, group_pages, h)
    ok = grouped(jnp.broadcast_to(page_ok_BxN[:, None, :, None], (b, kv, n, h)))
    if policy == "centroid":
        return {"ksum" + GROUP: grouped(pages["ksum"]).sum(3)}
    any_ok = ok.any(3)
    kmin = jnp.where(ok, grouped(pages["kmin"]), jnp.inf).min(3)
    kmax = jnp.where(ok, grouped(pages["kmax"]), -jnp.inf).max(3)
    return {"kmin" + GROUP: jnp.where(any_ok, kmin, 0), "kmax" + GROUP: jnp.where(any_ok, kmax, 0)}


def summarize_prefill(
    policy: str, cache: dict, k_BxKxTxH, lengths_B, page_size: int, group_pages: int = 0
) -> dict:
    """Page (and group) summaries of a right-padded prompt batch (positions >= length
    ignored)."""
    if policy == "streaming":
        return {}
    b, kv, t, h = k_BxKxTxH.shape
    pad = -t % (page_size * max(group_pages, 1))
    k = jnp.pad(k_BxKxTxH.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    n = (t + pad) // page_size
    k_BxKxPxSxH = k.reshape(b, kv, n, page_size, h)
    valid = (jnp.arange(t + pad) < lengths_B[:, None]).reshape(b, 1, n, page_size, 1)
    pages = _page_summaries(policy, k_BxKxPxSxH, valid)
    if group_pages:
        page_ok_BxN = jnp.arange(n)[None] * page_size < lengths_B[:, None]
        pages.update(_group_summaries(policy, pages, page_ok_BxN, group_pages))
    out = {}
    for name, x in pages.items():
        m = min(x.shape[2], cache[name].shape[2])  # padding to whole groups can pass the buffer
        out[name] = cache[name].at[:, :, :m].set(x[:, :, :m])
    return out


def summarize_pages(
    policy: str,
    cache: dict,
    first_pos_B,
    num_pos: int,
    length_B,
    page_size: int,
    group_pages: int = 0,
) -> dict:
    """Summaries of the pages (and groups) holding positions [first_pos_B, first_pos_B +
    num_pos), recomputed from the cache's keys at positions < length_B (a speculative
    step's rejected entries dropped). Reads those pages only: O(num_pos) keys per row."""
    if policy == "streaming":
        return {}
    b, kv, s, h = cache["k"].shape
    num_pages = s // page_size
    n = -(-num_pos // page_size) + 1  # pages a run of num_pos positions can touch
    page_BxN = first_pos_B[:, None] // page_size + jnp.arange(n)[None]
    page_BxN = jnp.minimum(page_BxN, num_pages - 1)  # past the buffer: the last page again
    pos_BxNxS = page_BxN[:, :, None] * page_size + jnp.arange(page_size)
    rows = jnp.arange(b)[:, None, None]
    k_BxNxSxKxH = cache["k"][rows, :, pos_BxNxS].astype(jnp.float32)
    k_BxKxNxSxH = k_BxNxSxKxH.transpose(0, 3, 1, 2, 4)
    valid = (pos_BxNxS < length_B[:, None, None])[:, None, :, :, None]
    pages = _page_summaries(policy, k_BxKxNxSxH, valid)
    rows = jnp.arange(b)[:, None]
    out = {
        name: cache[name].at[rows, :, page_BxN].set(x.transpose(0, 2, 1, 3))
        for name, x in pages.items()
    }
    if group_pages:  # the groups of those pages, from the updated page summaries
        span = page_size * group_pages
        m = -(-num_pos // span) + 1
        group_BxM = jnp.minimum(
            first_pos_B[:, None] // span + jnp.arange(m)[None],
            num_groups(num_pages, group_pages) - 1,
        )
        page_BxMG = (group_BxM[:, :, None] * group_pages + jnp.arange(group_pages)).reshape(b, -1)
        page_ok_BxMG = (page_BxMG < num_pages) & (page_BxMG * page_size < length_B[:, None])
        page_BxMG = jnp.minimum(page_BxMG, num_pages - 1)
        members = {name: out[name][rows, :, page_BxMG].transpose(0, 2, 1, 3) for name in pages}
        groups = _group_summaries(policy, members, page_ok_BxMG, group_pages)
        out.update(
            {
                name: cache[name].at[rows, :, group_BxM].set(x.transpose(0, 2, 1, 3))
                for name, x in groups.items()
            }
        )
    return out


def summarize_decode(
    policy: str, cache: dict, k_BxKxH, pos_B, page_size: int, group_pages: int = 0
) -> dict:
    """Adds one key per sequence (at position pos_B) to its page's (and group's) summary."""
    rows = jnp.arange(k_BxKxH.shape[0])
    k = k_BxKxH.astype(jnp.float32)
    levels = [("", page_size)] + ([(GROUP, page_size * group_pages)] if group_pages else [])
    out = {}
    for suffix, span in levels:
        unit_B = pos_B // span
        if policy == "centroid":
            out["ksum" + suffix] = cache["ksum" + suffix].at[rows, :, unit_B].add(k)
        elif policy == "quest":
            first = (pos_B % span == 0)[:, None, None]  # a new page (group) starts: reset
            for name, fold in (("kmin", jnp.minimum), ("kmax", jnp.maximum)):
                old = cache[name + suffix][rows, :, unit_B]
                out[name + suffix] = (
                    cache[name + suffix].at[rows, :, unit_B].set(jnp.where(first, k, fold(old, k)))
                )
    return out


# ----------------------------------------------------------------------------- selection
def budget_for(spec: SparseSpec, context_len_B):
    """Pages to read per sequence for a context of context_len_B tokens."""
    if not spec.budget_schedule:
        return jnp.full_like(context_len_B, spec.budget)
    bounds = jnp.array([b for b, _ in spec.budget_schedule], jnp.int32)
    pages = jnp.array([p for _, p in spec.budget_schedule], jnp.int32)
    idx = jnp.searchsorted(bounds, context_len_B, side="left")
    return pages[jnp.minimum(idx, len(spec.budget_schedule) - 1)]


def _scores(
    policy: str, summaries: dict, q_BxKxH, pos_B, span: int, suffix: str = "", unit_BxKxN=None
):
    """Selection scores (higher = more relevant), [B, K, N] f32, of the units (pages, or
    groups with suffix GROUP) unit_BxKxN (None: every unit, read in place), each covering
    `span` positions. q_BxKxH: the query averaged over its GQA group."""
    names = SUMMARY_NAMES[policy]
    x = {name: summaries[name + suffix] for name in names}
    if unit_BxKxN is not None:  # gather the units' summary rows
        # A unit past the buffer (a partial last group's) reads zeros; the caller masks
        # it (page <= current page), so any value would do. Fill mode, not clip: on
        # XLA:CPU the decode step at 16k ran 1-4% faster in four A/Bs (mixed at 1k and
        # 4k), as with sparse._gather_rows' mode.
        x = {
            name: jnp.take_along_axis(s, unit_BxKxN[..., None], axis=2, mode="fill", fill_value=0)
            for name, s in x.items()
        }
        start = unit_BxKxN * span
    else:
        start = (jnp.arange(x[names[0]].shape[2]) * span)[None, None]
    if policy == "centroid":
        count = jnp.clip(pos_B[:, None, None] + 1 - start, 1, span)  # keys in the unit
        return jnp.einsum("bkh,bknh->bkn", q_BxKxH, x["ksum"]) / count
    # sum_i max(q_i m_i, q_i M_i) with m <= M is sum_i (q_i > 0 ? q_i M_i : q_i m_i):
    # the same products, as two dot products instead of two [B, K, N, H] temporaries.
    return jnp.einsum("bkh,bknh->bkn", jnp.maximum(q_BxKxH, 0.0), x["kmax"]) + jnp.einsum(
        "bkh,bknh->bkn", jnp.minimum(q_BxKxH, 0.0), x["kmin"]
    )


def _reserved(spec: SparseSpec, first_BxKxN, last_BxKxN, cur_B):
    """Units spanning pages [first, last] that hold a reserved page (sink or recent)."""
    cur = cur_B[:, None, None]
    return (first_BxKxN < spec.sink_pages) | (
        (last_BxKxN > cur - spec.recent_pages) & (first_BxKxN <= cur)
    )


def candidate_pages(spec: SparseSpec, summaries: dict, q_BxKxH, pos_B, page_size: int):
    """Two-level selection's first level: the pages of the spec.candidate_groups
    best-scoring groups of spec.group_pages pages, int32 [B, K, candidate_groups *
    group_pages] in increasing page order (so the page level breaks ties as a flat top-k
    does). Groups holding a reserved page always count among them; ids past the buffer
    belong to no existing page (the caller masks them)."""
    g = spec.group_pages
    num = summaries[SUMMARY_NAMES[spec.policy][0] + GROUP].shape[2]
    scores = _scores(spec.policy, summaries, q_BxKxH, pos_B, page_size * g, GROUP)
    first = (jnp.arange(num) * g)[None, None]
    cur_B = pos_B // page_size
    scores = jnp.where(_reserved(spec, first, first + g - 1, cur_B), jnp.inf, scores)
    scores = jnp.where(first <= cur_B[:, None, None], scores, -jnp.inf)
    _, group_BxKxC = jax.lax.top_k(scores, min(spec.candidate_groups, num))
    group_BxKxC = jnp.sort(group_BxKxC, axis=-1)
    b, kv, c = group_BxKxC.shape
    return (group_BxKxC[..., None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(b, kv, c * g)


def select_pages(
    spec: SparseSpec, summaries: dict, q_BxKxGxH, pos_B, page_size: int, num_pages: int
):
    """Page ids read by a decode step whose query sits at position pos_B.

    Returns int32 [B, K, spec.max_pages]: reserved pages first, then the top-scoring ones in
    decreasing score; slots past the budget (or past the number of existing pages) hold
    NO_PAGE. When the budget covers every existing page, every page is selected.
    spec.group_pages > 0: the top-scoring pages among candidate_pages' (two-level
    selection; the same as the flat one when the candidates hold every page).
    """
    kv = q_BxKxGxH.shape[1]
    cur_B = pos_B // page_size
    if spec.policy == "streaming":
        return _streaming_pages(spec, pos_B, page_size, kv, num_pages)
    q_BxKxH = q_BxKxGxH.astype(jnp.float32).mean(2)  # average over the GQA group
    if spec.group_pages:
        page = candidate_pages(spec, summaries, q_BxKxH, pos_B, page_size)
        scores = _scores(spec.policy, summaries, q_BxKxH, pos_B, page_size, unit_BxKxN=page)
    else:
        page = jnp.arange(num_pages)[None, None, :]
        scores = _scores(spec.policy, summaries, q_BxKxH, pos_B, page_size)
    scores = jnp.where(_reserved(spec, page, page, cur_B), jnp.inf, scores)
    scores = jnp.where(page <= cur_B[:, None, None], scores, -jnp.inf)
    k = min(spec.max_pages, scores.shape[-1])
    _, slot_ids = jax.lax.top_k(scores, k)
    ids = slot_ids if not spec.group_pages else jnp.take_along_axis(page, slot_ids, axis=-1)
    n_read = jnp.minimum(budget_for(spec, pos_B + 1), cur_B + 1)  # [B]
    slot = jnp.arange(k)[None, None, :]
    ids = jnp.where(slot < n_read[:, None, None], ids, NO_PAGE).astype(jnp.int32)
    if k < spec.max_pages:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, spec.max_pages - k)), constant_values=NO_PAGE)
    return ids


def _streaming_pages(spec: SparseSpec, pos_B, page_size: int, kv_heads: int, num_pages: int):
    """select_pages for the streaming policy in closed form (no scores, no top_k).

    Streaming ranks the existing pages by index with the reserved ones on top, so the
    top-k order is: the reserved pages in increasing index (sink pages, then the recent
    ones up to the current page), then the other existing pages from the newest down;
    slots past the budget (never past the existing pages) hold NO_PAGE.
    """
    cur = (pos_B // page_size)[:, None]  # [B, 1]
    k = min(spec.max_pages, num_pages)
    slot = jnp.arange(k)[None, :]  # [1, k]
    n_sink = jnp.minimum(spec.sink_pages, cur + 1)  # existing sink pages
    first_recent = jnp.maximum(spec.sink_pages, cur - spec.recent_pages + 1)
    n_reserved = n_sink + jnp.maximum(cur - first_recent + 1, 0)
    ids = jnp.where(
        slot < n_sink,
        slot,
        jnp.where(
            slot < n_reserved,
            first_recent + (slot - n_sink),
            cur - spec.recent_pages - (slot - n_reserved),
        ),
    )
    n_read = jnp.minimum(budget_for(spec, pos_B + 1)[:, None], cur + 1)
    ids = jnp.where(slot < n_read, ids, NO_PAGE).astype(jnp.int32)
    ids = jnp.broadcast_to(ids[:, None, :], (ids.shape[0], kv_heads, k))
    if k < spec.max_pages:
        ids = jnp.pad(ids, ((0, 0), (0, 0), (0, spec.max_pages - k)), constant_values=NO_PAGE)
    return ids


def allowed_key_mask(page_ids_BxTxKxP, sparse_query_BxT, seq_len: int, page_size: int):
    """Teacher-forced twin of a decode step: key j is visible to query i in KV head k iff
    j's page is among the pages recorded for (i, k); queries not flagged sparse (prompt
    positions, as in the dense prefill) see every page. Returns bool [B, K, T, T]
    (the causal mask is applied separately)."""
    num_pages = -(-seq_len // page_size)
    hit = page_ids_BxTxKxP[..., None] == jnp.arange(num_pages)  # [B, T, K, P, NP]
    page_ok_BxTxKxNP = hit.any(3)
    key_ok = jnp.repeat(page_ok_BxTxKxNP, page_size, axis=-1)[..., :seq_len]  # [B, T, K, T]
    key_ok = key_ok | ~sparse_query_BxT[:, :, None, None]
    return key_ok.transpose(0, 2, 1, 3)
