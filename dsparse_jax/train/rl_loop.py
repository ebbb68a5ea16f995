"""The RL loop. One iteration, in every rollout mode (rl.rollout_mode):

  rollout (M per prompt) -> rewards -> filter to n per prompt -> GRPO advantages over the
  kept n -> teacher-forced recompute -> theta update -> [distillsparse: phi update]

  mode           actor (rollout)               trainer old logp / update    phi
  dense          dense, theta                  dense                        -
  sparse         sparse, theta                 dense                        -
  sparse_train   sparse, theta                 sparse twin (rollout pages)  -
  distillsparse  sparse, theta + LoRA phi      dense (no adapter)           L_PPO + lambda KL

Off-policy corrections (rl.is_correction: tis | mis, against the rollout's log-probs mu)
compose with any mode. Mismatch metrics (trainer-side twin of the actor vs the dense
policy, exact from full logits) are logged every step; see distill.py.

Resumable: the checkpoint holds params, optimizer state, the RNG key (every step's
rollout, filter and shuffle keys derive from it), the step, the data position and the
count of consecutive skipped steps, and in distillsparse the LoRA tree and its optimizer
state; a restart continues exactly from the newest usable checkpoint in
<workdir>/checkpoints (corrupt ones are skipped) and drops metrics of steps it is about to
redo. A non-finite loss or gradient skips the update; rl.max_consecutive_skips in a row
halt the run. See docs/reliability.md.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.data import batches
from dsparse_jax.data.sources import problems
from dsparse_jax.model.lora import init_lora
from dsparse_jax.rl import corrections, filtering
from dsparse_jax.rl.advantages import grpo_advantages
from dsparse_jax.rl.losses import combine_metrics
from dsparse_jax.sampling.sampler import SamplingConfig
from dsparse_jax.train import checkpoints, distill, faults, sharding, steps
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.evaluation import score
from dsparse_jax.train.grpo import GRPOSettings, grpo_update, recompute_logprobs
from dsparse_jax.train.metrics import MetricsWriter, Progress

RL_DATA_OFFSET = 10_000_000  # RL prompts come from train indices disjoint from SFT's


def settings_from(c, spec: AttentionSpec = AttentionSpec()) -> GRPOSettings:
    return GRPOSettings(
        temperature=c.temperature,
        clip_low=c.clip_low,
        clip_high=c.clip_high,
        dual_clip=c.dual_clip or None,
        loss_agg=c.loss_agg,
        kl_coef=c.kl_coef,
        kl_kind=c.kl_kind,
        microbatches=c.microbatches,
        spec=spec,
    )


def optimizer_from(c, total_steps: int | None = None):
    return steps.make_optimizer(
        c.learning_rate,
        warmup_steps=c.warmup_steps,
        total_steps=total_steps or c.num_steps,
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
        schedule=c.schedule,
    )


@dataclasses.dataclass
class TrainState:
    """theta (+ its optimizer) and, in distillsparse, phi (+ its own optimizer)."""

    params: object
    opt_state: object
    lora: dict | None = None
    lora_opt_state: object = None


@dataclasses.dataclass(frozen=True)
class RLSetup:
    """What a run derives once from its config (optimizers, static settings, specs)."""

    mode: str
    n: int  # kept samples per prompt (GRPO group)
    m: int  # generated samples per prompt (M >= n)
    tx: object
    settings: GRPOSettings
    rollout_spec: AttentionSpec  # the actor's attention
    twin_spec: AttentionSpec | None  # the trainer-side twin of the actor (None: dense mode)
    lora_scale: float = 1.0
    lora_tx: object = None
    distill: distill.DistillSettings | None = None
    num_bins: int = 1
    plan: sharding.MeshPlan | None = None  # the device mesh (None: one device, unsharded)

    @property
    def distilling(self) -> bool:
        return self.mode == "distillsparse"


def make_setup(ctx: RunContext) -> RLSetup:
    c = ctx.config.rl
    mode = c.rollout_mode
    n = c.samples_per_prompt
    m = c.samples_generated or n
    rollout_spec = ctx.rollout_spec if mode != "dense" else ctx.spec
    trainer_spec = rollout_spec if mode == "sparse_train" else ctx.spec
    lora_scale, lora_tx, dset = 1.0, None, None
    if mode == "distillsparse":
        lora_scale = ctx.lora_cfg.scale
        lora_tx = optimizer_from(ctx.config.lora, total_steps=c.num_steps)
        d = ctx.config.distill
        dset = distill.DistillSettings(
            spec=rollout_spec,
            lora_scale=lora_scale,
            temperature=c.temperature,
            loss=d.loss,
            kl=d.kl,
            kl_coef=d.kl_coef,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            dual_clip=c.dual_clip or None,
            loss_agg=c.loss_agg,
            microbatches=c.microbatches,
        )
    bins = max(1, math.ceil(batches.completion_budget(ctx.task) / ctx.config.metrics.position_bin))
    plan = sharding.plan_from_config(ctx.config)
    sharding.check_rl_batches(plan, c)
    return RLSetup(
        plan=plan,
        mode=mode,
        n=n,
        m=m,
        tx=optimizer_from(c),
        settings=settings_from(c, trainer_spec),
        rollout_spec=rollout_spec,
        twin_spec=None if mode == "dense" else rollout_spec,
        lora_scale=lora_scale,
        lora_tx=lora_tx,
        distill=dset,
        num_bins=bins,
    )


def init_state(ctx: RunContext, setup: RLSetup, params) -> TrainState:
    # Onto the mesh; one device: committed to it, like restored checkpoints, so a resumed
    # run compiles (and hits the compilation cache with) the same programs as a fresh one.
    put = (
        (lambda t: jax.device_put(t, jax.devices()[0]))
        if setup.plan is None
        else setup.plan.shard_state
    )
    params = put(params)
    st = TrainState(params=params, opt_state=put(setup.tx.init(params)))
    if setup.distilling:
        st.lora = put(init_lora(ctx.model_cfg, ctx.lora_cfg, jax.random.key(ctx.config.seed + 3)))
        st.lora_opt_state = put(setup.lora_tx.init(st.lora))
    return st


# ------------------------------------------------------------------------------- evaluation
def evaluate(
    ctx: RunContext, setup: RLSetup, st: TrainState, step: int, writer: MetricsWriter, key
) -> dict:
    """The dense policy (theta, dense attention), and in sparse modes the rollout policy's
    greedy accuracy too (sparse_greedy_accuracy: sparse attention, + phi in distillsparse)."""
    e = ctx.config.eval
    t0 = time.time()
    m = {"greedy_accuracy": ctx.evaluator.greedy(st.params)}
    if e.mean_at_k:
        m[f"mean_at_{e.mean_at_k}"] = ctx.evaluator.mean_at_k(
            st.params, e.mean_at_k, ctx.config.rl.temperature, key
        )
    if setup.mode != "dense" and e.sparse:
        m["sparse_greedy_accuracy"] = ctx.evaluator.greedy(
            st.params, st.lora, setup.lora_scale, spec=setup.rollout_spec
        )
    m["time"] = time.time() - t0
    record = writer.write("eval", step, m)
    print(
        f"[eval] step {step}: "
        + " ".join(f"{k} {v:.3f}" for k, v in record.items() if k not in ("phase", "step")),
        flush=True,
    )
    return record


# ---------------------------------------------------------------------------------- one step
def _gather_rows(tree, rows, plan=None):
    if plan is not None:  # one jitted gather on the mesh, rows batch-sharded
        return plan.take_rows(tree, rows)
    return jax.tree.map(lambda x: x[rows], tree)


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


def _minibatch_updates(update, state, opt_state, batch, order, plan=None, **kw):
    ms = []
    for rows in order:
        mb = _gather_rows(batch, rows, plan)
        state, opt_state, m = update(state, opt_state, mb, **kw)
        ms.append(m)
    return state, opt_state, jax.device_get(ms)


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


def theta_batch(mode: str, kept, adv_B, dense_logp, twin_logp, c):
    """The theta update's batch and the off-policy correction metrics.

    old_logp: the trainer's policy before the update, dense (theta, no adapter) except in
    sparse_train (the sparse twin, whose pages ride along in the batch). rl.is_correction
    (c: the rl config section) against the rollout's log-probs mu: tis adds
    is_weights = min(pi_old / mu, tis_cap); mis replaces the mask with the MIS mask
    (mis_level token | sequence). The TIS clip and MIS mask fractions are always measured.
    """
    old_logp = twin_logp if mode == "sparse_train" else dense_logp
    mask = kept.completion_mask
    batch = {"tokens": kept.tokens, "mask": mask, "old_logp": old_logp, "adv": adv_B}
    pages = kept.pages()
    if mode == "sparse_train" and pages is not None:
        batch["pages"] = pages
    corr, corr_m = _correction_terms(old_logp, kept.logprobs, mask, c.tis_cap, c.mis_lo, c.mis_hi)
    if c.is_correction == "tis":
        batch["is_weights"] = corr["tis"]
    elif c.is_correction == "mis":
        batch["mask"] = corr[f"mis_{c.mis_level}"]
    return batch, {k: float(v) for k, v in jax.device_get(corr_m).items()}


def rl_step(ctx: RunContext, setup: RLSetup, st: TrainState, rng, step: int, ref_params=None):
    """One RL iteration. Returns (new TrainState, metrics). With a mesh (setup.plan) every
    jitted phase runs under it; each process makes its own block of prompts."""
    with sharding.maybe_active(setup.plan):
        return _rl_step(ctx, setup, st, rng, step, ref_params)


def _rl_step(ctx, setup, st, rng, step, ref_params):
    c = ctx.config.rl
    n, big_m, p = setup.n, setup.m, c.prompts_per_step
    plan = setup.plan
    if plan is not None:  # the same key on every process, replicated on the mesh
        rng = plan.replicate(rng)
    k_roll, k_filter, k_shuffle, k_phi = jax.random.split(rng, 4)
    mine = slice(0, p) if plan is None else plan.local_slice(p)  # this process's prompts
    batch_problems = problems(
        ctx.task,
        "train",
        RL_DATA_OFFSET + step * p + mine.start,
        mine.stop - mine.start,
        ctx.config.seed,
    )
    prompts, lengths = batches.encode_prompts(
        ctx.tok, batch_problems, batches.prompt_buffer(ctx.task)
    )
    if plan is not None:  # one global batch-sharded array from every process's rows
        prompts, lengths = plan.global_batch(prompts), plan.global_batch(lengths)
    scfg = SamplingConfig(
        max_new_tokens=batches.completion_budget(ctx.task),
        eos_id=ctx.tok.eos_id,
        pad_id=ctx.tok.pad_id,
        temperature=c.temperature,
        samples_per_prompt=big_m,
        grow_buffer_from=c.grow_buffer_from,
    )
    params = st.params
    times, m = {}, {}
    rec_kw = dict(
        graphdef=ctx.graphdef,
        temperature=c.temperature,
        dense_spec=ctx.spec,
        twin_spec=setup.twin_spec,
        lora_scale=setup.lora_scale,
        bin_width=ctx.config.metrics.position_bin,
        num_bins=setup.num_bins,
    )

    # Teacher-forced forwards (no gradient) run in chunks of the update's microbatch size,
    # the largest group of rows the config already runs forward and backward at once.
    chunk_rows = lambda rows: math.gcd(rows, c.minibatches * c.microbatches)

    def run_recompute(r):
        return distill.recompute(
            params,
            st.lora,
            r.tokens,
            r.prompt_lengths,
            r.completion_mask,
            r.pages(),
            r.logprobs,
            chunks=chunk_rows(r.tokens.shape[0]),
            **rec_kw,
        )

    # 1. rollout: M samples per prompt from the actor.
    t = time.time()
    rollout = ctx.sampler(
        params, prompts, lengths, k_roll, scfg, setup.rollout_spec, st.lora, setup.lora_scale
    )
    jax.block_until_ready(rollout.tokens)
    times["time_rollout"] = time.time() - t
    faults.maybe_kill("rl_rollout", step + 1)

    # 2. rewards of all M.
    t = time.time()
    if plan is None:
        rewards_all, _ = score(ctx.tok, rollout, batch_problems, ctx.config.task.format_reward)
    else:  # each process grades its own groups; all-gathered (P * M floats)
        rewards_all = plan.gather_rows(
            score(
                ctx.tok, plan.local_rollout(rollout), batch_problems, ctx.config.task.format_reward
            )[0]
        )
    times["time_rewards"] = time.time() - t

    # 3. oversampling filter: keep n of M per prompt; advantages over the kept n.
    t = time.time()
    rec = None
    if big_m > n and c.selection == "acceptance":  # needs the dense forward of all M
        rec = run_recompute(rollout)
    rows, filter_m = select_rows(
        rewards_all,
        n,
        big_m,
        k_filter,
        selection=c.selection,
        rollout=rollout,
        dense_logp=None if rec is None else rec["dense_logp"],
        acceptance_c=c.acceptance_C,
    )
    m.update(filter_m)
    kept, rewards = rollout, np.asarray(rewards_all)
    if big_m > n:
        kept, rewards = _gather_rows(rollout, rows, plan), rewards[rows]
    if plan is not None:
        kept = plan.shard_batch(kept)
    if rec is not None:  # the metrics stay those of all M rows
        rec = dict(
            _gather_rows({k: v for k, v in rec.items() if k != "metrics"}, rows, plan),
            metrics=rec["metrics"],
        )
    adv_B = grpo_advantages(jnp.asarray(rewards), n, scale_by_std=c.scale_adv_by_std)
    adv_B = sharding.as_global(plan, adv_B)
    if faults.action("rl_nan", step + 1) == "nan":  # test hook: a non-finite loss
        adv_B = adv_B * jnp.nan
    jax.block_until_ready(adv_B)
    times["time_filter"] = time.time() - t

    # 4. teacher-forced recompute: dense (theta, no adapter) and the actor's twin.
    t = time.time()
    if rec is None:
        rec = run_recompute(kept)
    dense_logp = rec["dense_logp"]
    pages = kept.pages()
    batch, corr_m = theta_batch(setup.mode, kept, adv_B, dense_logp, rec.get("twin_logp"), c)
    if setup.settings.kl_coef > 0:
        batch["ref_logp"], _ = recompute_logprobs(
            ref_params,
            kept.tokens,
            batch.get("pages"),
            graphdef=ctx.graphdef,
            temperature=c.temperature,
            spec=setup.settings.spec,
            chunks=chunk_rows(kept.tokens.shape[0]),
        )
    jax.block_until_ready(batch["old_logp"])
    times["time_recompute"] = time.time() - t

    # 5. theta update (PPO/GRPO, minibatches); phi is not an input.
    t = time.time()
    b = kept.tokens.shape[0]
    if b % c.minibatches:
        raise ValueError(f"rollout batch {b} not divisible by rl.minibatches={c.minibatches}")
    teacher_params = None
    if setup.distilling and setup.distill.exact and ctx.config.distill.teacher == "cached":
        teacher_params = jax.tree.map(jnp.copy, params)  # theta before its update
    order = np.asarray(jax.random.permutation(k_shuffle, b)).reshape(c.minibatches, -1)
    params, opt_state, theta_ms = _minibatch_updates(
        grpo_update,
        params,
        st.opt_state,
        batch,
        order,
        plan,
        graphdef=ctx.graphdef,
        tx=setup.tx,
        settings=setup.settings,
    )
    times["time_update"] = time.time() - t
    faults.maybe_kill("rl_update", step + 1)
    m.update(_summarize_updates(theta_ms))
    new = TrainState(
        params=params, opt_state=opt_state, lora=st.lora, lora_opt_state=st.lora_opt_state
    )

    # 6. distillsparse: theta frozen; phi update on the same rollouts.
    if setup.distilling:
        t = time.time()
        phi_batch = {
            "tokens": kept.tokens,
            "mask": kept.completion_mask,
            "adv": adv_B,
            "rollout_logp": kept.logprobs,
            "pages": pages,
        }
        recomputed = ctx.config.distill.teacher == "recomputed"
        if setup.distill.exact:  # the teacher's full logits come from a forward in the step
            teacher_params = params if recomputed else teacher_params
        elif recomputed:  # dense log-probs of the updated theta
            phi_batch["teacher_logp"], _ = recompute_logprobs(
                params,
                kept.tokens,
                graphdef=ctx.graphdef,
                temperature=c.temperature,
                chunks=chunk_rows(kept.tokens.shape[0]),
            )
        else:  # cached: step 4's dense log-probs, theta before its update
            phi_batch["teacher_logp"] = dense_logp
        jax.block_until_ready(phi_batch.get("teacher_logp", adv_B))
        times["time_teacher"] = time.time() - t
        t = time.time()
        order = np.asarray(jax.random.permutation(k_phi, b)).reshape(c.minibatches, -1)
        new.lora, new.lora_opt_state, phi_ms = _minibatch_updates(
            distill.phi_update,
            st.lora,
            st.lora_opt_state,
            phi_batch,
            order,
            plan,
            params=params,
            teacher_params=teacher_params,
            graphdef=ctx.graphdef,
            tx=setup.lora_tx,
            settings=setup.distill,
        )
        times["time_phi_update"] = time.time() - t
        m.update(_summarize_updates(phi_ms, prefix="phi_"))

    # metrics
    m.update(distill.flatten_metrics(jax.device_get(rec["metrics"])))
    m.update(corr_m)
    ncomp = sharding.to_host(rollout.completion_lengths)
    rewards_all = np.asarray(rewards_all)
    m.update(
        reward=float(rewards_all.mean()),
        accuracy=float((rewards_all == 1.0).mean()),
        reward_kept=float(rewards.mean()),
        response_length_mean=float(ncomp.mean()),
        response_length_max=int(ncomp.max()),
        response_length_kept_mean=float(sharding.to_host(kept.completion_lengths).mean()),
        rollout_tokens_per_s=float(ncomp.sum() / times["time_rollout"]),
        **times,
    )
    m["time_step"] = sum(times.values())
    return new, m


# ---------------------------------------------------------------------------------- the loop
OPTIONAL_KEYS = ("consecutive_skips",)  # absent from checkpoints written before them


def _saveable(
    st: TrainState, rng, step: int, data_position: int, consecutive_skips: int = 0
) -> dict:
    tree = checkpoints.to_saveable(
        st.params,
        st.opt_state,
        rng=rng,
        step=step,
        extra={"data_position": data_position, "consecutive_skips": consecutive_skips},
    )
    if st.lora is not None:  # flat leaf lists, like opt_state (int-keyed dicts stay out)
        tree["lora"] = jax.tree.leaves(st.lora)
        tree["lora_opt_state"] = jax.tree.leaves(st.lora_opt_state)
    return tree


def _from_tree(tree: dict, st: TrainState):
    params, opt_state, rng, step, extra = checkpoints.from_saveable(tree, st.params, st.opt_state)
    new = TrainState(params=params, opt_state=opt_state)
    if st.lora is not None:
        new.lora = jax.tree.unflatten(jax.tree.structure(st.lora), extra["lora"])
        new.lora_opt_state = jax.tree.unflatten(
            jax.tree.structure(st.lora_opt_state), extra["lora_opt_state"]
        )
    return new, rng, step, extra


def _restore(ckpt, latest: int, st: TrainState, rng):
    tree = ckpt.restore(latest, _saveable(st, rng, 0, 0), OPTIONAL_KEYS)
    return _from_tree(tree, st)[:3]


def _resume(ckpt, st: TrainState, rng, mode: str, prompts_per_step: int):
    """(state, rng, step, consecutive skips) from the newest usable checkpoint, if any."""
    try:
        found = ckpt.restore_latest(_saveable(st, rng, 0, 0), OPTIONAL_KEYS)
    except checkpoints.IncompatibleCheckpoint as e:  # e.g. another rollout mode
        raise SystemExit(
            f"cannot resume from {ckpt.directory} in rl.rollout_mode={mode}: {e}"
        ) from None
    except checkpoints.CheckpointError as e:
        raise SystemExit(f"[rl] {e}") from None
    if found is None:
        return st, rng, 0, 0
    st, rng, step, extra = _from_tree(found[1], st)
    position = int(extra["data_position"])
    if position != RL_DATA_OFFSET + step * prompts_per_step:
        raise SystemExit(
            f"cannot resume from {ckpt.directory} step {step}: data position "
            f"{position} does not match rl.prompts_per_step={prompts_per_step}"
        )
    return st, rng, step, int(extra.get("consecutive_skips", 0))


def train_rl(ctx: RunContext, workdir: str, sft_params, writer: MetricsWriter):
    c = ctx.config.rl
    setup = make_setup(ctx)
    st = init_state(ctx, setup, sft_params)
    rng = jax.random.key(ctx.config.seed + 1)
    if setup.plan is not None:  # replicated on the mesh, like every checkpointed array
        rng = setup.plan.replicate(rng)
    if setup.plan is None:  # committed, like a restored key (see init_state)
        rng = jax.device_put(rng, jax.devices()[0])
    ckpt = checkpoints.Checkpointer(workdir, "checkpoints", keep=ctx.config.checkpoint.keep)
    st, rng, step, skips = _resume(ckpt, st, rng, setup.mode, c.prompts_per_step)
    if step:
        print(f"[rl] resuming from checkpoint at step {step}", flush=True)
    # Metrics of work lost in a kill are redone (step 0's evaluation too, when no
    # checkpoint exists yet).
    writer.drop_after("rl", step)
    writer.drop_after("eval", step if step else -1)
    # A copy: the first update donates sft_params' buffers.
    ref_params = jax.tree.map(jnp.copy, sft_params) if setup.settings.kl_coef > 0 else None
    if setup.plan is not None:
        ref_params = setup.plan.shard_state(ref_params)
    if step == 0:
        evaluate(ctx, setup, st, 0, writer, jax.random.key(ctx.config.seed + 2))

    progress = Progress("rl", c.num_steps, start=step)
    while step < c.num_steps:
        rng, step_key = jax.random.split(rng)
        st, m = rl_step(ctx, setup, st, step_key, step, ref_params)
        step += 1
        # A non-finite loss or gradient skipped the update (steps.apply_update).
        skipped = m["skipped_updates"] + m.get("phi_skipped_updates", 0.0) > 0
        skips = skips + 1 if skipped else 0
        m["consecutive_skipped_steps"] = skips
        writer.write("rl", step, m)
        if c.max_consecutive_skips and skips >= c.max_consecutive_skips:
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
            evaluate(ctx, setup, st, step, writer, jax.random.fold_in(rng, 7))
        if step % ctx.config.checkpoint.every == 0 or step == c.num_steps:
            try:
                ckpt.save(
                    step,
                    _saveable(st, rng, step, RL_DATA_OFFSET + step * c.prompts_per_step, skips),
                    force=step == c.num_steps,
                )
            except checkpoints.CheckpointError as e:  # non-finite state: never saved
                ckpt.close()
                raise SystemExit(f"[rl] halted at step {step}: {e}") from None
            faults.maybe_kill("rl_checkpoint", step)  # the write is still in flight
    ckpt.close()
    return st.params
