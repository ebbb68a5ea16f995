"""Warm start: supervised fine-tuning on worked solutions until held-out greedy accuracy
reaches sft.target_accuracy, after the stages of an optional length curriculum
(data/curriculum.py). The result is cached in <workdir>/sft and reused."""

from __future__ import annotations

import json
import os
import time

import jax
from jax.experimental import multihost_utils

from dsparse_jax.data import batches, curriculum
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import checkpoints, faults, files
from dsparse_jax.report.metrics import MetricsWriter, Progress
from dsparse_jax.train import steps
from dsparse_jax.train.context import RunContext


def _optimizer(c):
    return steps.make_optimizer(
        c.learning_rate,
        warmup_steps=c.warmup_steps,
        total_steps=c.max_steps,
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
        schedule="constant",
    )


def restore(ctx: RunContext, workdir: str, step: int | None = None):
    """(params, step) of the SFT checkpoint at `step` (None: the newest) in <workdir>/sft,
    or None if there is none."""
    directory = os.path.join(workdir, "sft")
    if not os.path.isdir(directory):
        return None
    ckpt = checkpoints.Checkpointer(workdir, "sft", keep=2)
    try:
        steps_ = ckpt.all_steps()
        if not steps_ or (step is not None and step not in steps_):
            return None
        step = steps_[-1] if step is None else step
        opt = _optimizer(ctx.config.sft).init(ctx.init_params)
        template = checkpoints.to_saveable(ctx.init_params, opt, rng=jax.random.key(0), step=0)
        tree = ckpt.restore(step, template)
        return checkpoints.from_saveable(tree, ctx.init_params, opt)[0], step
    finally:
        ckpt.close()


def _read_done(path: str) -> dict | None:
    """DONE.json, or None if absent or unreadable (then the cache is not trusted)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            info = json.load(f)
        float(info["accuracy"])
        return info
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"[sft] WARNING: ignoring unreadable {path} ({e})", flush=True)
        return None


def warm_start(ctx: RunContext, workdir: str, writer: MetricsWriter):
    """Returns SFT params: from the cache when done earlier, else trains (resumably)."""
    c = ctx.config.sft
    if not c.get("enabled", True):  # real data from a pretrained checkpoint: no SFT
        print("[sft] skipped (sft.enabled=False): RL starts from the initial weights", flush=True)
        return ctx.init_params, None
    done_path = os.path.join(workdir, "sft", "DONE.json")
    tx = _optimizer(c)
    template_opt = tx.init(ctx.init_params)
    ckpt = checkpoints.Checkpointer(workdir, "sft", keep=2)
    params, opt_state, step = ctx.init_params, template_opt, 0
    try:
        found = ckpt.restore_latest(
            checkpoints.to_saveable(params, opt_state, rng=jax.random.key(0), step=0)
        )
    except (checkpoints.CheckpointError, checkpoints.IncompatibleCheckpoint) as e:
        raise UserError(
            f"cannot resume from {ckpt.directory}: {e}; another model or config wrote it: "
            "use another --workdir"
        ) from None
    plan = curriculum.stages(c.curriculum, ctx.task, c.batch_size, c.max_steps)
    task_start = plan[-1].start  # held-out evaluation is on the task: from this step on
    accuracy = None
    if found is not None:
        params, opt_state, _, step, _ = checkpoints.from_saveable(found[1], params, opt_state)
        info = _read_done(done_path)
        if info is not None and info.get("step") == step:
            print(
                f"[sft] reusing cached warm start (step {step}, held-out greedy accuracy "
                f"{info['accuracy']:.3f})",
                flush=True,
            )
            ckpt.close()
            return params, info["accuracy"]
        print(f"[sft] resuming from step {step}", flush=True)
        if step % c.eval_every == 0 and step > task_start:  # killed before DONE.json?
            accuracy = ctx.evaluator.greedy(params)
    writer.drop_after("sft", step)

    # SFT stops at sft.target_accuracy, usually long before max_steps: the ETA is a bound.
    progress = Progress(
        "sft", c.max_steps, start=step, every=ctx.config.log.every, upper_bound=True
    )
    t0 = time.time()
    skips, stage, width = 0, None, ctx.seq_width
    while step < c.max_steps and not (accuracy is not None and accuracy >= c.target_accuracy):
        new_stage, batch = curriculum.train_problems(plan, step, ctx.config.seed)
        if new_stage is not stage:
            stage = new_stage
            if len(plan) > 1:
                width = batches.sequence_buffer(stage.task, ctx.spec.page_size)
                print(
                    f"[sft] stage {plan.index(stage) + 1}/{len(plan)}: steps {stage.start + 1}"
                    f"-{stage.end}, num_terms={stage.task.num_terms}, batch "
                    f"{stage.batch_size}, {width}-token buffer",
                    flush=True,
                )
        tokens, mask = batches.encode_sft(ctx.tok, batch, width)
        params, opt_state, m = steps.sft_step(
            params, opt_state, tokens, mask, graphdef=ctx.graphdef, tx=tx
        )
        step += 1
        m = jax.device_get(m)
        skips = skips + 1 if m["skipped"] else 0
        if c.max_consecutive_skips and skips >= c.max_consecutive_skips:
            progress.close()
            ckpt.close()
            raise SystemExit(
                f"[sft] halted at step {step}: {skips} consecutive steps with a "
                f"non-finite loss or gradient (sft.max_consecutive_skips="
                f"{c.max_consecutive_skips})"
            )
        if step % c.eval_every == 0 or step == c.max_steps:
            if step > task_start:
                accuracy = ctx.evaluator.greedy(params)
                m["eval_greedy_accuracy"] = accuracy
            m["time"] = time.time() - t0
            try:
                ckpt.save(
                    step,
                    checkpoints.to_saveable(params, opt_state, rng=jax.random.key(0), step=step),
                )
            except checkpoints.CheckpointError as e:  # non-finite state: never saved
                ckpt.close()
                raise SystemExit(f"[sft] halted at step {step}: {e}") from None
        writer.write("sft", step, m)
        faults.maybe_kill("sft_step", step)
        progress.update(step, m, ("loss", "eval_greedy_accuracy"))
        if accuracy is not None and accuracy >= c.target_accuracy:
            break
    progress.close()
    ckpt.save(
        step,
        checkpoints.to_saveable(params, opt_state, rng=jax.random.key(0), step=step),
        force=True,
    )
    ckpt.close()
    if accuracy is None:
        accuracy = ctx.evaluator.greedy(params)
    if accuracy < c.target_accuracy:
        print(
            f"[sft] WARNING: stopped at sft.max_steps={c.max_steps} with accuracy "
            f"{accuracy:.3f} < sft.target_accuracy={c.target_accuracy}",
            flush=True,
        )
    if accuracy > c.max_accuracy:
        print(
            f"[sft] WARNING: accuracy {accuracy:.3f} > sft.max_accuracy={c.max_accuracy}: "
            "little room left for RL",
            flush=True,
        )
    faults.maybe_kill("sft_done", step)  # stopped and saved, DONE.json not yet written
    if jax.process_index() == 0:  # one writer; the other hosts wait for it below
        files.write_json_atomic(done_path, {"step": step, "accuracy": accuracy})
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("sft_done")
    print(
        f"[sft] warm start done at step {step}: held-out greedy accuracy {accuracy:.3f}", flush=True
    )
    return params, accuracy
