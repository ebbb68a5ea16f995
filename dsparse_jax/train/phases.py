"""One RL step: `rl_step` runs its phases in order (METHOD.md, "Each RL iteration"):

  rollout       the actor samples M completions per prompt
  score         the task reward of every completion (host)
  select        the oversampling filter keeps n of M per prompt; GRPO advantages over them
                (with rl.prune the sampler already kept n per prompt: docs/pruning.md)
  update_head   (rl.prune) the quality head's online BCE update on the completed rows
  recompute     teacher-forced log-probs: dense theta, the actor's twin, mismatch metrics;
                theta's batch (old log-probs, off-policy corrections) and phi's teacher
  update_theta  PPO/GRPO minibatch updates of theta (phi is not an input)
  update_phi    theta frozen: L_PPO + lambda KL updates of phi on the same rollouts
  update_draft_head  (rl.draft=draft_head) the learned drafter's soft cross-entropy steps
                against the updated dense policy on the same rollouts

Every phase is a function (ctx, setup, ...) -> (output, metrics); `PhaseLog.run` times
each one the same way (time_<phase>, after its outputs are ready) and collects its
metrics. The phases read their settings from setup (rl_state.RLSetup), never from the
config; which attention, adapter and trainer a phase uses comes from the rollout mode's
properties in setup.mode (rl/modes.py). An update phase returns its entry of the
TrainState (trainables.Trainable), updated with the entry's own transform.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.data import batches
from dsparse_jax.data.rewards import graders
from dsparse_jax.data.task import Problem
from dsparse_jax.parallel import sharding
from dsparse_jax.reliability import faults
from dsparse_jax.rl import corrections, filtering, modes, objectives, pruning_metrics, shaping
from dsparse_jax.rl.losses import combine_metrics
from dsparse_jax.sampling.history import prompt_key
from dsparse_jax.sampling.sampler import PruneRecord, Rollout, buffer_length
from dsparse_jax.sampling.speculative import History, acceptance_summary
from dsparse_jax.train import distill, quality
from dsparse_jax.train import draft_head as draft_head_train
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.grpo import grpo_update
from dsparse_jax.train.recompute import (
    flatten_metrics,
    logprobs,
    of_rollout,
    rollout_metrics,
    row_groups,
)
from dsparse_jax.train.rl_state import RL_DATA_OFFSET, RLSetup
from dsparse_jax.train.rollouts import score as grade
from dsparse_jax.train.trainables import Trainable, TrainState

# A phase running longer than this says so on stderr, and again every PROGRESS_EVERY_S
# (a real model's rollout can take minutes with nothing else printed).
PROGRESS_AFTER_S, PROGRESS_EVERY_S = 10.0, 30.0


@contextlib.contextmanager
def still_running(what: str, after_s: float = PROGRESS_AFTER_S, every_s: float = PROGRESS_EVERY_S):
    """While the block runs: '[<what>] running, 10 s' on stderr after after_s, then every
    every_s (process 0 only; a timer thread, nothing on the device)."""
    t0, done = time.time(), threading.Event()

    def tell():
        wait = after_s
        while not done.wait(wait):
            print(f"[{what}] running, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            wait = every_s

    thread = None
    if jax.process_index() == 0:
        thread = threading.Thread(target=tell, daemon=True)
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join()


class PhaseLog:
    """Times every phase the same way and collects its metrics; a phase longer than
    PROGRESS_AFTER_S prints that it is still running (`label`: e.g. "rl step 3")."""

    def __init__(self, label: str = "rl"):
        self.metrics: dict = {}
        self.times: dict = {}
        self.label = label

    def run(self, name: str, phase, *args, record: bool = True):
        """phase(*args)'s output, once ready; its time adds to time_<name> (a phase that runs
        again, a further draw of dynamic sampling, adds up); record=False drops its metrics."""
        t = time.time()
        with still_running(f"{self.label} {name}"):
            out, metrics = phase(*args)
            jax.block_until_ready(out)
        self.times[f"time_{name}"] = self.times.get(f"time_{name}", 0.0) + time.time() - t
        if record:
            self.metrics.update(metrics)
        return out

    def summary(self) -> dict:
        return {**self.metrics, **self.times, "time_step": sum(self.times.values())}


class Generated(NamedTuple):
    """The rollout phase's output: M samples of each of this process's prompts."""

    problems: list[Problem]
    rollout: Rollout
    prune: PruneRecord | None = None  # rl.prune: rows are [n kept | label rows] per prompt


class Scored(NamedTuple):
    """The score phase's output."""

    rewards: np.ndarray  # [P * M], every process's rows
    texts: list[str]  # this process's completions
    local_rewards: np.ndarray  # this process's rows, aligned with texts


