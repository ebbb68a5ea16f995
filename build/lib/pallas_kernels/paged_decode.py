"""Pallas TPU block-sparse decode attention that moves many pages per step (manual DMA).

Same contract as `dsparse_jax.attention.sparse.sparse_decode_attention` and as
`sparse_decode.py`, which fetches one page per grid step through a BlockSpec (a DMA of a
few KiB each, far below HBM bandwidth). Here, as in jax's ragged / paged attention TPU
kernels, the K/V cache stays in HBM (memory_space=ANY) and the kernel issues its own
async copies:

- grid (batch, kv_head); one grid step walks all selected pages of its (sequence, KV
  head) in groups of `pages_per_step` pages: a loop over cdiv(n_valid, pages_per_step)
  groups, so slots past the valid pages are never fetched;
- each group is `pages_per_step` page copies for K and as many for V into one
  [pages_per_step * page_size, H] VMEM buffer each; two buffers (double buffering): the
  copies of group i + 1 are started before group i is waited for and computed;
- ids are sorted first (sequential HBM addresses) with NO_PAGE slots moved last and
  replaced by the last valid id (`common.sorted_page_slots`): the last group may copy a
  page twice, its duplicates are masked out of the softmax;
- the G query heads of a GQA group are one [G, H] block, online softmax in f32 VMEM
  scratch (running max, denominator, accumulator), masks as in sparse_decode.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsparse_jax.attention.spec import LayerInfo
from pallas_kernels.common import (
    MASK_VALUE,
    SQUEEZED,
    check_tpu_page_size,
    default_interpret,
    online_softmax_step,
    softcap,
    sorted_page_slots,
    tpu_compiler_params,
)

DEFAULT_PAGES_PER_STEP = 8  # 8 pages of 16 rows: a [128, H] tile per copy group


def _copies(fetch_ref, k_hbm, v_hbm, k_buf, v_buf, sem, b, h, base, buf, pages, page_size):
    """The async copies of one group: K and V of the pages at fetch slots base.. into
    buffer `buf` (K copies signal sem[0, buf], V copies sem[1, buf])."""
    from jax.experimental.pallas import tpu as pltpu

    out = []
    for j in range(pages):
        start = pl.multiple_of(fetch_ref[base + j] * page_size, page_size)
        rows_src, rows_dst = pl.ds(start, page_size), pl.ds(j * page_size, page_size)
        out.append(
            pltpu.make_async_copy(k_hbm.at[b, h, rows_src], k_buf.at[buf, rows_dst], sem.at[0, buf])
        )
        out.append(
            pltpu.make_async_copy(v_hbm.at[b, h, rows_src], v_buf.at[buf, rows_dst], sem.at[1, buf])
        )
    return out


def _kernel(
    fetch_ref,
    nvalid_ref,
    pos_ref,
    q_ref,
    k_hbm,
    v_hbm,
    o_ref,
    k_buf,
    v_buf,
    sem,
    m_scr,
    l_scr,
    acc_scr,
    *,
    num_kv: int,
    slots: int,
    pages: int,
    page_size: int,
    cap: float | None,
    window: int | None,
):
    """One (sequence b, KV head h): every selected page, `pages` per loop step."""
    b, h = pl.program_id(0), pl.program_id(1)
    row = b * num_kv + h
    n_valid = nvalid_ref[row]
    pos = pos_ref[b]
    n_groups = jax.lax.div(n_valid + pages - 1, pages)  # n_valid >= 0: no sign fix-up
    copies = functools.partial(
        _copies, fetch_ref, k_hbm, v_hbm, k_buf, v_buf, sem, b, h, page_size=page_size
    )
    m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(n_groups > 0)
    def _first():
        for c in copies(row * slots, 0, pages):
            c.start()

    def group(i, carry):
        buf = jax.lax.rem(i, 2)

        @pl.when(i + 1 < n_groups)
        def _prefetch():
            for c in copies(row * slots + (i + 1) * pages, 1 - buf, pages):
                c.start()

        for c in copies(row * slots + i * pages, buf, pages):
            c.wait()
        s_GxN = jax.lax.dot_general(
            q_ref[...], k_buf[buf], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        s_GxN = softcap(s_GxN, cap)
        # Key position of lane n: page j = n // page_size of the group, row n % page_size.
        lane = jax.lax.broadcasted_iota(jnp.int32, s_GxN.shape, 1)
        key_pos = jnp.zeros_like(lane)
        ok = jnp.zeros(s_GxN.shape, jnp.bool_)
        for j in range(pages):
            page = fetch_ref[row * slots + i * pages + j]
            in_j = (lane >= j * page_size) & (lane < (j + 1) * page_size)
            key_pos = jnp.where(in_j, lane + (page - j) * page_size, key_pos)
            ok = ok | (in_j & (i * pages + j < n_valid))  # the last group's repeats: masked
        ok = ok & (key_pos <= pos)
        if window is not None:
            ok = ok & (pos - key_pos < window)
        online_softmax_step(s_GxN, ok, v_buf[buf], m_scr, l_scr, acc_scr)
        return carry

    jax.lax.fori_loop(0, n_groups, group, 0)
    l = l_scr[...]
    o_ref[...] = (acc_scr[...] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def sparse_decode_attention(
    q_BxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    pos_B,
    page_ids_BxKxP,
    layer: LayerInfo,
    page_size: int,
    *,
    pages_per_step: int = DEFAULT_PAGES_PER_STEP,
    interpret: bool | None = None,
):
    """Decode attention over the selected pages (int32 [B, K, P], NO_PAGE = unused slot,
    any order), `pages_per_step` pages per DMA group. `interpret=None` picks interpret
    mode off TPU."""
    if interpret is None:
        interpret = default_interpret()
    return _decode(
        q_BxNxH,
        k_BxKxSxH,
        v_BxKxSxH,
        pos_B,
        page_ids_BxKxP,
        layer=layer,
        page_size=page_size,
        pages=max(1, min(pages_per_step, page_ids_BxKxP.shape[-1])),
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("layer", "page_size", "pages", "interpret"))
def _decode(
    q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, page_ids_BxKxP, *, layer, page_size, pages, interpret
):
    from jax.experimental.pallas import tpu as pltpu

    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    if s % page_size:
        raise ValueError(f"cache length {s} is not a multiple of the page size {page_size}")
    if not interpret:
        check_tpu_page_size(page_size, k_BxKxSxH.dtype)
    p = page_ids_BxKxP.shape[-1]
    slots = pl.cdiv(p, pages) * pages
    fetch_BxKxP, n_valid_BxK = sorted_page_slots(page_ids_BxKxP)
    if slots > p:  # pad with copies of the last fetch id (masked: slot >= n_valid)
        fetch_BxKxP = jnp.concatenate(
            [fetch_BxKxP, jnp.repeat(fetch_BxKxP[..., -1:], slots - p, axis=-1)], axis=-1
        )
    q_BxKxGxH = q_BxNxH.reshape(b, kv, g, h) * layer.scale  # as the reference
    q_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, g, h), lambda bi, hi, *_: (bi, hi, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    buf = pltpu.VMEM((2, pages * page_size, h), k_BxKxSxH.dtype)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, kv),
        in_specs=[q_spec, hbm, hbm],
        out_specs=q_spec,
        scratch_shapes=[
            buf,
            buf,
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, h), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _kernel,
        num_kv=kv,
        slots=slots,
        pages=pages,
        page_size=page_size,
        cap=layer.softcap,
        window=layer.window,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kv, g, h), v_BxKxSxH.dtype),
        compiler_params=tpu_compiler_params(("parallel", "parallel")),
        interpret=interpret,
        name="paged_sparse_decode_attention",
    )(
        fetch_BxKxP.reshape(-1),
        n_valid_BxK.reshape(-1),
        pos_B.astype(jnp.int32),
        q_BxKxGxH,
        k_BxKxSxH,
        v_BxKxSxH,
    )
    return out.reshape(b, n, h)
