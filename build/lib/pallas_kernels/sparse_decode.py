"""Pallas TPU block-sparse decode attention.

Matches the plain-JAX reference `dsparse_jax.attention.sparse.sparse_decode_attention`:
one query token per sequence attends to the selected KV pages of its KV head only.

Grid (batch, kv_head, page_step). The selected page ids are scalar-prefetched into SMEM
and drive the K/V BlockSpec index_map, so each grid step DMAs exactly the page(s) it
needs from the [B, K, S, H] cache in HBM; unselected pages are never fetched. Before the
call the ids are sorted (sequential HBM reads) and NO_PAGE slots are replaced by the last
valid id: Pallas does not re-fetch a block whose index did not change, and the kernel
skips their compute. All G query heads of a GQA group form one [G, H] query block, so a
page is read once per group. Online softmax (running max, denominator, accumulator in
VMEM scratch) over the page steps; keys past the query position (partial last page,
ragged lengths) and, for sliding-window layers, outside the window are masked.
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


def _decode_kernel(
    fetch_ref,
    nvalid_ref,
    pos_ref,
    q_ref,
    *refs,
    num_kv: int,
    slots: int,
    pages_per_step: int,
    page_size: int,
    cap: float | None,
    window: int | None,
):
    """One (sequence b, KV head h, page step p): pages_per_step pages into the running
    softmax of the [G, H] query block."""
    k_refs = refs[:pages_per_step]
    v_refs = refs[pages_per_step : 2 * pages_per_step]
    o_ref, m_scr, l_scr, acc_scr = refs[2 * pages_per_step :]
    b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row = b * num_kv + h
    n_valid = nvalid_ref[row]
    pos = pos_ref[b]

    @pl.when(p == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    for j in range(pages_per_step):
        slot = p * pages_per_step + j

        @pl.when(slot < n_valid)
        def _page(j=j, slot=slot):
            page = fetch_ref[row * slots + slot]
            q_GxH = q_ref[...]
            k_SxH = k_refs[j][...]
            s_GxS = jax.lax.dot_general(
                q_GxH, k_SxH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
            )
            s_GxS = softcap(s_GxS, cap)
            key_pos = page * page_size + jax.lax.broadcasted_iota(jnp.int32, s_GxS.shape, 1)
            ok = key_pos <= pos
            if window is not None:
                ok &= pos - key_pos < window
            online_softmax_step(s_GxS, ok, v_refs[j][...], m_scr, l_scr, acc_scr)

    @pl.when(p == pl.num_programs(2) - 1)
    def _finish():
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
    pages_per_step: int = 1,
    interpret: bool | None = None,
):
    """Decode attention over the selected pages (int32 [B, K, P], NO_PAGE = unused slot,
    any order). Same contract as the XLA reference; `interpret=None` picks interpret mode
    off TPU."""
    if interpret is None:
        interpret = default_interpret()
    return _sparse_decode(
        q_BxNxH,
        k_BxKxSxH,
        v_BxKxSxH,
        pos_B,
        page_ids_BxKxP,
        layer=layer,
        page_size=page_size,
        pages_per_step=pages_per_step,
        interpret=interpret,
    )


@functools.partial(jax.jit, static_argnames=("layer", "page_size", "pages_per_step", "interpret"))
def _sparse_decode(
    q_BxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    pos_B,
    page_ids_BxKxP,
    *,
    layer: LayerInfo,
    page_size: int,
    pages_per_step: int,
    interpret: bool,
):
    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    if s % page_size:
        raise ValueError(f"cache length {s} is not a multiple of the page size {page_size}")
    if not interpret:
        check_tpu_page_size(page_size, k_BxKxSxH.dtype)
    p = page_ids_BxKxP.shape[-1]
    steps = pl.cdiv(p, pages_per_step)
    slots = steps * pages_per_step
    fetch_BxKxP, n_valid_BxK = sorted_page_slots(page_ids_BxKxP)
    if slots > p:  # pad with copies of the last fetch id (skipped: slot >= n_valid)
        fetch_BxKxP = jnp.concatenate(
            [fetch_BxKxP, jnp.repeat(fetch_BxKxP[..., -1:], slots - p, axis=-1)], axis=-1
        )
    q_BxKxGxH = q_BxNxH.reshape(b, kv, g, h) * layer.scale  # as the reference

    def q_map(bi, hi, pi, fetch, nvalid, pos):
        return bi, hi, 0, 0

    def kv_map(j):
        def index_map(bi, hi, pi, fetch, nvalid, pos):
            return bi, hi, fetch[(bi * kv + hi) * slots + pi * pages_per_step + j], 0

        return index_map

    page_specs = [
        pl.BlockSpec((SQUEEZED, SQUEEZED, page_size, h), kv_map(j)) for j in range(pages_per_step)
    ]
    q_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, g, h), q_map)
    from jax.experimental.pallas import tpu as pltpu

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, kv, steps),
        in_specs=[q_spec, *page_specs, *page_specs],
        out_specs=q_spec,
        scratch_shapes=[
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, 1), jnp.float32),
            pltpu.VMEM((g, h), jnp.float32),
        ],
    )
    kernel = functools.partial(
        _decode_kernel,
        num_kv=kv,
        slots=slots,
        pages_per_step=pages_per_step,
        page_size=page_size,
        cap=layer.softcap,
        window=layer.window,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, kv, g, h), v_BxKxSxH.dtype),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="sparse_decode_attention",
    )(
        fetch_BxKxP.reshape(-1),
        n_valid_BxK.reshape(-1),
        pos_B.astype(jnp.int32),
        q_BxKxGxH,
        *([k_BxKxSxH] * pages_per_step),
        *([v_BxKxSxH] * pages_per_step),
    )
    return out.reshape(b, n, h)