class Selected(NamedTuple):
    """The select phase's output: the kept n per prompt, their rewards and advantages."""

    kept: Rollout
    rewards: Any  # numpy [P * n] (overlong-shaped where rl.overlong.buffer > 0)
    adv: jax.Array  # f32 [P * n]
    recomputed: dict | None  # the recompute of the kept rows, when selection already needed it
    train_rows: Any = None  # numpy f32 [P * n]: 0 masks a row's loss in theta's update (None: all)
    generated: int = 0  # completion tokens the rollouts behind these rows generated


class Recomputed(NamedTuple):
    """The recompute phase's output: theta's batch and what phi distils towards."""

    theta_batch: dict
    teacher_logp: jax.Array | None  # dense log-probs before theta's update (distill cached)
    teacher_params: Any  # theta before its update (exact KL with distill.teacher=cached)


# -------------------------------------------------------------------------------- the step
def rl_step(
    ctx: RunContext,
    setup: RLSetup,
    st: TrainState,
    rng,
    step: int,
    ref_params=None,
    samples: list | None = None,
):
    """One RL iteration; returns (new TrainState, metrics). With a mesh (setup.plan) every
    jitted phase runs under it; each process makes its own block of prompts. `samples`, if
    given, receives a few {prompt, completion, reward} records of this step's rollouts
    (log.num_samples, this process's rows)."""
    with sharding.maybe_active(setup.plan):
        if setup.plan is not None:  # the same key on every process, replicated on the mesh
            rng = setup.plan.replicate(rng)
        k_roll, k_select, k_theta, k_phi = jax.random.split(rng, 4)
        k_draft = jax.random.fold_in(k_phi, 1)
        log = PhaseLog(f"rl step {step + 1}")
        gen = log.run("rollout", rollout, ctx, setup, st, k_roll, step)
        faults.maybe_kill("rl_rollout", step + 1)
        scored = log.run("score", score, ctx, setup, gen, step)
        if samples is not None:
            samples.extend(sample_records(gen, scored, setup.num_samples))
        sel = log.run("select", select, ctx, setup, st, gen, scored.rewards, k_select, step)
        if setup.selection.dynamic:  # DAPO: further draws until P informative groups
            sel = dynamic_sampling(ctx, setup, st, log, sel, (k_roll, k_select), step)
        head = st.quality_head
        if gen.prune is not None:  # the quality head learns from this step's completed rows
            head = log.run("update_head", update_head, ctx, setup, st, gen, scored.rewards)
        recomputed = log.run("recompute", recompute, ctx, setup, st, sel, ref_params, step)
        theta = log.run("update_theta", update_theta, ctx, setup, st, recomputed, k_theta)
        faults.maybe_kill("rl_update", step + 1)
        new = dataclasses.replace(st, theta=theta, quality_head=head)
        if setup.mode.updates_phi:  # theta frozen: phi tracks the dense policy
            new.phi = log.run("update_phi", update_phi, ctx, setup, new, sel, recomputed, k_phi)
        if st.draft_head is not None:  # the drafter tracks the updated policy
            batch = {"tokens": sel.kept.tokens, "mask": sel.kept.completion_mask}
            new.draft_head = log.run(
                "update_draft_head", update_draft_head, ctx, setup, new, batch, k_draft
            )
        m = log.summary()
        tokens = m.get("tokens_generated", sharding.to_host(gen.rollout.completion_lengths).sum())
        m["rollout_tokens_per_s"] = float(tokens / m["time_rollout"])
        return new, m


# ------------------------------------------------------------------------------ helpers
def gather_rows(tree, rows, plan=None):
    if plan is not None:  # one jitted gather on the mesh, rows batch-sharded
        return plan.take_rows(tree, rows)
    return jax.tree.map(lambda x: x[rows], tree)


def _recompute(ctx, setup: RLSetup, st: TrainState, r: Rollout, twin: bool = True) -> dict:
    """Dense theta and, with `twin`, the actor's twin on the rows of `r` (recompute.py)."""
    return of_rollout(ctx.graphdef, st.theta.params, st.lora, r, setup.recompute, twin)


@jax.jit
def _correction_terms(old_logp, rollout_logp, mask, cap, lo, hi):
    """TIS weights and MIS masks (token and sequence level) with their metrics."""
    w, tis_m = corrections.tis_weights(old_logp, rollout_logp, mask, cap)
    tok_mask, mis_tok = corrections.mis_mask(old_logp, rollout_logp, mask, lo, hi, "token")
    seq_mask, mis_seq = corrections.mis_mask(old_logp, rollout_logp, mask, lo, hi, "sequence")
    return {"tis": w, "mis_token": tok_mask, "mis_sequence": seq_mask}, {
        **tis_m,
        "mis_masked_frac": mis_tok["mis_masked_frac"],
        "mis_seq_masked_frac": mis_seq["mis_masked_frac"],
    }


