"""The RL loop: the warm starts before RL step 1, then RL steps (phases.rl_step: the
phases in order over the rollout mode's properties, rl/modes.py), evaluation and
checkpoint cadence, resume.

Resumable: the checkpoint holds the TrainState (every trainable of the run with its
optimizer state, and the history drafter's bank: train/trainables.py), the RNG key (every
step's rollout, filter and shuffle keys derive from it), the step, the data position and
the count of consecutive skipped steps; a restart continues exactly from the newest
usable checkpoint in <workdir>/checkpoints (corrupt ones are skipped) and drops metrics of
steps it is about to redo. phi's warm start (distill.warmup_steps, before RL step 1) ends
with a checkpoint at step 0 marked so that a resume does not repeat it. A non-finite loss
or gradient skips the update; rl.max_consecutive_skips in a row halt the run. See
docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.data import batches
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import checkpoints, faults
from dsparse_jax.report.metrics import MetricsWriter, Progress
from dsparse_jax.train import memory_plan, phases
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.phases import rl_step
from dsparse_jax.train.rl_state import (
    RL_DATA_OFFSET,
    RLSetup,
    make_setup,
    phi_warmup_setup,
    phi_warmup_tx,
    place,
)
from dsparse_jax.train.trainables import OPTIONAL_KEYS as STATE_OPTIONAL_KEYS
from dsparse_jax.train.trainables import Trainable, TrainState, from_tree, init_state, to_tree


# ------------------------------------------------------------------------------- evaluation
def evaluate(
    ctx: RunContext, setup: RLSetup, st: TrainState, step: int, writer: MetricsWriter, key
) -> dict:
    """The dense policy (theta, dense attention), and in sparse modes the rollout policy's
    greedy accuracy too (sparse_greedy_accuracy: sparse attention, + phi in distillsparse).
    The record also lists each problem's greedy outcome (greedy_correct[, sparse_...]: 0/1
    per eval problem, in order), for intervals over problems (harness/results.py)."""
    e = ctx.config.eval
    t0 = time.time()
    correct = ctx.evaluator.greedy_correct(st.theta.params)
    m = {"greedy_accuracy": float(np.mean(correct)), "greedy_correct": correct.astype(int)}
    if e.mean_at_k:
        m[f"mean_at_{e.mean_at_k}"] = ctx.evaluator.mean_at_k(
            st.theta.params, e.mean_at_k, ctx.config.rl.temperature, key
        )
    if setup.mode.has_twin and e.sparse:
        correct = ctx.evaluator.greedy_correct(
            st.theta.params, st.lora, setup.lora_scale, spec=setup.rollout_spec
        )
        m["sparse_greedy_accuracy"] = float(np.mean(correct))
        m["sparse_greedy_correct"] = correct.astype(int)
    m["time"] = time.time() - t0
    record = writer.write("eval", step, m)
    print(
        f"[eval] step {step}: "
        + " ".join(
            f"{k} {v:.3f}" for k, v in record.items() if isinstance(v, float) and k != "step"
        ),
        flush=True,
    )
    return record


# ---------------------------------------------------------------------------------- the loop
# The run's progress beside its state (trainables.to_tree). Checkpoints written before the
# optional ones (and before an optional trainable, trainables.OPTIONAL_KEYS) lack them:
# they read as 0.
PROGRESS = ("data_position", "consecutive_skips", "phi_warmup_steps")
OPTIONAL_KEYS = STATE_OPTIONAL_KEYS + PROGRESS[1:]


def _saveable(
    st: TrainState,
    rng,
    step: int,
    data_position: int,
    consecutive_skips: int = 0,
    phi_warmup_steps: int = 0,
) -> dict:
    """The checkpoint tree; phi_warmup_steps: the steps of phi's warm start behind this
    state (0: none), the marker that keeps a resume at step 0 from repeating it."""
    progress = (data_position, consecutive_skips, phi_warmup_steps)
    tree = {**to_tree(st), **checkpoints.rng_and_step(rng, step)}
    tree.update({k: np.asarray(v) for k, v in zip(PROGRESS, progress)})
    return tree


def _from_tree(tree: dict, st: TrainState):
    """(state, rng, step, progress) of a restored tree; `st` is the template."""
    progress = {k: int(tree.get(k, 0)) for k in PROGRESS}
    return from_tree(tree, st), *checkpoints.read_rng_and_step(tree), progress


def _restore(ckpt, latest: int, st: TrainState, rng):
    tree = ckpt.restore(latest, _saveable(st, rng, 0, 0), OPTIONAL_KEYS)
    return _from_tree(tree, st)[:3]


def restore_state(ckpt, step: int, st: TrainState) -> TrainState:
    """The state of the RL checkpoint at `step`; `st` is the template (init_state)."""
    return _restore(ckpt, step, st, jax.random.key(0))[0]


def _resume(ckpt, st: TrainState, rng, mode: str, prompts_per_step: int):
    """(state, rng, step, consecutive skips, phi's warm-start steps behind the state) from
    the newest usable checkpoint, if any (a checkpoint at step 0 is the one saved after
    phi's warm start; checkpoints older than the marker count none)."""
    try:
        found = ckpt.restore_latest(_saveable(st, rng, 0, 0), OPTIONAL_KEYS)
    except checkpoints.IncompatibleCheckpoint as e:  # e.g. another rollout mode
        raise UserError(
            f"cannot resume from {ckpt.directory} in rl.rollout_mode={mode}: {e}"
        ) from None
    except checkpoints.CheckpointError as e:
        raise UserError(f"{ckpt.directory}: {e}") from None
    if found is None:
        return st, rng, 0, 0, 0
    st, rng, step, progress = _from_tree(found[1], st)
    position = progress["data_position"]
    if position != RL_DATA_OFFSET + step * prompts_per_step:
        raise UserError(
            f"cannot resume from {ckpt.directory} step {step}: data position "
            f"{position} does not match rl.prompts_per_step={prompts_per_step}"
        )
    return st, rng, step, progress["consecutive_skips"], progress["phi_warmup_steps"]


def warm_start_draft_head(ctx: RunContext, setup: RLSetup, st: TrainState, writer) -> TrainState:
    """rl.draft_head.warmup_steps before RL step 1: the head learns the warm-start policy on
    SFT solutions (teacher-forced batches of the training split, prompts_per_step *
    samples_per_prompt rows each, one Adam step each). Logged as phase draft_warmup."""
    h, c = setup.drafting.head, ctx.config.rl
    rows = c.prompts_per_step * c.samples_per_prompt
    one_step = dataclasses.replace(
        setup, drafting=dataclasses.replace(setup.drafting, head=dataclasses.replace(h, steps=1))
    )
    t0, progress = time.time(), Progress("draft_warmup", h.warmup_steps, every=ctx.config.log.every)
    key = jax.random.key(ctx.config.seed + 6)
    for i in range(h.warmup_steps):
        batch_problems = ctx.task.problems(
            "train", RL_DATA_OFFSET - (i + 1) * rows, rows, ctx.config.seed
        )
        tokens, mask = batches.encode_sft(ctx.tok, batch_problems, ctx.seq_width)
        batch = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)}
        if setup.plan is not None:
            batch = setup.plan.shard_batch(batch)
        st.draft_head, m = phases.update_draft_head(
            ctx, one_step, st, batch, jax.random.fold_in(key, i), prefix=""
        )
        progress.update(i + 1, m, ("loss", "kl", "top1_agree"))
    progress.close()
    m["time"] = time.time() - t0
    writer.write("draft_warmup", h.warmup_steps, m)
    return st


