"""Block-sparse decode kernel benchmark: kernel time vs dense decode attention, and the
achieved HBM bandwidth on the bytes the kernel reads.

  python -m dsparse_jax.bench.kernels --out=/tmp/kernels.json          # GPU or TPU
  python -m dsparse_jax.bench.kernels --contexts=32768 --budgets=32    # one point
  python -m dsparse_jax.bench.kernels                                  # CPU: sanity check only

Every path is timed through the model's attention dispatcher (model/attention_dispatch.py),
so the kernel is the one `attention.impl` runs: --impl (default auto: the platform's
kernel) resolves to triton_gpu on GPU (the jax-triton split-K decode,
pallas_kernels/triton_decode.py; needs requirements-gpu.txt) and pallas_tpu on TPU (the
Pallas decode, pallas_kernels/paged_decode.py). For each context L (default 4k-128k) and
budget (default 16-64 pages of --page_size tokens) it times, on one attention layer's cache
[B, K, L_buf, H] in --dtype:
  sparse_kernel  dispatch.sparse_decode under --impl over `budget` random selected pages
                 per (sequence, KV head) (sink page, current page and random others, in
                 random slot order), query at position L - 1;
  sparse_xla     the same under impl=xla: the plain-JAX gather reference on the same pages;
  dense_xla      dispatch.attend_decode of a dense layer over all L entries.
Two times per path, each a median over --reps timed calls after --warmup calls (jit
compile excluded, block_until_ready per call):
  *_call_ms  one jitted call, as a caller sees it: the device time plus the fixed cost of
             dispatching a program and waiting for it (tens of microseconds on a GPU,
             more than a decode kernel over a few MB takes);
  *_ms       the device time per call: one jitted program runs --chain dependent calls
             (each call's query is the previous query + 1e-3 x its output, so XLA can
             neither merge nor reorder them; each reads its own random page set, so a
             sparse call does not find the previous call's pages in cache) and
             (T(chain) - T(1)) / (chain - 1) cancels the fixed cost. It includes each
             call's launch and one [B, N, H] add.
bytes = K and V pages read + q + out; GB/s = bytes / device time; frac_of_peak = GB/s /
the device's HBM peak (table below, or --hbm_peak_gbs). Targets recorded in the JSON,
on device times: kernel >= 60% of HBM peak at 32k; dense/sparse speedup >= 0.7 * L /
(budget * page_size).

On CPU there is no kernel to time (Pallas runs in interpret mode, Triton needs a GPU): the
script says so, runs a tiny interpret-mode check of the pallas_tpu kernel against the
reference through the dispatcher (correctness only, no figures) and exits 0;
--force_cpu_timing times the --impl path anyway (pallas_tpu: the interpreted kernel;
meaningless for speed; for debugging the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from dsparse_jax.config import cli
from dsparse_jax.reliability import files

# HBM peak bandwidth in GB/s by jax device_kind substring (vendor figures).
HBM_PEAK_GBS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100": 1555.0,
    "L4": 300.0,
    "TPU v6": 1640.0,
    "TPU v5p": 2765.0,
    "TPU v5 lite": 819.0,
    "TPU v5e": 819.0,
    "TPU v5": 2765.0,
    "TPU v4": 1228.0,
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.bench.kernels",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--contexts", default="4096,8192,16384,32768,65536,131072")
    p.add_argument("--budgets", default="16,32,64", help="pages read per (seq, KV head)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--softcap", type=float, default=0.0, help="0: none")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chain", type=int, default=16, help="dependent calls per timed program")
    p.add_argument(
        "--impl", default="auto", help="attention.impl of the kernel (auto: the platform's)"
    )
    p.add_argument("--skip_dense", action="store_true")
    p.add_argument("--hbm_peak_gbs", type=float, default=0.0, help="override the table")
    p.add_argument("--force_cpu_timing", action="store_true")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.chain < 2:
        p.error(f"--chain: must be at least 2, got {args.chain}")
    return args


def hbm_peak(device_kind: str, override: float) -> float | None:
    if override:
        return override
    for key, gbs in HBM_PEAK_GBS.items():
        if key.lower() in device_kind.lower():
            return gbs
    return None


def make_cache(args, context: int, dtype):
    """q, a cache of `context` tokens (buffer rounded up to a page; random K/V drawn on
    device) and the query position context - 1."""
    import jax
    import jax.numpy as jnp

    b, kv, g, h, ps = args.batch, args.kv_heads, args.group, args.head_dim, args.page_size
    s = -(-context // ps) * ps
    kq, kk, kv_key = jax.random.split(jax.random.key(context), 3)
    q = jax.random.normal(kq, (b, kv * g, h), dtype)
    k = jax.random.normal(kk, (b, kv, s, h), dtype)
    v = jax.random.normal(kv_key, (b, kv, s, h), dtype)
    return q, k, v, jnp.full((b,), context - 1, jnp.int32)


def make_ids(rng, args, context: int, budget: int):
    """`budget` selected pages per (sequence, KV head): sink, current, random others, in
    random slot order. Returns (ids int32 [B, K, budget], budget actually used)."""
    import jax.numpy as jnp

    cur = (context - 1) // args.page_size
    budget = min(budget, cur + 1)
    ids = np.empty((args.batch, args.kv_heads, budget), np.int32)
    for i in range(args.batch):
        for j in range(args.kv_heads):
            others = rng.choice(np.arange(1, cur), budget - 2, replace=False) if budget > 2 else []
            ids[i, j] = rng.permutation(np.concatenate([[0, cur], others]).astype(np.int32))
    return jnp.asarray(ids), budget


def time_fn(fn, args_, reps: int, warmup: int):
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args_))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args_))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def chained(fn, n: int):
    """jit of n dependent calls fn(q, k, v, pos, ids_i) (ids_NxBxKxP: one page set per
    call; None for dense): each call's query is the previous query plus 1e-3 x its
    output, so the calls can be neither merged nor reordered. Returns the last query."""
    import jax

    def run(q, k, v, pos, ids_NxBxKxP):
        for i in range(n):
            ids = None if ids_NxBxKxP is None else ids_NxBxKxP[i]
            out = fn(q, k, v, pos) if ids is None else fn(q, k, v, pos, ids)
            q = q + (out * 1e-3).astype(q.dtype)
        return q

    return jax.jit(run)


def device_time(fn, args_, chain: int, reps: int, warmup: int):
    """(device seconds per call, seconds of one dispatched call) of fn: medians of one
    call and of a chain of `chain` dependent calls, (T(chain) - T(1)) / (chain - 1)."""
    q, k, v, pos, ids_NxBxKxP = args_
    one = time_fn(
        chained(fn, 1),
        (q, k, v, pos, None if ids_NxBxKxP is None else ids_NxBxKxP[:1]),
        reps,
        warmup,
    )
    many = time_fn(chained(fn, chain), args_, reps, warmup)
    return (many - one) / (chain - 1), one


def _spec(impl: str, page_size: int):
    """A spec whose sparse layers decode with `impl` (the selection settings are unused:
    the benchmark hands the dispatcher its pages)."""
    from dsparse_jax.attention.spec import AttentionSpec, SparseSpec

    return AttentionSpec(impl=impl, page_size=page_size, sparse=SparseSpec())


def cpu_sanity_check() -> dict:
    """The pallas_tpu decode (interpreted) vs the XLA reference on a tiny shape, both
    through the dispatcher."""
    import jax.numpy as jnp

    from dsparse_jax.attention.spec import LayerInfo
    from dsparse_jax.model import attention_dispatch as dispatch

    rng = np.random.default_rng(0)
    b, kv, g, h, ps, n_pages = 2, 2, 2, 16, 8, 8
    q = jnp.asarray(rng.normal(size=(b, kv * g, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, kv, n_pages * ps, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, kv, n_pages * ps, h)), jnp.float32)
    pos = jnp.asarray([60, 21], jnp.int32)
    ids = jnp.asarray([[[7, 0, 3, -1], [5, 7, 0, 2]], [[2, -1, 0, 1], [0, 2, -1, -1]]], jnp.int32)
    layer = LayerInfo(index=1, window=None, softcap=None, scale=h**-0.5)
    want, got = (
        dispatch.sparse_decode(q, k, v, pos, ids, layer, _spec(impl, ps))
        for impl in ("xla", "pallas_tpu")
    )
    err = float(jnp.abs(got - want).max())
    return {
        "check": "pallas_tpu decode (interpret) vs XLA reference, through the dispatcher",
        "max_abs_err": err,
        "ok": err < 2e-5,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from dsparse_jax.attention.spec import AttentionSpec, LayerInfo, interpret_mode
    from dsparse_jax.model import attention_dispatch as dispatch

    backend = jax.default_backend()
    dev = jax.devices()[0]
    result = {
        "backend": backend,
        "device_kind": dev.device_kind,
        "jax": jax.__version__,
        "args": vars(args),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if backend not in ("gpu", "tpu") and not args.force_cpu_timing:
        log(
            f"bench_kernels: backend is {backend!r}: no accelerator, no kernel timings "
            "(Pallas would run interpreted, Triton needs a GPU). Running a tiny interpret-mode "
            "correctness check instead."
        )
        result["mode"] = "cpu_sanity_check"
        result["sanity"] = cpu_sanity_check()
        result["rows"] = []
        files.emit_json(result, args.out)
        return 0 if result["sanity"]["ok"] else 1

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    itemsize = jnp.dtype(dtype).itemsize
    layer = LayerInfo(index=1, window=None, softcap=args.softcap or None, scale=args.head_dim**-0.5)
    ps = args.page_size
    impl = dispatch.resolve_impl(args.impl)
    kernel_name = impl + ("_interpret" if impl == "pallas_tpu" and interpret_mode() else "")
    spec, ref_spec, dense_spec = _spec(impl, ps), _spec("xla", ps), AttentionSpec(page_size=ps)
    kernel = jax.jit(
        lambda q, k, v, pos, ids: dispatch.sparse_decode(q, k, v, pos, ids, layer, spec)
    )
    ref = jax.jit(
        lambda q, k, v, pos, ids: dispatch.sparse_decode(q, k, v, pos, ids, layer, ref_spec)
    )
    dense_fn = jax.jit(
        lambda q, k, v, pos: dispatch.attend_decode(q, {"k": k, "v": v}, pos, layer, dense_spec)[0]
    )
    peak = hbm_peak(dev.device_kind, args.hbm_peak_gbs)
    result.update(mode="timing", kernel=kernel_name, hbm_peak_gbs=peak, rows=[])
    rng = np.random.default_rng(0)
    b, kv, g, h = args.batch, args.kv_heads, args.group, args.head_dim
    qo_bytes = 2 * b * kv * g * h * itemsize
    for context in [int(c) for c in args.contexts.split(",")]:
        dense_t = None
        q, k, v, pos = make_cache(args, context, dtype)
        for budget in [int(x) for x in args.budgets.split(",")]:
            sets = [make_ids(rng, args, context, budget) for _ in range(args.chain)]
            ids_NxBxKxP, budget = jnp.stack([i for i, _ in sets]), sets[0][1]
            ids = ids_NxBxKxP[0]
            out_k = kernel(q, k, v, pos, ids)
            out_r = ref(q, k, v, pos, ids)
            err = float(jnp.abs(out_k.astype(jnp.float32) - out_r.astype(jnp.float32)).max())
            timing = (args.chain, args.reps, args.warmup)
            t_kernel, t_kernel_call = device_time(kernel, (q, k, v, pos, ids_NxBxKxP), *timing)
            t_ref, t_ref_call = device_time(ref, (q, k, v, pos, ids_NxBxKxP), *timing)
            if dense_t is None and not args.skip_dense:
                dense_t, dense_call = device_time(dense_fn, (q, k, v, pos, None), *timing)
            sparse_bytes = 2 * b * kv * budget * ps * h * itemsize + qo_bytes
            dense_bytes = 2 * b * kv * context * h * itemsize + qo_bytes
            gbs = sparse_bytes / t_kernel / 1e9
            row = {
                "context": context,
                "budget_pages": budget,
                "budget_tokens": budget * ps,
                "kernel_ms": t_kernel * 1e3,
                "kernel_call_ms": t_kernel_call * 1e3,
                "sparse_xla_ms": t_ref * 1e3,
                "sparse_xla_call_ms": t_ref_call * 1e3,
                "dense_xla_ms": None if dense_t is None else dense_t * 1e3,
                "dense_xla_call_ms": None if dense_t is None else dense_call * 1e3,
                "kernel_bytes": sparse_bytes,
                "kernel_gbs": gbs,
                "kernel_frac_of_peak": None if peak is None else gbs / peak,
                "dense_gbs": None if dense_t is None else dense_bytes / dense_t / 1e9,
                "max_abs_err_vs_reference": err,
            }
            if dense_t is not None:
                row["speedup_vs_dense"] = dense_t / t_kernel
                row["speedup_target"] = 0.7 * context / (budget * ps)
                row["speedup_target_met"] = row["speedup_vs_dense"] >= row["speedup_target"]
            if context == 32768 and peak is not None:
                row["bandwidth_target_met"] = gbs / peak >= 0.6
            result["rows"].append(row)
            log(json.dumps(row))
            if args.out:  # partial results survive a stage killed at its time limit
                files.write_json_atomic(args.out, dict(result, partial=True), indent=1)
        del q, k, v
    files.emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    cli.run(main)