def _minibatch_updates(
    update, trained: Trainable, batch, key, num_minibatches, plan=None, **kw
) -> tuple[Trainable, list]:
    """`update` of `trained` (its transform: tx) over a random split of the batch's rows
    into minibatches, in sequence; the updated entry and each minibatch's metrics."""
    b = batch["tokens"].shape[0]
    if b % num_minibatches:
        raise ValueError(f"rollout batch {b} not divisible by rl.minibatches={num_minibatches}")
    order = np.asarray(jax.random.permutation(key, b)).reshape(num_minibatches, -1)
    state, opt_state, ms = trained.params, trained.opt_state, []
    for rows in order:
        mb = gather_rows(batch, rows, plan)
        state, opt_state, m = update(state, opt_state, mb, tx=trained.tx, **kw)
        ms.append(m)
    return trained.replace(state, opt_state), jax.device_get(ms)


def _summarize_updates(ms: list[dict], prefix: str = "") -> dict:
    special = ("grad_norm", "skipped", "pg_num", "pg_den", "loss_num", "loss_den", "ppo_num")
    out = {
        prefix + k: float(v)
        for k, v in combine_metrics(
            [{k: v for k, v in um.items() if k not in special} for um in ms]
        ).items()
    }
    num, den = ("loss_num", "loss_den") if "loss_num" in ms[0] else ("pg_num", "pg_den")
    out[prefix + "loss"] = float(np.mean([um[num] / max(um[den], 1.0) for um in ms]))
    out[prefix + "grad_norm"] = float(np.mean([um["grad_norm"] for um in ms]))
    out[prefix + "skipped_updates"] = float(np.sum([um["skipped"] for um in ms]))
    return out


def select_rows(
    rewards_B,
    n: int,
    m: int,
    key,
    *,
    selection: str = "reward",
    rollout=None,
    dense_logp=None,
    acceptance_c: float = 1.0,
):
    """Rows (numpy [P * n], a prompt's kept samples contiguous) kept by the oversampling
    filter: the n of each prompt's M samples with the highest reward (ties at random), or
    with the highest acceptance rate vs the dense policy (needs the rollout and the dense
    log-probs of all its rows). M == n keeps every row in order."""
    b = np.asarray(rewards_B).shape[0]
    if m == n:
        return np.arange(b), {}
    p = b // m
    if selection == "reward":
        idx = filtering.top_n_by_reward(jnp.asarray(rewards_B).reshape(p, m), n, key)
        metrics = {}
    elif selection == "acceptance":
        idx, frac = filtering.acceptance_rate_select(
            dense_logp, rollout.logprobs, rollout.completion_mask, acceptance_c, n, m, key
        )
        metrics = {
            "acceptance_frac_generated": float(jnp.mean(frac)),
            "acceptance_frac_kept": float(jnp.mean(filtering.gather_kept(frac, idx, m))),
        }
    else:
        raise ValueError(f"unknown selection {selection!r} (reward | acceptance)")
    return np.asarray(filtering.flat_kept_indices(idx, m)), metrics


def theta_batch(
    mode: modes.RolloutMode,
    kept,
    adv_B,
    dense_logp,
    twin_logp,
    c: corrections.Correction,
    train_rows=None,
):
    """The theta update's batch and the off-policy correction metrics.

    old_logp: the trainer's policy before the update: the sparse twin (whose pages ride
    along in the batch) where the mode's trainer is sparse, else dense (theta, no
    adapter). The correction `c` against the rollout's log-probs mu: tis adds is_weights =
    min(pi_old / mu, tis_cap); mis replaces the mask with the MIS mask (mis_level token |
    sequence). The TIS clip and MIS mask fractions are always measured. train_rows [B]
    (Selected.train_rows): a 0 masks the row's loss (overlong filtering, dynamic sampling's
    fill).
    """
    trainer_sparse = mode.trainer_sparse
    old_logp = twin_logp if trainer_sparse else dense_logp
    mask = kept.completion_mask
    batch = {"tokens": kept.tokens, "mask": mask, "old_logp": old_logp, "adv": adv_B}
    pages = kept.pages()
    if trainer_sparse and pages is not None:
        batch["pages"] = pages
    corr, corr_m = _correction_terms(old_logp, kept.logprobs, mask, c.tis_cap, c.mis_lo, c.mis_hi)
    if c.kind == "tis":
        batch["is_weights"] = corr["tis"]
    elif c.kind == "mis":
        batch["mask"] = corr[f"mis_{c.mis_level}"]
    if train_rows is not None:
        batch["mask"] = batch["mask"] * jnp.asarray(train_rows, batch["mask"].dtype)[:, None]
    return batch, {k: float(v) for k, v in jax.device_get(corr_m).items()}


