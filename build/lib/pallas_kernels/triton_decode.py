"""GPU block-sparse decode attention: a Triton kernel launched through jax-triton.

Matches the plain-JAX reference `dsparse_jax.attention.sparse.sparse_decode_attention`.
Split-K flash decoding over the selected pages: grid (batch * kv_heads, splits); program
(row, split) loads the [G, H] query block of one GQA group once and walks its share of
the page-id slots (pages_per_split consecutive slots), pages_per_iter pages per loop
step: it reads their ids, gathers their rows straight from the [B, K, S, H] cache into
one [block_n, H] K tile and V tile (page p of a KV head is rows p * page_size ..;
NO_PAGE slots are masked loads that read nothing) and keeps an online softmax in
registers; no data-dependent branch, so the loads can be pipelined. It writes an
unnormalised partial (acc [G, H], running max m [G], denominator l [G]) per split; a
small XLA combine (log-sum-exp weights over the splits) gives the output.

triton and jax_triton are imported lazily (only when the kernel is launched), so this
module imports everywhere; `launch_config` (the launch-shape logic),
`split_partials_reference` (the kernel's per-split contract in plain JAX) and
`slot_coverage` (its index arithmetic in numpy) run on CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.attention.selection import NO_PAGE
from dsparse_jax.attention.spec import LayerInfo
from pallas_kernels.common import MASK_VALUE

TARGET_PROGRAMS = 264  # ~2 programs per SM on an H100/H200 (132 SMs)


class TritonUnavailableError(RuntimeError):
    pass


def _jax_triton_compat() -> None:
    """jax-triton 0.4.1 (the release for jax 0.11) imports TMA_TF32 from triton's NVIDIA
    driver, which triton 3.6 (the H200 image's) lacks; jax-triton then stubs out the whole
    CUDA backend and every launch fails ("'_Stub' object has no attribute 'backend'",
    seen on the H200). The constant is only read for TMA tensor descriptors rounded to
    tf32, which these kernels never use: an invalid placeholder makes such a use fail
    (KeyError) rather than pass silently."""
    try:
        import triton.backends.nvidia.driver as driver
    except ImportError:
        return
    if not hasattr(driver, "TMA_TF32"):
        driver.TMA_TF32 = -1


def require_triton():
    """Imports triton and jax_triton, or raises a clear error naming the missing extra."""
    try:
        _jax_triton_compat()
        import jax_triton  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        raise TritonUnavailableError(
            "attention.impl='triton_gpu' needs the GPU extras (triton and jax-triton): "
            "pip install -r requirements-gpu.txt. Use impl='xla' (or 'auto') otherwise. "
            f"Import failed: {e}"
        ) from e
    if jax.default_backend() != "gpu":
        raise TritonUnavailableError(
            f"attention.impl='triton_gpu' needs a GPU backend, jax runs on "
            f"{jax.default_backend()!r}; use impl='auto' or 'xla'."
        )


def triton_available() -> bool:
    try:
        require_triton()
    except TritonUnavailableError:
        return False
    return True


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    grid: tuple[int, int]  # (batch * kv_heads, splits)
    num_splits: int
    pages_per_split: int  # consecutive page-id slots per program
    pages_per_iter: int  # pages gathered into one [block_n, H] key tile per loop step
    iters: int  # loop steps per program: cdiv(pages_per_split, pages_per_iter)
    page_pad: int  # page_size padded to a power of two
    block_n: int  # keys per loop step = pages_per_iter * page_pad (>= 16, tl.dot)
    block_g: int  # query heads per group, padded (tl.dot needs >= 16)
    block_h: int  # head_dim, padded to a power of two
    num_warps: int


def launch_config(
    batch: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    slots: int,
    page_size: int,
    num_splits: int | None = None,
    target_programs: int = TARGET_PROGRAMS,
    keys_per_iter: int = 64,
) -> LaunchConfig:
    """Grid and block sizes of one launch. Splits the P page slots so the grid has about
    target_programs programs (enough to fill the GPU at small batch), never an empty
    split, at least one page per split; each loop step gathers up to keys_per_iter keys
    (whole pages) into one tile."""
    rows = batch * kv_heads
    if num_splits is None:
        num_splits = max(1, -(-target_programs // rows))
    num_splits = max(1, min(num_splits, slots))
    pages_per_split = -(-slots // num_splits)
    num_splits = -(-slots // pages_per_split)  # drop splits that would be empty
    page_pad = _next_pow2(page_size)
    pages_per_iter = max(1, keys_per_iter // page_pad, 16 // page_pad)
    pages_per_iter = min(pages_per_iter, max(_next_pow2(pages_per_split), 16 // page_pad))
    block_h = max(16, _next_pow2(head_dim))
    return LaunchConfig(
        grid=(rows, num_splits),
        num_splits=num_splits,
        pages_per_split=pages_per_split,
        pages_per_iter=pages_per_iter,
        iters=-(-pages_per_split // pages_per_iter),
        page_pad=page_pad,
        block_n=pages_per_iter * page_pad,
        block_g=max(16, _next_pow2(group)),
        block_h=block_h,
        num_warps=4 if block_h <= 128 else 8,
    )


def slot_coverage(cfg: LaunchConfig, slots: int, page_size: int):
    """The kernel's index arithmetic in numpy: how often each (slot, row-in-page) pair is
    read by the programs of one grid row, and by which split. Returns (count [slots,
    page_size], split_of_slot [slots]); a correct launch reads every pair exactly once."""
    n = np.arange(cfg.block_n)
    page_in_iter, tok = n // cfg.page_pad, n % cfg.page_pad
    count = np.zeros((slots, page_size), np.int64)
    split_of = np.full(slots, -1)
    for split in range(cfg.num_splits):
        for it in range(cfg.iters):
            in_split = it * cfg.pages_per_iter + page_in_iter
            slot = split * cfg.pages_per_split + in_split
            read = (in_split < cfg.pages_per_split) & (slot < slots) & (tok < page_size)
            np.add.at(count, (slot[read], tok[read]), 1)
            split_of[slot[read]] = split
    return count, split_of


@functools.lru_cache(maxsize=None)
def _kernel():
    """The triton.jit kernel (built on first use: triton is an optional import)."""
    import triton
    import triton.language as tl

    @triton.jit
    def sparse_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        ids_ptr,
        o_ptr,
        m_ptr,
        l_ptr,
        KV: tl.constexpr,
        G: tl.constexpr,
        H: tl.constexpr,
        S: tl.constexpr,
        P: tl.constexpr,
        PAGE: tl.constexpr,
        PAGE_PAD: tl.constexpr,
        PAGES_PER_SPLIT: tl.constexpr,
        PAGES_PER_ITER: tl.constexpr,
        ITERS: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_H: tl.constexpr,
        CAP: tl.constexpr,
        WINDOW: tl.constexpr,
        PRECISION: tl.constexpr,
        MASK: tl.constexpr,
    ):
        row = tl.program_id(0)  # b * KV + kv_head
        split = tl.program_id(1)
        pos = tl.load(pos_ptr + row // KV)
        offs_g = tl.arange(0, BLOCK_G)
        offs_h = tl.arange(0, BLOCK_H)
        offs_n = tl.arange(0, BLOCK_N)
        page_in_iter = offs_n // PAGE_PAD  # which of the step's pages key n belongs to
        tok = offs_n % PAGE_PAD  # its row inside that page
        g_ok = offs_g < G
        h_ok = offs_h < H
        q = tl.load(
            q_ptr + row * (G * H) + offs_g[:, None] * H + offs_h[None, :],
            mask=g_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_G], MASK, tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_H], tl.float32)
        kv_base = row.to(tl.int64) * (S * H)
        for it in range(ITERS):
            in_split = it * PAGES_PER_ITER + page_in_iter
            slot = split * PAGES_PER_SPLIT + in_split
            page = tl.load(
                ids_ptr + row * P + slot, mask=(in_split < PAGES_PER_SPLIT) & (slot < P), other=-1
            )
            key_pos = page * PAGE + tok
            valid = (page >= 0) & (tok < PAGE)  # NO_PAGE slots and page padding read nothing
            offs = kv_base + key_pos.to(tl.int64)[:, None] * H + offs_h[None, :]
            kv_mask = valid[:, None] & h_ok[None, :]
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_G, BLOCK_N] f32
            if CAP > 0:
                s = CAP * (2.0 * tl.sigmoid(2.0 * s / CAP) - 1.0)  # CAP * tanh(s / CAP)
            ok = valid & (key_pos <= pos)
            if WINDOW > 0:
                ok = ok & (pos - key_pos < WINDOW)
            s = tl.where(ok[None, :], s, MASK)
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.where(ok[None, :], tl.exp(s - m_new[:, None]), 0.0)
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = row * NUM_SPLITS + split  # partials are [R, splits, G, H] / [R, splits, G]
        tl.store(
            o_ptr + out * (G * H) + offs_g[:, None] * H + offs_h[None, :],
            acc,
            mask=g_ok[:, None] & h_ok[None, :],
        )
        tl.store(m_ptr + out * G + offs_g, m, mask=g_ok)
        tl.store(l_ptr + out * G + offs_g, l, mask=g_ok)

    return sparse_decode_kernel


def combine_splits(acc_RxSxGxH, m_RxSxG, l_RxSxG):
    """Normalised output [R, G, H] from per-split partials (log-sum-exp weights). Empty
    splits carry m = MASK_VALUE, l = 0, acc = 0 and get weight ~0."""
    m_max = m_RxSxG.max(axis=1, keepdims=True)
    w = jnp.exp(m_RxSxG - m_max)
    l_tot = (w * l_RxSxG).sum(1)
    acc = (w[..., None] * acc_RxSxGxH).sum(1)
    return acc / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None]


def split_partials_reference(
    q_BxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    pos_B,
    page_ids_BxKxP,
    layer: LayerInfo,
    page_size: int,
    cfg: LaunchConfig,
):
    """What the kernel writes, in plain JAX: per (row, split) the unnormalised attention of
    the split's slots (acc [R, splits, G, H], m and l [R, splits, G]; unpadded). Used to
    test the split and combine logic on CPU, and the kernel against it on GPU."""
    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    p = page_ids_BxKxP.shape[-1]
    slots = cfg.num_splits * cfg.pages_per_split
    ids = jnp.pad(
        page_ids_BxKxP.astype(jnp.int32), ((0, 0), (0, 0), (0, slots - p)), constant_values=NO_PAGE
    ).reshape(b * kv, cfg.num_splits, cfg.pages_per_split)
    q = (q_BxNxH.reshape(b * kv, g, h) * layer.scale).astype(jnp.float32)
    pages_k = k_BxKxSxH.reshape(b * kv, s // page_size, page_size, h).astype(jnp.float32)
    pages_v = v_BxKxSxH.reshape(b * kv, s // page_size, page_size, h).astype(jnp.float32)
    rows = jnp.arange(b * kv)[:, None, None]
    k_sel = pages_k[rows, jnp.maximum(ids, 0)]  # [R, splits, pps, page, H]
    v_sel = pages_v[rows, jnp.maximum(ids, 0)]
    logits = jnp.einsum("rgh,rxyzh->rxgyz", q, k_sel)
    if layer.softcap is not None:
        logits = jnp.tanh(logits / layer.softcap) * layer.softcap
    key_pos = ids[..., None] * page_size + jnp.arange(page_size)  # [R, splits, pps, page]
    pos = jnp.repeat(pos_B, kv)[:, None, None, None]
    ok = (ids[..., None] != NO_PAGE) & (key_pos <= pos)
    if layer.window is not None:
        ok &= pos - key_pos < layer.window
    ok = ok[:, :, None]  # [R, splits, 1, pps, page]
    logits = jnp.where(ok, logits, MASK_VALUE)
    m = logits.max(axis=(3, 4))
    e = jnp.where(ok, jnp.exp(logits - m[..., None, None]), 0.0)
    l = e.sum(axis=(3, 4))
    acc = jnp.einsum("rxgyz,rxyzh->rxgh", e, v_sel)
    return acc, m, l


def sparse_decode_attention(
    q_BxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    pos_B,
    page_ids_BxKxP,
    layer: LayerInfo,
    page_size: int,
    *,
    num_splits: int | None = None,
):
    """Decode attention over the selected pages on GPU (same contract as the reference)."""
    b, n, h = q_BxNxH.shape
    kv = k_BxKxSxH.shape[1]
    cfg = launch_config(b, kv, n // kv, h, page_ids_BxKxP.shape[-1], page_size, num_splits)
    acc, m, l = split_partials(
        q_BxNxH, k_BxKxSxH, v_BxKxSxH, pos_B, page_ids_BxKxP, layer, page_size, cfg
    )
    return combine_splits(acc, m, l).reshape(b, n, h).astype(v_BxKxSxH.dtype)


NUM_STAGES = 2  # software-pipelining depth of the page loop


def kernel_constants(cfg: LaunchConfig, kv, g, h, s, p, page_size, layer: LayerInfo, f32: bool):
    """The kernel's constexpr arguments for one launch (one source for the jax-triton
    launch and the ahead-of-time compile)."""
    return dict(
        KV=kv,
        G=g,
        H=h,
        S=s,
        P=p,
        PAGE=page_size,
        PAGE_PAD=cfg.page_pad,
        PAGES_PER_SPLIT=cfg.pages_per_split,
        PAGES_PER_ITER=cfg.pages_per_iter,
        ITERS=cfg.iters,
        NUM_SPLITS=cfg.num_splits,
        BLOCK_N=cfg.block_n,
        BLOCK_G=cfg.block_g,
        BLOCK_H=cfg.block_h,
        CAP=float(layer.softcap or 0.0),
        WINDOW=int(layer.window or 0),
        PRECISION="ieee" if f32 else "tf32",
        MASK=MASK_VALUE,
    )


def compile_for_gpu(
    batch, kv, group, head_dim, seq_len, slots, page_size, layer: LayerInfo, dtype, capability=90
):
    """Compiles the kernel ahead of time for an NVIDIA GPU of this compute capability (no
    GPU needed: triton.compile with a GPUTarget), for the launch the dispatch makes at
    these shapes. Returns the launch config and what the compiler reports: shared memory
    (bytes), registers per thread and spilled bytes (read from the cubin with the
    cuobjdump that ships with triton; None where it is missing)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = launch_config(batch, kv, group, head_dim, slots, page_size)
    elem = {jnp.dtype(jnp.float32): "fp32", jnp.dtype(jnp.bfloat16): "bf16"}[jnp.dtype(dtype)]
    f32 = elem == "fp32"
    consts = kernel_constants(cfg, kv, group, head_dim, seq_len, slots, page_size, layer, f32)
    fn = _kernel()
    pointers = {
        "q_ptr": f"*{elem}",
        "k_ptr": f"*{elem}",
        "v_ptr": f"*{elem}",
        "pos_ptr": "*i32",
        "ids_ptr": "*i32",
        "o_ptr": "*fp32",
        "m_ptr": "*fp32",
        "l_ptr": "*fp32",
    }
    signature = {name: pointers.get(name, "constexpr") for name in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=consts),
        target=GPUTarget("cuda", capability, 32),
        options={"num_warps": cfg.num_warps, "num_stages": NUM_STAGES},
    )
    return cfg, {
        "shared_bytes": int(compiled.metadata.shared),
        "num_warps": cfg.num_warps,
        **_cubin_resources(compiled.asm["cubin"]),
    }


