"""The RL loop: rollout -> rewards -> advantages -> log-prob recompute -> GRPO update.

Resumable: the checkpoint holds params, optimizer state, the RNG key, the step and the
data position; a restart continues from the latest checkpoint in <workdir>/checkpoints
and drops metrics of steps it is about to redo.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.data import batches
from dsparse_jax.data.math_task import problems
from dsparse_jax.rl.advantages import grpo_advantages
from dsparse_jax.rl.losses import combine_metrics
from dsparse_jax.sampling.sampler import SamplingConfig
from dsparse_jax.train import checkpoints, steps
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.evaluation import score
from dsparse_jax.train.grpo import GRPOSettings, grpo_update, recompute_logprobs
from dsparse_jax.train.metrics import MetricsWriter, Progress

RL_DATA_OFFSET = 10_000_000  # RL prompts come from train indices disjoint from SFT's


def settings_from(c) -> GRPOSettings:
    return GRPOSettings(temperature=c.temperature, clip_low=c.clip_low,
                        clip_high=c.clip_high, dual_clip=c.dual_clip or None,
                        loss_agg=c.loss_agg, kl_coef=c.kl_coef, kl_kind=c.kl_kind,
                        microbatches=c.microbatches)


def optimizer_from(c):
    return steps.make_optimizer(c.learning_rate, warmup_steps=c.warmup_steps,
                                total_steps=c.num_steps, weight_decay=c.weight_decay,
                                max_grad_norm=c.max_grad_norm, schedule=c.schedule)


def evaluate(ctx: RunContext, params, step: int, writer: MetricsWriter, key) -> dict:
    e = ctx.config.eval
    t0 = time.time()
    m = {"greedy_accuracy": ctx.evaluator.greedy(params)}
    if e.mean_at_k:
        m[f"mean_at_{e.mean_at_k}"] = ctx.evaluator.mean_at_k(
            params, e.mean_at_k, ctx.config.rl.temperature, key)
    m["time"] = time.time() - t0
    record = writer.write("eval", step, m)
    print(f"[eval] step {step}: " + " ".join(f"{k} {v:.3f}" for k, v in record.items()
                                             if k not in ("phase", "step")), flush=True)
    return record


def rl_step(ctx: RunContext, params, opt_state, tx, settings, rng, step: int, ref_params):
    """One RL iteration. Returns (params, opt_state, metrics)."""
    c = ctx.config.rl
    n, p = c.samples_per_prompt, c.prompts_per_step
    k_roll, k_shuffle = jax.random.split(rng)
    batch_problems = problems(ctx.task, "train", RL_DATA_OFFSET + step * p, p, ctx.config.seed)
    prompts, lengths = batches.encode_prompts(ctx.tok, batch_problems,
                                              batches.prompt_buffer(ctx.task))
    scfg = SamplingConfig(max_new_tokens=batches.completion_budget(ctx.task),
                          eos_id=ctx.tok.eos_id, pad_id=ctx.tok.pad_id,
                          temperature=c.temperature, samples_per_prompt=n)
    times = {}

    t = time.time()
    rollout = ctx.sampler(params, prompts, lengths, k_roll, scfg, ctx.spec)
    jax.block_until_ready(rollout.tokens)
    times["time_rollout"] = time.time() - t

    t = time.time()
    rewards_B, _ = score(ctx.tok, rollout, batch_problems, ctx.config.task.format_reward)
    adv_B = grpo_advantages(jnp.asarray(rewards_B), n, scale_by_std=c.scale_adv_by_std)
    times["time_rewards"] = time.time() - t

    t = time.time()
    old_logp, _ = recompute_logprobs(params, rollout.tokens, graphdef=ctx.graphdef,
                                     temperature=c.temperature)
    batch = {"tokens": rollout.tokens, "mask": rollout.completion_mask,
             "old_logp": old_logp, "adv": adv_B}
    if settings.kl_coef > 0:
        batch["ref_logp"], _ = recompute_logprobs(ref_params, rollout.tokens,
                                                  graphdef=ctx.graphdef,
                                                  temperature=c.temperature)
    jax.block_until_ready(old_logp)
    times["time_recompute"] = time.time() - t

    t = time.time()
    b = rollout.tokens.shape[0]
    if b % c.minibatches:
        raise ValueError(f"rollout batch {b} not divisible by rl.minibatches={c.minibatches}")
    order = jax.random.permutation(k_shuffle, b).reshape(c.minibatches, -1)
    update_metrics = []
    for rows in order:
        mb = jax.tree.map(lambda x: x[rows], batch)
        params, opt_state, m = grpo_update(params, opt_state, mb, graphdef=ctx.graphdef,
                                           tx=tx, settings=settings)
        update_metrics.append(m)
    update_metrics = jax.device_get(update_metrics)
    times["time_update"] = time.time() - t

    m = {k: v for k, v in combine_metrics(
        [{k: v for k, v in um.items() if k not in ("grad_norm", "skipped", "pg_num", "pg_den")}
         for um in update_metrics]).items()}
    m["loss"] = float(np.mean([um["pg_num"] / max(um["pg_den"], 1.0) for um in update_metrics]))
    m["grad_norm"] = float(np.mean([um["grad_norm"] for um in update_metrics]))
    m["skipped_updates"] = float(np.sum([um["skipped"] for um in update_metrics]))
    ncomp = np.asarray(rollout.completion_lengths)
    m.update(reward=float(rewards_B.mean()), accuracy=float((rewards_B == 1.0).mean()),
             response_length_mean=float(ncomp.mean()), response_length_max=int(ncomp.max()),
             rollout_tokens_per_s=float(ncomp.sum() / times["time_rollout"]), **times)
    m["time_step"] = sum(times.values())
    return params, opt_state, m


def train_rl(ctx: RunContext, workdir: str, sft_params, writer: MetricsWriter):
    c = ctx.config.rl
    tx = optimizer_from(c)
    settings = settings_from(c)
    opt_state = tx.init(sft_params)
    params, rng, step = sft_params, jax.random.key(ctx.config.seed + 1), 0
    ckpt = checkpoints.Checkpointer(workdir, "checkpoints", keep=ctx.config.checkpoint.keep)
    latest = ckpt.latest_step()
    if latest is not None:
        tree = ckpt.restore(latest, checkpoints.to_saveable(params, opt_state, rng=rng, step=0,
                                                            extra={"data_position": 0}))
        params, opt_state, rng, step, _ = checkpoints.from_saveable(tree, params, opt_state)
        print(f"[rl] resuming from checkpoint at step {step}", flush=True)
        writer.drop_after("rl", step)
        writer.drop_after("eval", step)
    ref_params = sft_params if settings.kl_coef > 0 else None
    if step == 0:
        evaluate(ctx, params, 0, writer, jax.random.key(ctx.config.seed + 2))

    progress = Progress("rl", c.num_steps, start=step)
    while step < c.num_steps:
        rng, step_key = jax.random.split(rng)
        params, opt_state, m = rl_step(ctx, params, opt_state, tx, settings, step_key, step,
                                       ref_params)
        step += 1
        writer.write("rl", step, m)
        progress.update(step, m, ("reward", "accuracy", "response_length_mean", "time_step"))
        if step % ctx.config.eval.every == 0 or step == c.num_steps:
            evaluate(ctx, params, step, writer, jax.random.fold_in(rng, 7))
        if step % ctx.config.checkpoint.every == 0 or step == c.num_steps:
            ckpt.save(step, checkpoints.to_saveable(
                params, opt_state, rng=rng, step=step,
                extra={"data_position": RL_DATA_OFFSET + step * c.prompts_per_step}),
                force=step == c.num_steps)
    ckpt.close()
    return params