# ------------------------------------------------------------------------------- phases
def rollout(
    ctx: RunContext,
    setup: RLSetup,
    st: TrainState,
    key,
    step: int,
    data_start: int | None = None,
    draw: int = 0,
):
    """M samples per prompt from the actor (its attention and adapter: setup.mode) on RL step
    `step`'s prompts (its draw `draw` of dynamic sampling: each step owns max_draws prompt
    sets), or on those from training index `data_start` on. With a mesh each process makes
    its own block of prompts; the rollout is one global array."""
    plan, p = setup.plan, setup.prompts_per_step
    mine = slice(0, p) if plan is None else plan.local_slice(p)  # this process's prompts
    first = step * setup.selection.max_draws + draw
    start = RL_DATA_OFFSET + first * p if data_start is None else data_start
    batch_problems = ctx.task.problems(
        "train", start + mine.start, mine.stop - mine.start, setup.seed
    )
    local = batches.encode_prompts(ctx.tok, batch_problems, ctx.task.prompt_buffer())
    prompts, lengths = local
    if plan is not None:  # one global batch-sharded array from every process's rows
        prompts, lengths = plan.global_batch(prompts), plan.global_batch(lengths)
    scfg = setup.sampling
    if setup.drafting is not None:
        r, metrics = _speculative_rollout(ctx, setup, st, key, prompts, lengths, scfg, local)
        return Generated(batch_problems, r), metrics
    if setup.pruning is not None:  # M' rows per prompt, pruned to n (+ label rows) on the way
        scfg = dataclasses.replace(scfg, samples_per_prompt=setup.pruning.generated)
        r, record = ctx.sampler(
            st.theta.params,
            prompts,
            lengths,
            key,
            scfg,
            setup.rollout_spec,
            st.lora,
            setup.lora_scale,
            prune=setup.pruning.config,
            head=st.quality_head.params,
        )
        return Generated(batch_problems, r, record), {}
    r = ctx.sampler(
        st.theta.params,
        prompts,
        lengths,
        key,
        scfg,
        setup.rollout_spec,
        st.lora,
        setup.lora_scale,
        chunks=setup.rollout_chunks,
    )
    return Generated(batch_problems, r), {}


def _speculative_rollout(
    ctx, setup: RLSetup, st: TrainState, key, prompts, lengths, scfg, local: tuple
):
    """rollout_mode=speculative: an exact rollout of the dense policy from verified drafts
    (rl.draft); the history drafter reads and then extends the bank of earlier rollouts.
    local: this process's (prompts, lengths), numpy. With a mesh each process's bank holds
    the prompts it made: their rows join one global batch-sharded array like the prompts,
    and each process adds its own rows of the rollout."""
    d, bank, history, slots, plan = setup.drafting, st.history, None, None, setup.plan
    if bank is not None:
        local_prompts, local_lengths = local
        slots = bank.slots([prompt_key(p[:n]) for p, n in zip(local_prompts, local_lengths)])
        width = buffer_length(local_prompts.shape[1], scfg.max_new_tokens, ctx.spec.page_size)
        history = bank.rows(slots, width)
        if plan is not None:
            history = History(*(plan.global_batch(np.asarray(x)) for x in history))
    head = None
    if d.head is not None:
        head = (d.head.graphdef, st.draft_head.params)
    r, stats = d.sampler(
        st.theta.params,
        prompts,
        lengths,
        key,
        scfg,
        d.config,
        setup.rollout_spec,
        st.lora,
        setup.lora_scale,
        history=history,
        head=head,
    )
    if bank is not None:
        rows = (
            (r.tokens, r.lengths) if plan is None else map(plan.local_rows, (r.tokens, r.lengths))
        )
        bank.add(slots, *rows, scfg.samples_per_prompt)
    k = d.config.draft_tokens
    metrics = jax.device_get(acceptance_summary(stats, k))
    return r, {name: float(v) for name, v in metrics.items()}


def score(ctx: RunContext, setup: RLSetup, gen: Generated, step: int = 0):
    """Rewards of all M samples per prompt (numpy [P * M]) and the completions' text; with
    a mesh each process grades its own groups and the rewards are all-gathered (P * M
    floats; the texts stay this process's)."""
    plan = setup.plan
    local = gen.rollout if plan is None else plan.local_rollout(gen.rollout)
    scored, texts = grade(ctx.tok, local, gen.problems, ctx.rewarder, f"RL step {step + 1}")
    r = scored.rewards if plan is None else plan.gather_rows(scored.rewards)
    r = np.asarray(r)
    ncomp = sharding.to_host(gen.rollout.completion_lengths)
    return Scored(r, texts, np.asarray(scored.rewards)), {
        **scored.metrics,
        "reward": float(r.mean()),
        "accuracy": float(graders.is_correct(r).mean()),
        "response_length_mean": float(ncomp.mean()),
        "response_length_max": int(ncomp.max()),
    }


def sample_records(gen: Generated, scored: Scored, count: int) -> list[dict]:
    """The first sample of each of the first `count` prompts: {prompt, completion, reward,
    answer} (samples.jsonl)."""
    m = len(scored.texts) // max(1, len(gen.problems))
    return [
        {
            "prompt": p.prompt,
            "completion": scored.texts[i * m],
            "reward": float(scored.local_rewards[i * m]),
            "answer": p.answer,
        }
        for i, p in enumerate(gen.problems[:count])
    ]