def warm_start_phi(ctx: RunContext, setup: RLSetup, st: TrainState, writer) -> TrainState:
    """distill.warmup_steps before RL step 1 (modes that train phi): phi distilled to the
    warm-start dense policy on the actor's own rollouts, theta frozen (phases.warmup_phi),
    with an optimizer state of its own (rl_state.phi_warmup_setup; RL's phi optimizer
    starts fresh after it). Logged as phase phi_warmup, one record per step."""
    total = ctx.config.distill.warmup_steps
    warm, tx = phi_warmup_setup(setup), phi_warmup_tx(ctx.config.lora)
    phi = dataclasses.replace(st, phi=Trainable(st.lora, place(setup, tx.init(st.lora)), tx))
    progress = Progress("phi_warmup", total, every=ctx.config.log.every)
    key = jax.random.key(ctx.config.seed + 7)
    for i in range(total):
        log = phases.PhaseLog("phi_warmup")
        phi.phi = log.run(
            "phi_warmup", phases.warmup_phi, ctx, warm, phi, jax.random.fold_in(key, i), i
        )
        m = log.summary()
        writer.write("phi_warmup", i + 1, m)
        progress.update(i + 1, m, ("kl_exact", "alpha_mean", "phi_loss"))
    progress.close()
    return dataclasses.replace(st, phi=dataclasses.replace(st.phi, params=phi.lora))


def plan_memory(ctx: RunContext, setup: RLSetup | None = None) -> memory_plan.Plan:
    """The run's device memory plan (train/memory_plan.py), printed in one line (and a
    warning per update whose estimate passes the limit); a UserError naming the field to
    change when no rollout chunk fits."""
    plan = memory_plan.for_run(ctx, setup or make_setup(ctx))
    print(f"[memory] {plan.line()}", flush=True)
    for warning in plan.warnings():
        print(f"[memory] warning: {warning}", flush=True)
    return plan