def _cubin_resources(cubin: bytes) -> dict:
    """Registers per thread and spilled bytes of a cubin, from `cuobjdump
    --dump-resource-usage` (triton's own copy); None where it cannot be run."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run(
                [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, timeout=60
            ).stdout
        except OSError:
            text = ""
    regs = re.search(r"REG:(\d+)", text)
    spill = re.search(r"STACK:(\d+)", text)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(spill.group(1)) if spill else None,
    }


def split_partials(
    q_BxNxH,
    k_BxKxSxH,
    v_BxKxSxH,
    pos_B,
    page_ids_BxKxP,
    layer: LayerInfo,
    page_size: int,
    cfg: LaunchConfig,
):
    """Launches the kernel: its per-split partials (acc [R, splits, G, H], m and l
    [R, splits, G]), R = batch * kv_heads."""
    require_triton()
    import jax_triton as jt

    b, n, h = q_BxNxH.shape
    kv, s = k_BxKxSxH.shape[1], k_BxKxSxH.shape[2]
    g = n // kv
    p = page_ids_BxKxP.shape[-1]
    rows = b * kv
    if cfg.grid != (rows, cfg.num_splits) or cfg.num_splits * cfg.pages_per_split < p:
        raise ValueError(f"launch config {cfg} does not cover {rows} rows x {p} slots")
    q = (q_BxNxH.reshape(b, kv, g, h) * layer.scale).astype(k_BxKxSxH.dtype)
    f32 = k_BxKxSxH.dtype == jnp.float32
    # jax-triton renamed out_shape= to out_type= (the old name warns, then goes away).
    out_kw = (
        "out_type" if "out_type" in inspect.signature(jt.triton_call).parameters else "out_shape"
    )
    acc, m, l = jt.triton_call(
        q,
        k_BxKxSxH,
        v_BxKxSxH,
        pos_B.astype(jnp.int32),
        page_ids_BxKxP.astype(jnp.int32),
        kernel=_kernel(),
        **{
            out_kw: [
                jax.ShapeDtypeStruct((rows, cfg.num_splits, g, h), jnp.float32),
                jax.ShapeDtypeStruct((rows, cfg.num_splits, g), jnp.float32),
                jax.ShapeDtypeStruct((rows, cfg.num_splits, g), jnp.float32),
            ]
        },
        grid=cfg.grid,
        num_warps=cfg.num_warps,
        num_stages=NUM_STAGES,
        **kernel_constants(cfg, kv, g, h, s, p, page_size, layer, f32),
    )
    return acc, m, l