def _every(every: int, step: int) -> bool:
    """Whether a figure computed every `every` RL steps (0: never) is due at `step`."""
    return every > 0 and step % every == 0


def _all_rows_step(setup: RLSetup, step: int) -> bool:
    """Whether this RL step's mismatch figures are also computed on all M generated rows
    (metrics.all_rows_every)."""
    return _every(setup.recompute.all_rows_every, step)


def twin_step(setup: RLSetup, step: int) -> bool:
    """Whether this RL step recomputes the actor's twin: every step where the trainer or
    phi needs it; where only the mismatch figures read it (mode.twin_metrics_only), every
    metrics.twin_every steps (0: never)."""
    return not setup.mode.twin_metrics_only or _every(setup.recompute.twin_every, step)


def select(ctx, setup: RLSetup, st: TrainState, gen: Generated, rewards_all, key, step: int):
    """Which rows train, in this order (docs/objectives.md, "Which rows train"): pruning has
    kept n of each prompt's M' rows inside the sampler (rl.prune); overlong shaping adds its
    length penalty to the rewards (rl.overlong.buffer); the oversampling filter keeps n of
    each prompt's M samples (rl.selection); advantages over the kept n (rl.advantage);
    overlong filtering masks the loss of truncated rows (rl.overlong.filter). Dynamic
    sampling (rl.dynamic_sampling) then works on whole groups: `dynamic_sampling`.
    Selection by acceptance rate, and with M > n every metrics.all_rows_every steps,
    recomputes all M rows first: their mismatch figures are logged as all_*, and the
    recompute phase reuses the kept rows' arrays (the twin on the steps `twin_step` says)."""
    s, plan, n, big_m = setup.selection, setup.plan, setup.n, setup.m
    r = gen.rollout
    recomputed = None
    generated = int(sharding.to_host(r.completion_lengths).sum())
    if gen.prune is not None:  # the kept n of each prompt; label rows only train the head
        generated = int(sharding.to_host(gen.prune.tokens_generated))
        kept_rows = pruned_kept_rows(len(rewards_all), setup.pruning.config)
        r, rewards_all = gather_rows(r, kept_rows, plan), rewards_all[kept_rows]
    metrics = {}
    if s.overlong_buffer > 0:  # DAPO's soft overlong punishment, before any selection
        penalty = np.asarray(
            shaping.overlong_penalty(
                jnp.asarray(sharding.to_host(r.completion_lengths)),
                setup.sampling.max_new_tokens,
                s.overlong_buffer,
                s.overlong_penalty,
            )
        )
        rewards_all = rewards_all + penalty.astype(rewards_all.dtype)
        metrics["overlong_penalty_mean"] = float(penalty.mean())
    if big_m > n and (s.kind == "acceptance" or _all_rows_step(setup, step)):
        recomputed = _recompute(ctx, setup, st, r, twin_step(setup, step))  # all M rows
    rows, select_metrics = select_rows(
        rewards_all,
        n,
        big_m,
        key,
        selection=s.kind,
        rollout=r,
        dense_logp=None if recomputed is None else recomputed["dense_logp"],
        acceptance_c=s.acceptance_c,
    )
    metrics.update(select_metrics)
    kept, rewards = r, rewards_all
    if big_m > n:
        kept, rewards = gather_rows(r, rows, plan), rewards_all[rows]
    if plan is not None:
        kept = plan.shard_batch(kept)
    if recomputed is not None:  # all M rows' figures as all_*; the kept rows' from their arrays
        metrics.update(flatten_metrics(jax.device_get(recomputed["metrics"]), "all_"))
        recomputed = gather_rows(
            {k: v for k, v in recomputed.items() if k != "metrics"}, rows, plan
        )
        recomputed["metrics"] = rollout_metrics(recomputed, kept, setup.recompute)
    adv_B = objectives.ADVANTAGES[s.advantage].fn(jnp.asarray(rewards), n)
    adv_B = sharding.as_global(plan, adv_B)
    if faults.action("rl_nan", step + 1) == "nan":  # test hook: a non-finite loss
        adv_B = adv_B * jnp.nan
    train_rows = None
    if s.overlong_filter:  # DAPO's overlong filtering: truncated rows do not train
        cut = np.asarray(
            shaping.truncated(kept.tokens, kept.completion_mask, setup.sampling.eos_id)
        )
        train_rows = (~cut).astype(np.float32)
        metrics["overlong_truncated_frac"] = float(cut.mean())
    sel = Selected(kept, rewards, adv_B, recomputed, train_rows, generated)
    metrics.update(kept_figures(sel, n))
    return sel, metrics


