"""Helpers shared by the kernels: platform checks, interpret mode, page-id preprocessing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsparse_jax.attention.selection import NO_PAGE

# A squeezed (size-1, dropped) block dimension; `None` in older Pallas.
SQUEEZED = pl.Squeezed() if hasattr(pl, "Squeezed") else None
MASK_VALUE = -2.3819763e38  # as dense.MASK_VALUE: finite, so masked rows never give NaN


def default_interpret() -> bool:
  """Pallas TPU kernels run compiled (Mosaic) on TPU and in interpret mode elsewhere."""
  return jax.default_backend() != "tpu"


def tpu_compiler_params(semantics: tuple[str, ...]):
  """Mosaic compiler params for a grid with these dimension semantics."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.CompilerParams(dimension_semantics=semantics)


def softcap(x, cap: float | None):
  return x if cap is None else jnp.tanh(x / cap) * cap


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
