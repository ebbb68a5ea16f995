"""A whole run: validate the config, build, warm start (SFT), RL, final evaluation."""

from __future__ import annotations

import json
import os
import time

from dsparse_jax.train import context, rl_loop, sft
from dsparse_jax.train.metrics import MetricsWriter, read_metrics
from dsparse_jax.train.validate import validate


def prepare_workdir(workdir: str) -> None:
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"cannot create workdir {workdir!r}: {e.strerror}") from None
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise SystemExit(f"workdir {workdir!r} is not writable")


def main(config, workdir: str) -> dict:
    validate(config)  # before anything compiles
    prepare_workdir(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    t0 = time.time()
    ctx = context.build(config)
    print(f"[run] {config.name}: model {ctx.model_cfg.d_model}d x {ctx.model_cfg.num_layers} "
          f"layers, {ctx.num_params / 1e6:.2f}M params, vocab {ctx.tok.vocab_size}; "
          f"task {ctx.task.num_terms} terms, sequences of {ctx.seq_width} tokens; "
          f"workdir {workdir}", flush=True)
    writer = MetricsWriter(workdir, tensorboard=config.log.tensorboard)
    try:
        sft_params, sft_acc = sft.warm_start(ctx, workdir, writer)
        rl_loop.train_rl(ctx, workdir, sft_params, writer)
    finally:
        writer.close()
    evals = [r for r in read_metrics(workdir) if r["phase"] == "eval"]
    summary = {"sft_greedy_accuracy": sft_acc,
               "rl_greedy_accuracy": evals[-1]["greedy_accuracy"] if evals else None,
               "wall_time_s": time.time() - t0}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[run] done: {json.dumps(summary)}", flush=True)
    return summary