def kept_figures(sel: Selected, n: int) -> dict:
    """The figures of the rows that train: their rewards and lengths, the fraction of groups
    whose rewards vary, and the completion tokens generated and trained."""
    lengths = sharding.to_host(sel.kept.completion_lengths)
    if sel.train_rows is not None:
        lengths = lengths * sel.train_rows
    trained = int(lengths.sum())
    mixed = pruning_metrics.groups_mixed(np.asarray(sel.rewards).reshape(-1, n))
    useful = mixed * len(sel.rewards)  # rows in groups with a non-zero advantage
    return dict(
        reward_kept=float(sel.rewards.mean()),
        response_length_kept_mean=float(sharding.to_host(sel.kept.completion_lengths).mean()),
        groups_mixed=mixed,
        tokens_generated=sel.generated,
        tokens_trained=trained,
        tokens_per_useful_row=sel.generated / useful if useful else float("nan"),
    )


def dynamic_sampling(ctx, setup: RLSetup, st: TrainState, log: PhaseLog, sel: Selected, keys, step):
    """DAPO's dynamic sampling (rl.dynamic_sampling), after `select` on the step's first
    draw: a group whose kept rewards are all equal has zero advantage, so while fewer than
    P = prompts_per_step groups are informative and fewer than max_draws draws were made,
    the step draws P further prompts (rollout, score, select: the same shapes, no new
    compile) and keeps P groups of the 2P at hand (`filtering.fill_groups`: informative
    first, earlier draws first). Past max_draws the batch is filled with uninformative
    groups whose loss is masked (Selected.train_rows). Times add to the phases'; metrics
    in `log` (groups drawn, informative and kept; the extra rollout tokens)."""
    n, p = setup.n, setup.prompts_per_step
    k_roll, k_select = keys
    informative = lambda x: np.asarray(filtering.informative_groups(x.rewards.reshape(-1, n)))
    drawn, found, first_tokens = 1, int(informative(sel).sum()), sel.generated
    while int(informative(sel).sum()) < p and drawn < setup.selection.max_draws:
        k_r, k_s = jax.random.fold_in(k_roll, drawn), jax.random.fold_in(k_select, drawn)
        gen = log.run("rollout", rollout, ctx, setup, st, k_r, step, None, drawn, record=False)
        scored = log.run("score", score, ctx, setup, gen, step, record=False)
        more = log.run(
            "select", select, ctx, setup, st, gen, scored.rewards, k_s, step, record=False
        )
        found += int(informative(more).sum())
        sel = merge_groups(setup, sel, more, informative(sel), informative(more))
        drawn += 1
    keep = np.repeat(informative(sel), n).astype(np.float32)  # fill groups do not train
    rows = keep if sel.train_rows is None else keep * sel.train_rows
    sel = sel._replace(train_rows=rows)
    metrics = kept_figures(sel, n)
    metrics.update(
        dynamic_draws=drawn,
        dynamic_groups_drawn=drawn * p,
        dynamic_groups_informative=found,
        dynamic_groups_kept=int(informative(sel).sum()),
        groups_mixed_drawn=found / (drawn * p),
        dynamic_extra_tokens=sel.generated - first_tokens,
    )
    log.metrics.update(metrics)
    return sel


def merge_groups(setup: RLSetup, a: Selected, b: Selected, inf_a, inf_b) -> Selected:
    """P groups of the 2P of two selections (a's first): `filtering.fill_groups` of their
    informative flags; every per-row array gathered, fixed shapes."""
    n, plan = setup.n, setup.plan
    groups = filtering.fill_groups(np.concatenate([inf_a, inf_b]), setup.prompts_per_step)
    rows = (groups[:, None] * n + np.arange(n)[None]).reshape(-1)
    both = lambda x, y: jax.tree.map(lambda u, v: jnp.concatenate([u, v]), x, y)
    kept = gather_rows(both(a.kept, b.kept), rows, plan)
    if plan is not None:
        kept = plan.shard_batch(kept)
    recomputed = None
    if a.recomputed is not None:
        arrays = lambda rec: {k: v for k, v in rec.items() if k != "metrics"}
        recomputed = gather_rows(both(arrays(a.recomputed), arrays(b.recomputed)), rows, plan)
        recomputed["metrics"] = rollout_metrics(recomputed, kept, setup.recompute)
    train_rows = None
    if a.train_rows is not None:  # overlong filtering: every draw's select sets it
        train_rows = np.concatenate([a.train_rows, b.train_rows])[rows]
    return Selected(
        kept,
        np.concatenate([a.rewards, b.rewards])[rows],
        sharding.as_global(plan, jnp.concatenate([a.adv, b.adv])[rows]),
        recomputed,
        train_rows,
        a.generated + b.generated,
    )


