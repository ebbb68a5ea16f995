"""Pallas TPU block-sparse training attention: the teacher-forced sparse forward.

Matches the XLA reference `dense.sequence_attention(q, k, v, layer,
selection.allowed_key_mask(page_ids, sparse_query, T, page_size))`: query t of KV head k
sees key j iff j <= t (and t - j < window on sliding-window layers) and, when t is a
sparse query, j's page is among page_ids[b, t, k]. Flash-attention style, forward and
backward (jax.custom_vjp), never materialising [T, T]:

- the query heads of a GQA group are folded into the query rows of their KV head
  (row = t * G + g), so one K/V block serves the whole group and dK/dV sum over it;
- the per-(query, key) mask is rebuilt inside each [rows, block_k] tile from the
  query rows' page ids ([rows, P] int32 block) and the key positions;
- a scalar-prefetched table of which (q block, kv block) tiles contain any visible key
  drives the BlockSpec index_map (skipped tiles repeat the previous block index, so
  nothing is fetched) and skips their compute.

Forward: online softmax, saves the per-row log-sum-exp. Backward: one kernel for dQ
(loop over kv blocks), one for dK/dV (loop over q blocks), from the saved lse and
delta = rowsum(dO * O), with the softcap chain rule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dsparse_jax.attention.selection import NO_PAGE
from dsparse_jax.attention.spec import LayerInfo
from pallas_kernels.common import (
    MASK_VALUE,
    SQUEEZED,
    default_interpret,
    online_softmax_step,
    tpu_compiler_params,
)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    num_kv: int
    group: int  # G query heads per KV head
    block_q: int  # query positions per tile (rows = block_q * group)
    block_k: int  # keys per tile (a multiple of page_size)
    nq: int
    nk: int
    page_size: int
    slots: int  # P
    cap: float | None
    window: int | None
    interpret: bool


# ----------------------------------------------------------------------------- tiles
def _div(x, d: int):
    """x // d for non-negative int32 x: a shift when d is a power of two (cheap on the
    TPU vector unit), else a truncating division."""
    if d & (d - 1) == 0:
        return jax.lax.shift_right_logical(x, jnp.int32(d.bit_length() - 1))
    return jax.lax.div(x, jnp.int32(d))


def _tile_logits(cfg: _Cfg, qi, kj, q_RxH, k_KxH, ids_RxP, dense_Rx1):
    """Raw (pre-softcap) logits, softcapped logits and the visibility mask of one tile."""
    raw = jax.lax.dot_general(
        q_RxH, k_KxH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    s = raw if cfg.cap is None else jnp.tanh(raw / cfg.cap) * cfg.cap
    shape = raw.shape
    q_pos = qi * cfg.block_q + _div(jax.lax.broadcasted_iota(jnp.int32, shape, 0), cfg.group)
    k_pos = kj * cfg.block_k + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    ok = k_pos <= q_pos
    if cfg.window is not None:
        ok &= q_pos - k_pos < cfg.window
    k_page = _div(k_pos, cfg.page_size)
    sel = jnp.broadcast_to(dense_Rx1 != 0, shape)
    for p in range(cfg.slots):  # P compares of [rows, block_k]; P is small (the budget)
        sel |= ids_RxP[:, p : p + 1] == k_page
    return s, ok & sel


def _softcap_grad(cfg: _Cfg, s):
    """d softcap(raw) / d raw, from the softcapped value s = cap * tanh(raw / cap)."""
    if cfg.cap is None:
        return None
    t = s / cfg.cap
    return 1.0 - t * t


def _table_index(cfg: _Cfg, b, h, i, j, n_inner: int):
    return ((b * cfg.num_kv + h) * (cfg.nq * cfg.nk // n_inner) + i) * n_inner + j


# ----------------------------------------------------------------------------- forward
def _fwd_kernel(
    need_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    ids_ref,
    dense_ref,
    o_ref,
    lse_ref,
    m_scr,
    l_scr,
    acc_scr,
    *,
    cfg: _Cfg,
):
    b, h, qi, kj = (pl.program_id(a) for a in range(4))

    @pl.when(kj == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(need_ref[_table_index(cfg, b, h, qi, kj, cfg.nk)] != 0)
    def _tile():
        s, ok = _tile_logits(cfg, qi, kj, q_ref[...], k_ref[...], ids_ref[...], dense_ref[...])
        online_softmax_step(s, ok, v_ref[...], m_scr, l_scr, acc_scr)

    @pl.when(kj == cfg.nk - 1)
    def _finish():
        l = l_scr[...]
        empty = l == 0.0  # a row that sees no key (only padding rows): output 0
        o_ref[...] = (acc_scr[...] / jnp.where(empty, 1.0, l)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, 0.0, m_scr[...] + jnp.log(jnp.where(empty, 1.0, l)))


def _specs(cfg: _Cfg, h: int, q_outer: bool):
    """BlockSpecs of the row-blocked (q-side) and key-blocked (kv-side) operands for a grid
    (B, K, outer, inner) that loops kv blocks inside q blocks (q_outer) or the reverse."""
    rows = cfg.block_q * cfg.group
    n_inner = cfg.nk if q_outer else cfg.nq

    def fetched(bi, hi, oi, ii, need, fetch):
        return fetch[_table_index(cfg, bi, hi, oi, ii, n_inner)]

    if q_outer:
        row_map = lambda bi, hi, oi, ii, need, fetch: (bi, hi, oi, 0)
        key_map = lambda bi, hi, oi, ii, need, fetch: (
            bi,
            hi,
            fetched(bi, hi, oi, ii, need, fetch),
            0,
        )
    else:
        row_map = lambda bi, hi, oi, ii, need, fetch: (
            bi,
            hi,
            fetched(bi, hi, oi, ii, need, fetch),
            0,
        )
        key_map = lambda bi, hi, oi, ii, need, fetch: (bi, hi, oi, 0)
    row_spec = lambda last: pl.BlockSpec((SQUEEZED, SQUEEZED, rows, last), row_map)
    key_spec = pl.BlockSpec((SQUEEZED, SQUEEZED, cfg.block_k, h), key_map)
    return row_spec, key_spec


def _dense_spec(cfg: _Cfg, q_outer: bool, n_inner: int):
    """The per-row dense flag [B, rows_total, 1] follows the query rows."""
    rows = cfg.block_q * cfg.group
    if q_outer:
        return pl.BlockSpec((SQUEEZED, rows, 1), lambda bi, hi, oi, ii, need, fetch: (bi, oi, 0))
    return pl.BlockSpec(
        (SQUEEZED, rows, 1),
        lambda bi, hi, oi, ii, need, fetch: (
            bi,
            fetch[_table_index(cfg, bi, hi, oi, ii, n_inner)],
            0,
        ),
    )


def _forward(cfg: _Cfg, tables, q_r, k_t, v_t, ids_r, dense_r):
    from jax.experimental.pallas import tpu as pltpu

    need_q, fetch_q, _, _ = tables
    b, _, rows_total, h = q_r.shape
    p = ids_r.shape[-1]
    rows = cfg.block_q * cfg.group
    row_spec, key_spec = _specs(cfg, h, q_outer=True)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, cfg.num_kv, cfg.nq, cfg.nk),
        in_specs=[row_spec(h), key_spec, key_spec, row_spec(p), _dense_spec(cfg, True, cfg.nk)],
        out_specs=[row_spec(h), row_spec(1)],
        scratch_shapes=[
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, h), jnp.float32),
        ],
    )
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q_r.shape, v_t.dtype),
            jax.ShapeDtypeStruct((b, cfg.num_kv, rows_total, 1), jnp.float32),
        ],
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="sparse_train_attention_fwd",
    )(need_q, fetch_q, q_r, k_t, v_t, ids_r, dense_r)


# ----------------------------------------------------------------------------- backward
def _tile_grads(cfg, qi, kj, q, k, v, do, lse, delta, ids, dense):
    """p and d(raw logits) of one tile."""
    s, ok = _tile_logits(cfg, qi, kj, q, k, ids, dense)
    p = jnp.where(ok, jnp.exp(s - lse), 0.0)
    dp = jax.lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    ds = p * (dp - delta)
    dcap = _softcap_grad(cfg, s)
    if dcap is not None:
        ds = ds * dcap
    return p, ds


def _dq_kernel(
    need_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    ids_ref,
    dense_ref,
    dq_ref,
    dq_scr,
    *,
    cfg: _Cfg,
):
    b, h, qi, kj = (pl.program_id(a) for a in range(4))

    @pl.when(kj == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(need_ref[_table_index(cfg, b, h, qi, kj, cfg.nk)] != 0)
    def _tile():
        k = k_ref[...]
        _, ds = _tile_grads(
            cfg,
            qi,
            kj,
            q_ref[...],
            k,
            v_ref[...],
            do_ref[...],
            lse_ref[...],
            delta_ref[...],
            ids_ref[...],
            dense_ref[...],
        )
        dq_scr[...] += jax.lax.dot_general(
            ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    @pl.when(kj == cfg.nk - 1)
    def _finish():
        dq_ref[...] = dq_scr[...].astype(dq_ref.dtype)


def _dkv_kernel(
    need_ref,
    fetch_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    ids_ref,
    dense_ref,
    dk_ref,
    dv_ref,
    dk_scr,
    dv_scr,
    *,
    cfg: _Cfg,
):
    b, h, kj, qi_step = (pl.program_id(a) for a in range(4))
    qi = fetch_ref[_table_index(cfg, b, h, kj, qi_step, cfg.nq)]  # the q block loaded

    @pl.when(qi_step == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(need_ref[_table_index(cfg, b, h, kj, qi_step, cfg.nq)] != 0)
    def _tile():
        q, do = q_ref[...], do_ref[...]
        p, ds = _tile_grads(
            cfg,
            qi,
            kj,
            q,
            k_ref[...],
            v_ref[...],
            do,
            lse_ref[...],
            delta_ref[...],
            ids_ref[...],
            dense_ref[...],
        )
        dv_scr[...] += jax.lax.dot_general(
            p.astype(do.dtype), do, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        dk_scr[...] += jax.lax.dot_general(
            ds.astype(q.dtype), q, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    @pl.when(qi_step == cfg.nq - 1)
    def _finish():
        dk_ref[...] = dk_scr[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def _backward(cfg: _Cfg, tables, res, do_r):
    from jax.experimental.pallas import tpu as pltpu

    q_r, k_t, v_t, ids_r, dense_r, o_r, lse = res
    need_q, fetch_q, need_k, fetch_k = tables
    b, _, rows_total, h = q_r.shape
    p = ids_r.shape[-1]
    rows = cfg.block_q * cfg.group
    delta = jnp.sum(do_r.astype(jnp.float32) * o_r.astype(jnp.float32), -1, keepdims=True)
    args = (q_r, k_t, v_t, do_r, lse, delta, ids_r, dense_r)

    row_spec, key_spec = _specs(cfg, h, q_outer=True)
    in_specs = [
        row_spec(h),
        key_spec,
        key_spec,
        row_spec(h),
        row_spec(1),
        row_spec(1),
        row_spec(p),
        _dense_spec(cfg, True, cfg.nk),
    ]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, cfg.num_kv, cfg.nq, cfg.nk),
            in_specs=in_specs,
            out_specs=row_spec(h),
            scratch_shapes=[pltpu.VMEM((rows, h), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q_r.shape, q_r.dtype),
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="sparse_train_attention_dq",
    )(need_q, fetch_q, *args)

    row_spec, key_spec = _specs(cfg, h, q_outer=False)
    in_specs = [
        row_spec(h),
        key_spec,
        key_spec,
        row_spec(h),
        row_spec(1),
        row_spec(1),
        row_spec(p),
        _dense_spec(cfg, False, cfg.nq),
    ]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, cfg.num_kv, cfg.nk, cfg.nq),
            in_specs=in_specs,
            out_specs=[key_spec, key_spec],
            scratch_shapes=[
                pltpu.VMEM((cfg.block_k, h), jnp.float32),
                pltpu.VMEM((cfg.block_k, h), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(k_t.shape, k_t.dtype),
            jax.ShapeDtypeStruct(v_t.shape, v_t.dtype),
        ],
        compiler_params=tpu_compiler_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=cfg.interpret,
        name="sparse_train_attention_dkv",
    )(need_k, fetch_k, *args)
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, tables, q_r, k_t, v_t, ids_r, dense_r):
    return _forward(cfg, tables, q_r, k_t, v_t, ids_r, dense_r)[0]


def _attention_fwd(cfg, tables, q_r, k_t, v_t, ids_r, dense_r):
    o_r, lse = _forward(cfg, tables, q_r, k_t, v_t, ids_r, dense_r)
    return o_r, (tables, (q_r, k_t, v_t, ids_r, dense_r, o_r, lse))


def _attention_bwd(cfg, saved, do_r):
    tables, res = saved
    dq, dk, dv = _backward(cfg, tables, res, do_r)
    return None, dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- tables
def _first_or_repeat(need_xIxJ):
    """Block index to fetch at each inner step: the step's own index where needed, else the
    last needed one before it (the first needed one before any), so skipped steps do not
    change the block index and Pallas fetches nothing new."""
    j = jnp.arange(need_xIxJ.shape[-1], dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(need_xIxJ, j, -1), axis=need_xIxJ.ndim - 1)
    first = jnp.argmax(need_xIxJ, axis=-1).astype(jnp.int32)[..., None]
    return jnp.where(last >= 0, last, first).astype(jnp.int32)


def block_tables(ids_BxKxTxP, dense_BxT, cfg: _Cfg):
    """(q block, kv block) tiles that hold any visible key: [B, K, nq, nk] bool.

    A tile is needed iff it intersects the causal (window) band and either a query of the
    q block is dense or some query of it selected a page of the kv block."""
    b, kv, t, p = ids_BxKxTxP.shape
    num_pages = cfg.nk * cfg.block_k // cfg.page_size
    qb = (jnp.arange(t) // cfg.block_q)[None, None, :, None]
    page = jnp.where(ids_BxKxTxP == NO_PAGE, num_pages, ids_BxKxTxP)  # -> dropped
    hit = (
        jnp.zeros((b, kv, cfg.nq, num_pages), bool)
        .at[jnp.arange(b)[:, None, None, None], jnp.arange(kv)[None, :, None, None], qb, page]
        .set(True, mode="drop")
    )
    hit = hit.reshape(b, kv, cfg.nq, cfg.nk, -1).any(-1)
    dense_blk = dense_BxT.reshape(b, cfg.nq, cfg.block_q).any(-1)[:, None, :, None]
    qi = jnp.arange(cfg.nq)[:, None]
    kj = jnp.arange(cfg.nk)[None, :]
    band = kj * cfg.block_k <= (qi + 1) * cfg.block_q - 1
    if cfg.window is not None:
        band &= (kj + 1) * cfg.block_k - 1 > qi * cfg.block_q - cfg.window
    return band & (hit | dense_blk)


# ----------------------------------------------------------------------------- entry
def sparse_sequence_attention(
    q_BxTxNxH,
    k_BxTxKxH,
    v_BxTxKxH,
    layer: LayerInfo,
    page_ids_BxTxKxP,
    sparse_query_BxT,
    page_size: int,
    *,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
):
    """Teacher-forced block-sparse attention (differentiable in q, k, v). Same contract as
    dense.sequence_attention(..., selection.allowed_key_mask(page_ids, sparse_query, T,
    page_size)); block sizes are clipped to the (padded) sequence."""
    if interpret is None:
        interpret = default_interpret()
    b, t, n, h = q_BxTxNxH.shape
    kv = k_BxTxKxH.shape[2]
    g = n // kv
    p = page_ids_BxTxKxP.shape[-1]
    block_k = max(page_size, min(block_k, -(-t // page_size) * page_size))
    if block_k % page_size:
        raise ValueError(f"block_k {block_k} must be a multiple of the page size {page_size}")
    block_q = min(block_q, -(-t // 8) * 8)
    tile = block_q * block_k // _gcd(block_q, block_k)
    tp = -(-t // tile) * tile
    cfg = _Cfg(
        num_kv=kv,
        group=g,
        block_q=block_q,
        block_k=block_k,
        nq=tp // block_q,
        nk=tp // block_k,
        page_size=page_size,
        slots=p,
        cap=layer.softcap,
        window=layer.window,
        interpret=bool(interpret),
    )
    pad = tp - t
    # Padding rows see nothing (not dense, no pages): output 0, no gradient.
    ids = jnp.pad(
        page_ids_BxTxKxP.astype(jnp.int32),
        ((0, 0), (0, pad), (0, 0), (0, 0)),
        constant_values=NO_PAGE,
    ).transpose(0, 2, 1, 3)  # [B, K, Tp, P]
    dense_BxT = jnp.pad(~sparse_query_BxT.astype(bool), ((0, 0), (0, pad)))
    need_q = block_tables(ids, dense_BxT, cfg)  # [B, K, nq, nk]
    need_k = need_q.transpose(0, 1, 3, 2)  # [B, K, nk, nq]
    tables = (
        need_q.astype(jnp.int32).reshape(-1),
        _first_or_repeat(need_q).reshape(-1),
        need_k.astype(jnp.int32).reshape(-1),
        _first_or_repeat(need_k).reshape(-1),
    )

    q = q_BxTxNxH.reshape(b, t, kv, g, h) * layer.scale  # as the reference
    q_r = (
        jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        .transpose(0, 2, 1, 3, 4)
        .reshape(b, kv, tp * g, h)
    )
    k_t = jnp.pad(k_BxTxKxH, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    v_t = jnp.pad(v_BxTxKxH, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    ids_r = jnp.repeat(ids, g, axis=2)  # [B, K, Tp * G, P]: row t * G + g
    dense_r = jnp.repeat(dense_BxT.astype(jnp.int32), g, axis=1)[..., None]
    o_r = _attention(cfg, tables, q_r, k_t, v_t, ids_r, dense_r)
    o = o_r.reshape(b, kv, tp, g, h)[:, :, :t].transpose(0, 2, 1, 3, 4)
    return o.reshape(b, t, n, h)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