def train_rl(
    ctx: RunContext,
    workdir: str,
    sft_params,
    writer: MetricsWriter,
    plan: memory_plan.Plan | None = None,
):
    """RL from `sft_params`; `plan`: the run's memory plan (plan_memory) if already made."""
    c = ctx.config.rl
    setup = make_setup(ctx)
    plan = plan or plan_memory(ctx, setup)
    setup = dataclasses.replace(setup, rollout_chunks=plan.chunks)
    st = init_state(ctx, setup, sft_params)
    rng = jax.random.key(ctx.config.seed + 1)
    if setup.plan is not None:  # replicated on the mesh, like every checkpointed array
        rng = setup.plan.replicate(rng)
    if setup.plan is None:  # committed, like a restored key (see init_state)
        rng = jax.device_put(rng, jax.devices()[0])
    ckpt = checkpoints.Checkpointer(workdir, "checkpoints", keep=ctx.config.checkpoint.keep)
    st, rng, step, skips, warmed = _resume(ckpt, st, rng, setup.mode.name, c.prompts_per_step)
    if step:
        print(f"[rl] resuming from checkpoint at step {step}", flush=True)
    elif warmed:
        print(f"[rl] resuming after phi's warm start ({warmed} steps): not repeated", flush=True)
    # Metrics of work lost in a kill are redone (step 0's evaluation too, when no
    # checkpoint exists yet; phi's warm start when no checkpoint follows it).
    writer.drop_after("rl", step)
    writer.drop_after("eval", step if step else -1)
    writer.drop_after("phi_warmup", warmed)
    # A copy: the first update donates sft_params' buffers.
    ref_params = jax.tree.map(jnp.copy, sft_params) if setup.grpo.kl_coef > 0 else None
    if setup.plan is not None:
        ref_params = setup.plan.shard_state(ref_params)
    if step == 0:
        if ctx.config.distill.warmup_steps and not warmed:  # validation: modes with phi
            st = warm_start_phi(ctx, setup, st, writer)
            warmed = ctx.config.distill.warmup_steps
            try:  # step 0, marked, written before RL starts: a resume goes on from here
                tree = _saveable(st, rng, 0, RL_DATA_OFFSET, 0, warmed)
                ckpt.save(0, tree, force=True)
                ckpt.wait()
            except checkpoints.CheckpointError as e:  # non-finite phi: never saved
                ckpt.close()
                raise SystemExit(f"[rl] halted after phi's warm start: {e}") from None
        if st.draft_head is not None and setup.drafting.head.warmup_steps:
            st = warm_start_draft_head(ctx, setup, st, writer)
        evaluate(ctx, setup, st, 0, writer, jax.random.key(ctx.config.seed + 2))

    progress = Progress("rl", c.num_steps, start=step, every=ctx.config.log.every)
    while step < c.num_steps:
        rng, step_key = jax.random.split(rng)
        samples: list[dict] = []
        st, m = rl_step(ctx, setup, st, step_key, step, ref_params, samples)
        step += 1
        writer.write_samples(step, samples)
        # A non-finite loss or gradient skipped the update (steps.apply_update).
        skipped = m["skipped_updates"] + m.get("phi_skipped_updates", 0.0) > 0
        skips = skips + 1 if skipped else 0
        m["consecutive_skipped_steps"] = skips
        writer.write("rl", step, m)
        if c.max_consecutive_skips and skips >= c.max_consecutive_skips:
            progress.close()
            ckpt.close()
            raise SystemExit(
                f"[rl] halted at step {step}: {skips} consecutive steps with a non-finite "
                f"loss or gradient (rl.max_consecutive_skips={c.max_consecutive_skips}); "
                f"skipped updates leave theta/phi unchanged, the newest checkpoint is step "
                f"{ckpt.latest_step()}"
            )
        progress.update(
            step, m, ("reward", "accuracy", "response_length_mean", "kl_exact", "time_step")
        )
        if step % ctx.config.eval.every == 0 or step == c.num_steps:
            progress.close()
            evaluate(ctx, setup, st, step, writer, jax.random.fold_in(rng, 7))
        if step % ctx.config.checkpoint.every == 0 or step == c.num_steps:
            try:
                ckpt.save(
                    step,
                    _saveable(
                        st,
                        rng,
                        step,
                        RL_DATA_OFFSET + step * c.prompts_per_step,
                        skips,
                        warmed,
                    ),
                    force=step == c.num_steps,
                )
            except checkpoints.CheckpointError as e:  # non-finite state: never saved
                progress.close()
                ckpt.close()
                raise SystemExit(f"[rl] halted at step {step}: {e}") from None
            faults.maybe_kill("rl_checkpoint", step)  # the write is still in flight
    progress.close()
    ckpt.close()
    return st.theta.params
