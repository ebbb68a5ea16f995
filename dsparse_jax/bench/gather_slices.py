"""Decode step with the K/V page gather in 1 or more slices, side by side (issue 22).

    python -m dsparse_jax.bench.gather_slices --contexts=1024,4096,16384 \
        --configs=centroid:0,centroid:0:g16c8 --slices=1,2 --out=/tmp/slices.json

Per context: the dense step at the budget's context (the reference of the selection
overhead) and every (config, slices) step, compiled once each, then timed in interleaved
rounds (every program `--reps` steps per round) in one process, so all ratios compare
steps measured side by side. The slices are the spec's `sparse.gather_slices`. Also checks that every slice count gives the same logits as the
first (bitwise). Prints JSON (median and minimum ms per step, overhead = sparse / dense at
the budget). Tiny preset, B = 32, f32, random weights and caches (as bench/rollout.py).
"""

import dataclasses
import os
import sys
import time

import numpy as np

from dsparse_jax.bench import rollout as br
from dsparse_jax.config import cli
from dsparse_jax.reliability import files


def parse_args(argv: list[str]):
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.bench.gather_slices", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--configs", default="centroid:0,centroid:0:g16c8")
    p.add_argument("--slices", default="1,2", help="sparse.gather_slices values to compare")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import jax
    from flax import nnx

    from dsparse_jax.model import config as model_config
    from dsparse_jax.model.transformer import Transformer

    cfg = model_config.preset("tiny", dtype="float32", param_dtype="float32", vocab_size=64)
    model = Transformer(cfg, nnx.Rngs(0))
    state = nnx.split(model)[1]
    b = args.batch

    def prepare(ctx, name, slices):
        spec = br.spec_for(name, args.budget, args.page_size)
        if spec.sparse is not None:
            spec = dataclasses.replace(
                spec, sparse=dataclasses.replace(spec.sparse, gather_slices=slices)
            )
        fn, caches, tokens, pos, _ = br.decode_step(model, spec, b, ctx, seed=0)
        logits, caches = fn(state, tokens, pos, caches)
        return {
            "fn": fn,
            "caches": caches,
            "tokens": tokens,
            "pos": pos,
            "logits": logits,
            "ts": [],
        }

    slices = [int(s) for s in args.slices.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    budget_ctx = args.budget * args.page_size
    reference = prepare(budget_ctx, "dense", None)
    rows, t0 = [], time.time()
    for ctx in [int(c) for c in args.contexts.split(",")]:
        live = {("dense", budget_ctx, None): reference}
        for name in configs:
            for s in slices:
                live[(name, ctx, s)] = prepare(ctx, name, s)
        reference["ts"] = []
        for rnd in range(args.rounds):
            for e in live.values():
                for _ in range(args.reps):
                    t = time.perf_counter()
                    logits, e["caches"] = e["fn"](state, e["tokens"], e["pos"], e["caches"])
                    logits.block_until_ready()
                    e["ts"].append(time.perf_counter() - t)
            print(f"[slices] L={ctx} round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
        ref = br.stats_ms(reference["ts"])
        for (name, c, s), e in live.items():
            if name == "dense":
                continue
            first = live[(name, ctx, slices[0])]["logits"]
            row = {"context": ctx, "config": name, "gather_slices": s, **br.stats_ms(e["ts"])}
            row["dense_at_budget_ms"] = {"median_ms": ref["median_ms"], "min_ms": ref["min_ms"]}
            row["over_dense_at_budget"] = row["median_ms"] / ref["median_ms"]
            row["over_dense_at_budget_min"] = row["min_ms"] / ref["min_ms"]
            row["same_logits_as_first"] = bool(np.array_equal(e["logits"], first))
            rows.append(row)
    result = {
        "command": " ".join(["python"] + sys.argv),
        "git": br.git_rev(),
        "jax": jax.__version__,
        "loadavg_end": os.getloadavg(),
        "wall_s": time.time() - t0,
        "rows": rows,
    }
    files.emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    cli.run(main)