def pruned_kept_rows(rows: int, prune) -> np.ndarray:
    """The GRPO rows of a pruned rollout: the first n of each prompt's rows_per_prompt."""
    per = prune.rows_per_prompt
    return (np.arange(rows // per)[:, None] * per + np.arange(prune.n)[None]).reshape(-1)


def update_head(ctx, setup: RLSetup, st: TrainState, gen: Generated, rewards_all):
    """rl.prune: the quality head's metrics on this step's completed rows (its scores were
    made before this update: AUC and calibration, weighted by the rows each stands for),
    the reward variance of groups before and after pruning, tokens against an unpruned
    M'-row rollout; then `head_steps` BCE steps on the same rows."""
    record, prune = gen.prune, setup.pruning.config
    record_h = jax.device_get(record)
    rewards = np.asarray(rewards_all)
    f, y, w, s = quality.training_pairs(record_h, rewards)
    cal = pruning_metrics.calibration(s, y, w)
    head = st.quality_head
    params, opt_state, before, after = quality.quality_head_update(
        head.params,
        head.opt_state,
        jnp.asarray(f),
        jnp.asarray(y),
        jnp.asarray(w),
        tx=head.tx,
        steps=setup.pruning.head_steps,
    )
    per = prune.rows_per_prompt
    by_prompt = rewards.reshape(-1, per)
    lengths = sharding.to_host(gen.rollout.completion_lengths).astype(np.float64)
    label = np.asarray(record_h.is_label)
    pruned_rows = len(by_prompt) * (setup.pruning.generated - per)  # never completed
    fill = lengths[label].mean() if label.any() else lengths.mean()
    unpruned = lengths.sum() + pruned_rows * fill  # label rows: a random draw of the pruned
    generated = float(record_h.tokens_generated)
    metrics = {
        "prune_head_auc": pruning_metrics.weighted_auc(s, y, w),
        "prune_head_ece": cal["ece"],
        "prune_head_mean_pred": cal["mean_pred"],
        "prune_head_mean_label": cal["mean_label"],
        "prune_head_loss": float(before),
        "prune_head_loss_after": float(after),
        "prune_groups_mixed_kept": pruning_metrics.groups_mixed(by_prompt[:, : prune.n]),
        # kept + label rows: a lower bound on the M' rows' (before pruning)
        "prune_groups_mixed_completed": pruning_metrics.groups_mixed(by_prompt),
        "prune_reward_label": float(rewards[label].mean()) if label.any() else float("nan"),
        "prune_tokens_generated": generated,
        "prune_tokens_unpruned_est": float(unpruned),
        "prune_token_ratio": generated / float(unpruned),
    }
    for c in range(len(prune.positions)):  # per checkpoint, its scored rows
        m = np.asarray(record_h.scored)[:, c]
        metrics[f"prune_head_auc_cp{c}"] = pruning_metrics.weighted_auc(
            np.asarray(record_h.scores)[m, c], rewards[m] >= 1.0, np.asarray(record_h.weight)[m]
        )
    return head.replace(params, opt_state), metrics


def recompute(ctx, setup: RLSetup, st: TrainState, sel: Selected, ref_params, step: int = 0):
    """Teacher-forced forwards of the kept rows, no gradient: dense (theta, no adapter), the
    actor's twin (on the steps `twin_step` says), exact mismatch metrics; theta's batch
    with its old log-probs and off-policy corrections; the reference log-probs
    (rl.kl_coef > 0); and, where phi is trained, its teacher cached before theta moves."""
    kept, recomputed = sel.kept, sel.recomputed
    if recomputed is None:
        recomputed = _recompute(ctx, setup, st, kept, twin_step(setup, step))
    batch, metrics = theta_batch(
        setup.mode,
        kept,
        sel.adv,
        recomputed["dense_logp"],
        recomputed.get("twin_logp"),
        setup.correction,
        sel.train_rows,
    )
    if setup.grpo.kl_coef > 0:
        batch["ref_logp"], _ = logprobs(
            ref_params,
            kept.tokens,
            batch.get("pages"),
            graphdef=ctx.graphdef,
            temperature=setup.grpo.temperature,
            spec=setup.grpo.spec,
            chunks=row_groups(kept.tokens.shape[0], setup.recompute),
        )
    teacher_logp = teacher_params = None
    if setup.mode.updates_phi and setup.distill.teacher == "cached":
        if setup.distill.exact:  # the teacher's full logits: theta before its update
            teacher_params = jax.tree.map(jnp.copy, st.theta.params)
        else:
            teacher_logp = recomputed["dense_logp"]
    flat = flatten_metrics(jax.device_get(recomputed["metrics"]))
    metrics.update(flat)
    if setup.m == setup.n:  # the kept rows are all the generated rows
        metrics.update({"all_" + k: v for k, v in flat.items()})
    return Recomputed(batch, teacher_logp, teacher_params), metrics


def update_theta(ctx, setup: RLSetup, st: TrainState, recomputed: Recomputed, key):
    """PPO/GRPO over rl.minibatches minibatches of the kept rows (phi is not an input)."""
    theta, ms = _minibatch_updates(
        grpo_update,
        st.theta,
        recomputed.theta_batch,
        key,
        setup.minibatches,
        setup.plan,
        graphdef=ctx.graphdef,
        settings=setup.grpo,
    )
    return theta, _summarize_updates(ms)


def update_draft_head(ctx, setup: RLSetup, st: TrainState, batch: dict, key, prefix="draft_head_"):
    """rl.draft=draft_head, after theta's update (st.theta is the new theta): the head's
    soft cross-entropy steps against the detached dense policy on `batch` {"tokens",
    "mask"} (the step's kept rows, or SFT solutions for the warm start), over
    rl.minibatches minibatches (train/draft_head.py)."""
    h = setup.drafting.head
    head, ms = _minibatch_updates(
        draft_head_train.draft_head_update,
        st.draft_head,
        batch,
        key,
        setup.minibatches,
        setup.plan,
        params=st.theta.params,
        graphdef=ctx.graphdef,
        head_graphdef=h.graphdef,
        layers=h.layers,
        steps=h.steps,
        temperature=h.temperature,
        loss_weight=h.loss_weight,
        unroll=h.unroll,
    )
    metrics = {prefix + k: float(np.mean([m[k] for m in ms])) for k in ms[0]}
    return head, metrics


def phi_rows(rows: int, stride: int) -> np.ndarray:
    """The kept rows phi trains on: every `stride`-th (config distill.row_stride)."""
    return np.arange(0, rows, stride)


def update_phi(ctx, setup: RLSetup, st: TrainState, sel: Selected, recomputed: Recomputed, key):
    """theta frozen (st.theta is the updated theta): phi's updates on the same rollouts
    (setup.distill: [L_PPO +] lambda D(actor, teacher)), against the dense teacher (cached
    before theta's update, or recomputed with the updated theta), on every
    distill.row_stride-th kept row. In a speculative sparse_self rollout the actor's twin
    is the drafter (batch key draft_start)."""
    kept, stride = sel.kept, setup.phi_row_stride
    phi_batch = {
        "tokens": kept.tokens,
        "mask": kept.completion_mask,
        "adv": sel.adv,
        "rollout_logp": kept.logprobs,
        "pages": kept.pages(),
    }
    if kept.draft_start is not None:
        phi_batch["draft_start"] = kept.draft_start
    if recomputed.teacher_logp is not None:
        phi_batch["teacher_logp"] = recomputed.teacher_logp
    if stride > 1:
        phi_batch = gather_rows(phi_batch, phi_rows(kept.tokens.shape[0], stride), setup.plan)
    teacher_params = recomputed.teacher_params
    if setup.distill.teacher == "recomputed":
        if setup.distill.exact:  # the teacher's full logits come from a forward in the step
            teacher_params = st.theta.params
        else:  # dense log-probs of the updated theta
            tokens = phi_batch["tokens"]
            phi_batch["teacher_logp"], _ = logprobs(
                st.theta.params,
                tokens,
                graphdef=ctx.graphdef,
                temperature=setup.distill.temperature,
                chunks=row_groups(tokens.shape[0], setup.recompute),
            )
    phi, ms = _minibatch_updates(
        distill.phi_update,
        st.phi,
        phi_batch,
        key,
        setup.minibatches,
        setup.plan,
        params=st.theta.params,
        teacher_params=teacher_params,
        graphdef=ctx.graphdef,
        settings=setup.distill,
    )
    return phi, _summarize_updates(ms, prefix="phi_")


def warmup_phi(ctx, setup: RLSetup, st: TrainState, key, i: int):
    """Step i (0-based) of phi's warm start (distill.warmup_steps, before RL step 1; setup:
    rl_state.phi_warmup_setup): the actor's rollout (the mode's, with its draft record in
    speculative sparse_self) of the training prompts before RL's, the twin's mismatch
    figures on it, then phi's update towards theta, which stays frozen."""
    plan, p = setup.plan, setup.prompts_per_step
    k_roll, k_phi = jax.random.split(key)
    gen, metrics = rollout(ctx, setup, st, k_roll, 0, data_start=RL_DATA_OFFSET - (i + 1) * p)
    kept = gen.rollout if plan is None else plan.shard_batch(gen.rollout)
    recomputed = _recompute(ctx, setup, st, kept)
    adv_B = sharding.as_global(plan, jnp.zeros(kept.tokens.shape[0], jnp.float32))  # unread
    teacher_logp = recomputed["dense_logp"] if setup.distill.teacher == "cached" else None
    phi, phi_metrics = update_phi(
        ctx,
        setup,
        st,
        Selected(kept, None, adv_B, None),
        Recomputed(None, teacher_logp, None),
        k_phi,
    )
    metrics.update(flatten_metrics(jax.device_get(recomputed["metrics"])))
    return phi, {**metrics, **phi_metrics}
