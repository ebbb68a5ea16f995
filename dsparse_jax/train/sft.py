"""Warm start: supervised fine-tuning on worked solutions until held-out greedy accuracy
reaches sft.target_accuracy. The result is cached in <workdir>/sft and reused."""

from __future__ import annotations

import json
import os
import time

import jax

from dsparse_jax.data import batches
from dsparse_jax.data.math_task import problems
from dsparse_jax.train import checkpoints, steps
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.metrics import MetricsWriter, Progress


def _optimizer(c):
    return steps.make_optimizer(c.learning_rate, warmup_steps=c.warmup_steps,
                                total_steps=c.max_steps, weight_decay=c.weight_decay,
                                max_grad_norm=c.max_grad_norm, schedule="constant")


def warm_start(ctx: RunContext, workdir: str, writer: MetricsWriter):
    """Returns SFT params: from the cache when done earlier, else trains (resumably)."""
    c = ctx.config.sft
    done_path = os.path.join(workdir, "sft", "DONE.json")
    tx = _optimizer(c)
    template_opt = tx.init(ctx.init_params)
    ckpt = checkpoints.Checkpointer(workdir, "sft", keep=2)
    params, opt_state, step = ctx.init_params, template_opt, 0
    latest = ckpt.latest_step()
    if latest is not None:
        tree = ckpt.restore(latest, checkpoints.to_saveable(
            params, opt_state, rng=jax.random.key(0), step=0))
        params, opt_state, _, step, _ = checkpoints.from_saveable(tree, params, opt_state)
        if os.path.exists(done_path):
            with open(done_path) as f:
                info = json.load(f)
            print(f"[sft] reusing cached warm start (step {step}, held-out greedy accuracy "
                  f"{info['accuracy']:.3f})", flush=True)
            ckpt.close()
            return params, info["accuracy"]
        print(f"[sft] resuming from step {step}", flush=True)
        writer.drop_after("sft", step)

    progress = Progress("sft", c.max_steps, start=step)
    accuracy = None
    t0 = time.time()
    while step < c.max_steps:
        batch = problems(ctx.task, "train", step * c.batch_size, c.batch_size, ctx.config.seed)
        tokens, mask = batches.encode_sft(ctx.tok, batch, ctx.seq_width)
        params, opt_state, m = steps.sft_step(params, opt_state, tokens, mask,
                                              graphdef=ctx.graphdef, tx=tx)
        step += 1
        m = jax.device_get(m)
        if step % c.eval_every == 0 or step == c.max_steps:
            accuracy = ctx.evaluator.greedy(params)
            m["eval_greedy_accuracy"] = accuracy
            m["time"] = time.time() - t0
            ckpt.save(step, checkpoints.to_saveable(params, opt_state, rng=jax.random.key(0),
                                                    step=step))
        writer.write("sft", step, m)
        progress.update(step, m, ("loss", "eval_greedy_accuracy"))
        if accuracy is not None and accuracy >= c.target_accuracy:
            break
    ckpt.save(step, checkpoints.to_saveable(params, opt_state, rng=jax.random.key(0),
                                            step=step), force=True)
    ckpt.close()
    if accuracy is None:
        accuracy = ctx.evaluator.greedy(params)
    if accuracy < c.target_accuracy:
        print(f"[sft] WARNING: stopped at sft.max_steps={c.max_steps} with accuracy "
              f"{accuracy:.3f} < sft.target_accuracy={c.target_accuracy}", flush=True)
    if accuracy > c.max_accuracy:
        print(f"[sft] WARNING: accuracy {accuracy:.3f} > sft.max_accuracy={c.max_accuracy}: "
              "little room left for RL", flush=True)
    with open(done_path, "w") as f:
        json.dump({"step": step, "accuracy": accuracy}, f)
    print(f"[sft] warm start done at step {step}: held-out greedy accuracy {accuracy:.3f}",
          flush=True)
    return params, accuracy
