"""Evaluate a trained policy without training: greedy accuracy, mean@k, maj@k and pass@k
of the dense policy and of the sparse actor, on the run's eval data or any data source.

  python launch/evaluate.py --workdir=runs/gemma_math [--step=N] [--k=4] [--samples=N]
      [--config.data.eval_source=parquet:/data/gsm8k/test.parquet ...] [--out=eval.json]
  python launch/evaluate.py --checkpoint=HF_DIR --config=configs/gemma_real.py [--k=4]

--workdir: the run's config.json and its RL checkpoint (the newest, or --step; without
RL checkpoints, the SFT warm start); the sparse actor (sparse attention + phi) is
evaluated where the run's rollout mode has one. --checkpoint: a Hugging Face directory
(e.g. written by launch/export.py) with --config for the data and sampling; its
"sparse" policy is sparse attention (config.sparse) without an adapter. Prints a table,
writes JSON (--out, default <workdir>/eval_<source>_<data>.json, or eval_<data>.json next
to the checkpoint: <data> names the eval data, so two datasets never share a file), with
a progress line while it samples. --samples=N also writes the completions of the first N
problems with their references and rewards, one JSON line each, to <out>.samples.jsonl.
Same error convention as train.py.
A run trained with rl.prune also gets qmaj@k: maj@k with each vote weighted by its rollout
quality head's P(correct) (docs/pruning.md).
"""

import hashlib
import json
import os
import re

from dsparse_jax.config import cli

DEFAULT_CONFIG = "configs/gemma_math.py"


def _config(args, path, overrides):
    if args.workdir:
        from dsparse_jax.train.trained import workdir_config

        config = workdir_config(args.workdir)
        for dotted, text in overrides.items():
            cli.apply_override(config, dotted, text)
        return config
    config = cli.load_config(path or DEFAULT_CONFIG, overrides)
    config.model.checkpoint_dir = args.checkpoint
    config.sft.enabled = False  # nothing is trained here
    return config


def _policies(ctx, args):
    """[(name, params, lora, lora_scale, spec)] to evaluate, where they came from, and the
    run's rollout quality head (rl.prune runs) as report() keyword arguments ({} if none)."""
    from dsparse_jax.train import trained

    if args.workdir:
        t = trained.load(ctx, args.workdir, args.step)
        out = [("dense", t.params, None, 1.0, ctx.spec)]
        if t.setup.mode.has_twin:
            out.append(("sparse_actor", t.params, t.lora, t.setup.lora_scale, t.setup.rollout_spec))
        head = {}
        if t.head is not None:  # quality-weighted maj@k, at the head's last checkpoint
            p = t.setup.pruning.config
            head = dict(head=t.head, head_layer=p.layer, head_position=p.positions[-1])
        return out, t.source, head
    return (
        [
            ("dense", ctx.init_params, None, 1.0, ctx.spec),
            ("sparse", ctx.init_params, None, 1.0, ctx.rollout_spec),
        ],
        args.checkpoint,
        {},
    )


def data_tag(source: str) -> str:
    """A file-name tag of a data source: its (first) file or directory name, "+N" for N more
    comma-listed parts, and a short hash of the whole source ("parquet:/data/gsm8k/test.parquet"
    -> "test-1a2b3c"; "/d/a.jsonl,/d/b.jsonl" -> "a+1-..."; "/d/train-*.parquet" ->
    "train-x-...")."""
    parts = source.split(":", 1)[-1].split(",")
    name = os.path.splitext(os.path.basename(parts[0].rstrip("/")))[0].replace("*", "x")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "data"
    more = f"+{len(parts) - 1}" if len(parts) > 1 else ""
    return f"{name}{more}-{hashlib.sha1(source.encode()).hexdigest()[:6]}"


def table(results: dict) -> str:
    """The policies x metrics table printed at the end."""
    keys = list(next(iter(results.values())))
    rows = [["policy"] + keys] + [[p] + [f"{m[k]:.3f}" for k in keys] for p, m in results.items()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(keys) + 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: list[str]) -> int:
    path, overrides, rest = cli.split_config_args(argv)
    p = cli.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workdir", help="a run directory (launch/train.py --workdir)")
    src.add_argument("--checkpoint", help="a Hugging Face checkpoint directory")
    p.add_argument("--step", type=int, default=None, help="--workdir: this checkpoint step")
    p.add_argument("--k", type=int, default=None, help="samples per problem (eval.mean_at_k)")
    p.add_argument("--out", default=None, help="JSON output path")
    p.add_argument(
        "--samples",
        type=int,
        default=0,
        help="write the completions of this many problems to <out>.samples.jsonl",
    )
    args = p.parse_args(rest)
    if args.samples < 0:
        raise cli.UserError(f"--samples: must be >= 0, got {args.samples}")
    if args.checkpoint and not os.path.isdir(args.checkpoint):
        raise cli.UserError(f"--checkpoint: no such directory {args.checkpoint!r}")
    if args.workdir and not os.path.isdir(args.workdir):
        raise cli.UserError(f"--workdir: no such directory {args.workdir!r}")
    config = _config(args, path, overrides)
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    import jax

    from dsparse_jax.config.validate import validate
    from dsparse_jax.report.metrics import Progress
    from dsparse_jax.train import context

    validate(config)
    ctx = context.build(config)
    try:
        policies, source, head = _policies(ctx, args)
        k = config.eval.mean_at_k if args.k is None else args.k
        per_policy = ctx.evaluator.num_batches() * (2 if k else 1)
        progress = Progress("eval", per_policy * len(policies), every=1)
        done = [0]

        def tick():
            done[0] += 1
            progress.update(done[0], {})

        results = {}
        for name, params, lora, scale, spec in policies:
            results[name] = ctx.evaluator.report(
                params,
                k,
                config.rl.temperature,
                jax.random.key(config.seed + 2),
                lora=lora,
                lora_scale=scale,
                spec=spec,
                on_batch=tick,
                keep=args.samples,
                **head,
            )
        progress.close()
    finally:
        ctx.rewarder.close()
    kept = {name: m.pop("samples", []) for name, m in results.items()}
    data = config.data.eval_source or config.data.source
    report = {
        "source": source,
        "data": data,
        "num_problems": len(ctx.evaluator.problems),
        "k": k,
        "temperature": config.rl.temperature,
        "policies": results,
    }
    out = args.out or (
        os.path.join(args.workdir, f"eval_{source.replace(' ', '_')}_{data_tag(data)}.json")
        if args.workdir
        else os.path.join(args.checkpoint, f"eval_{data_tag(data)}.json")
    )
    with open(out, "w") as f:
        json.dump(report, f, indent=2)
    if args.samples:
        with open(out.removesuffix(".json") + ".samples.jsonl", "w") as f:
            for name, rows in kept.items():
                for row in rows:
                    f.write(json.dumps({"policy": name, **row}) + "\n")
    print(f"[eval] {source}: {report['num_problems']} problems of {report['data']}, k={k}")
    print(table(results))
    print(f"[eval] wrote {out}")
    return 0


def console() -> None:
    """The dsparse-evaluate console command."""
    cli.run(main)
