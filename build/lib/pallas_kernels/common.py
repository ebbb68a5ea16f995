"""Helpers shared by the kernels: platform checks, interpret mode, page-id preprocessing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# The reference's mask value (finite: masked rows never give NaN) and soft-cap, and the
# dispatcher's interpret-mode rule (Mosaic on TPU, interpret elsewhere): one source each.
from dsparse_jax.attention.dense import MASK_VALUE, softcap  # noqa: F401
from dsparse_jax.attention.selection import NO_PAGE
from dsparse_jax.attention.spec import interpret_mode as default_interpret  # noqa: F401

# A squeezed (size-1, dropped) block dimension; `None` in older Pallas.
SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None


def tpu_page_size_error(page_size: int, dtype) -> str | None:
    """Why the Pallas TPU decode kernels cannot run pages of `page_size` rows of `dtype`
    (None if they can): a page is a (page_size, head_dim) VMEM tile, so page_size must be
    a multiple of the sublane tile, 8 rows of 32 bits (16 for bf16). The one rule behind
    both the kernels' own check and config validation (config/validate.py)."""
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = 8 * max(1, 4 // itemsize)
    if page_size % sublanes:
        return (
            f"the Pallas TPU decode kernels read a page as a ({page_size}, head_dim) tile: on "
            f"TPU page_size must be a multiple of {sublanes} for {jnp.dtype(dtype).name}"
        )
    return None


def check_tpu_page_size(page_size: int, dtype) -> None:
    error = tpu_page_size_error(page_size, dtype)
    if error:
        raise ValueError(error + " (use impl='xla' otherwise)")


def tpu_compiler_params(semantics: tuple[str, ...]):
    """Mosaic compiler params for a grid with these dimension semantics."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics)


def online_softmax_step(s_RxC, ok_RxC, v_CxH, m_scr, l_scr, acc_scr):
    """One flash-attention step: fold the logits s (rows x keys; masked where not ok) and
    the values v into the running max m, normaliser l and unnormalised output acc."""
    s_RxC = jnp.where(ok_RxC, s_RxC, MASK_VALUE)
    m_prev = m_scr[...]
    m_new = jnp.maximum(m_prev, s_RxC.max(axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p_RxC = jnp.where(ok_RxC, jnp.exp(s_RxC - m_new), 0.0)
    l_scr[...] = alpha * l_scr[...] + p_RxC.sum(axis=1, keepdims=True)
    acc_scr[...] = alpha * acc_scr[...] + jax.lax.dot_general(
        p_RxC.astype(v_CxH.dtype),
        v_CxH,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    m_scr[...] = m_new


def sorted_page_slots(page_ids_BxKxP):
    """Per (sequence, KV head): the selected page ids in increasing order with every
    NO_PAGE slot moved last and replaced by the last valid id ("fetch ids": a repeated
    block index is not fetched again), and the number of valid slots.

    Returns (fetch_BxKxP int32, n_valid_BxK int32). A row without any valid page gets
    fetch ids 0 and n_valid 0 (the kernels then compute nothing for it).
    """
    ids = page_ids_BxKxP.astype(jnp.int32)
    valid = ids != NO_PAGE
    big = jnp.iinfo(jnp.int32).max
    ids_sorted = jnp.sort(jnp.where(valid, ids, big), axis=-1)
    n_valid = valid.sum(-1).astype(jnp.int32)
    last = jnp.take_along_axis(ids_sorted, jnp.maximum(n_valid - 1, 0)[..., None], -1)
    slot = jnp.arange(ids.shape[-1], dtype=jnp.int32)
    fetch = jnp.where(slot < n_valid[..., None], ids_sorted, last)
    fetch = jnp.where(n_valid[..., None] > 0, fetch, 0)
    return fetch, n_valid
