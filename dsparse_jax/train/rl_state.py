"""What an RL run derives once from its config (RLSetup) and what it carries from step to
step (TrainState). The rollout mode's properties (rl/modes.py) decide every choice here:
the actor's and the trainer's attention, and whether phi exists and is trained."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.config.validate import prune_positions, prune_sizes
from dsparse_jax.data import batches
from dsparse_jax.model import draft_head, quality_head
from dsparse_jax.model.lora import init_lora
from dsparse_jax.parallel import sharding
from dsparse_jax.rl import modes
from dsparse_jax.sampling.history import HistoryBank
from dsparse_jax.sampling.pruning import PruneConfig
from dsparse_jax.sampling.sampler import buffer_length
from dsparse_jax.sampling.speculative import SpeculativeConfig
from dsparse_jax.train import distill, quality, recompute, steps
from dsparse_jax.train import draft_head as draft_head_train
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.grpo import GRPOSettings

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


def optimizer_steps_per_rl_step(rl) -> dict[str, int]:
    """The optimizer steps each trainable takes in one RL step (rl: the config's rl
    section). Microbatches accumulate inside one step, so theta and phi take one per
    minibatch, the draft head rl.draft_head.steps per minibatch and the quality head
    rl.prune.head_steps. Schedules are stated in RL steps in the config and converted with
    these counts (`optimizer_from`); the heads' learning rates are constant, so their
    counts convert nothing (tests/test_modes.py and test_pruning.py check all four against
    the phases)."""
    return {
        "theta": rl.minibatches,
        "phi": rl.minibatches,
        "draft_head": rl.minibatches * rl.draft_head.steps,
        "quality_head": rl.prune.head_steps,
    }


def optimizer_from(section, per_rl_step: int, num_rl_steps: int):
    """AdamW of a config section (rl: theta, lora: phi) whose warmup_steps and cosine decay
    (over num_rl_steps) are RL steps of `per_rl_step` optimizer steps each; the warmup is
    rounded to whole optimizer steps."""
    return steps.make_optimizer(
        section.learning_rate,
        warmup_steps=round(section.warmup_steps * per_rl_step),
        total_steps=num_rl_steps * per_rl_step,
        weight_decay=section.weight_decay,
        max_grad_norm=section.max_grad_norm,
        schedule=section.schedule,
    )


@dataclasses.dataclass
class TrainState:
    """theta (+ its optimizer) and, where the actor applies it, phi (+ its own optimizer)."""

    params: object
    opt_state: object
    lora: dict | None = None
    lora_opt_state: object = None
    head: dict | None = None  # the rollout quality head (rl.prune; model/quality_head.py)
    head_opt_state: object = None
    draft_head: object = None  # rl.draft=draft_head: the learned drafter's nnx.State
    draft_head_opt_state: object = None


@dataclasses.dataclass(frozen=True)
class RLSetup:
    """What a run derives once from its config (optimizers, static settings, specs)."""

    mode: modes.RolloutMode
    n: int  # kept samples per prompt (GRPO group)
    m: int  # generated samples per prompt (M >= n)
    tx: object
    settings: GRPOSettings  # theta's update; settings.spec is the trainer's attention
    rollout_spec: AttentionSpec  # the actor's attention
    recompute: recompute.Settings  # dense theta and the actor's twin, their figures
    lora_scale: float = 1.0
    lora_tx: object = None
    distill: distill.DistillSettings | None = None  # phi's update (mode.updates_phi)
    plan: sharding.MeshPlan | None = None  # the device mesh (None: one device, unsharded)
    speculative: SpeculativeConfig | None = None  # rollout_mode=speculative: the drafter
    history: HistoryBank | None = None  # rl.draft=history: earlier rollouts, across steps
    prune: PruneConfig | None = None  # online rollout pruning (rl.prune.enabled)
    prune_generated: int = 0  # M' rows generated per prompt when pruning
    head_cfg: quality_head.HeadConfig | None = None
    head_tx: object = None
    head_steps: int = 0
    draft_head: "DraftHeadSetup | None" = None  # rl.draft=draft_head


@dataclasses.dataclass(frozen=True)
class DraftHeadSetup:
    """The learned draft head's static parts (rl.draft_head)."""

    graphdef: object
    layers: tuple[int, ...]
    tx: object
    steps: int
    loss_weight: float
    warmup_steps: int
    unroll: int  # draft steps trained on its own unroll (train/draft_head.py)


def draft_head_setup(c, model_cfg) -> DraftHeadSetup:
    h = c.draft_head
    layers = draft_head.parse_layers(h.layers, model_cfg.num_layers)
    graphdef, _ = nnx.split(
        nnx.eval_shape(
            lambda: draft_head.DraftHead(model_cfg, draft_head.DraftHeadConfig(layers), nnx.Rngs(0))
        )
    )
    return DraftHeadSetup(
        graphdef=graphdef,
        layers=layers,
        tx=draft_head_train.make_tx(h.learning_rate, h.max_grad_norm),
        steps=h.steps,
        loss_weight=float(h.loss_weight),
        warmup_steps=h.warmup_steps,
        unroll=min(h.unroll, c.draft_tokens),  # a draft has draft_tokens steps to unroll
    )


def prune_setup(c, d_model: int) -> dict:
    """RLSetup's pruning fields from the rl config section (empty when off)."""
    p = c.prune
    if not p.enabled:
        return {}
    n, pos = c.samples_per_prompt, prune_positions(p.positions)
    m = p.generated or 2 * n
    return dict(
        prune=PruneConfig(
            positions=pos,
            sizes=prune_sizes(m, n, len(pos)),
            rho=p.rho,
            label_rows=p.label_rows,
            layer=p.layer,
        ),
        prune_generated=m,
        head_cfg=quality_head.HeadConfig(d_model, hidden=p.head_hidden, layer=p.layer),
        head_tx=quality.make_tx(p.head_learning_rate),
        head_steps=p.head_steps,
    )


def make_setup(ctx: RunContext) -> RLSetup:
    c = ctx.config.rl
    mode = modes.get(c.rollout_mode, c.draft)
    n = c.samples_per_prompt
    m = c.samples_generated or n
    rollout_spec = ctx.rollout_spec if mode.actor_sparse else ctx.spec
    trainer_spec = rollout_spec if mode.trainer_sparse else ctx.spec
    lora_scale = ctx.lora_cfg.scale if mode.actor_lora else 1.0
    per_rl_step = optimizer_steps_per_rl_step(c)
    lora_tx, dset = None, None
    if mode.updates_phi:
        lora_tx = optimizer_from(ctx.config.lora, per_rl_step["phi"], c.num_steps)
        d = ctx.config.distill
        objective = modes.phi_objective(mode, d.loss, d.teacher, d.kl)
        dset = distill.DistillSettings(
            spec=rollout_spec,
            lora_scale=lora_scale,
            temperature=c.temperature,
            loss=objective.loss,
            kl=objective.kl,
            sampler=objective.sampler,
            teacher=objective.teacher,
            kl_coef=d.kl_coef,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            dual_clip=c.dual_clip or None,
            loss_agg=c.loss_agg,
            microbatches=c.microbatches,
        )
    bins = max(1, math.ceil(batches.completion_budget(ctx.task) / ctx.config.metrics.position_bin))
    spec_cfg = bank = None
    if mode.speculative:
        spec_cfg = SpeculativeConfig(
            draft=c.draft,
            draft_tokens=c.draft_tokens,
            ngram=c.history_ngram,
            record_pages=mode.updates_phi,  # the phi update's twin replays the draft's pages
        )
        if c.draft == "history":
            width = buffer_length(
                batches.prompt_buffer(ctx.task),
                batches.completion_budget(ctx.task),
                ctx.spec.page_size,
            )
            bank = HistoryBank(c.history_prompts, c.history_per_prompt, width)
    plan = sharding.plan_from_config(ctx.config)
    sharding.check_rl_batches(plan, c)
    return RLSetup(
        plan=plan,
        mode=mode,
        n=n,
        m=m,
        tx=optimizer_from(c, per_rl_step["theta"], c.num_steps),
        settings=settings_from(c, trainer_spec),
        rollout_spec=rollout_spec,
        lora_scale=lora_scale,
        lora_tx=lora_tx,
        distill=dset,
        recompute=recompute.Settings(
            temperature=c.temperature,
            dense_spec=ctx.spec,
            twin_spec=rollout_spec if mode.has_twin else None,
            lora_scale=lora_scale,
            # gcd(rows, this) rows per forward: the update's microbatch size, the largest
            # group the config already runs at once
            row_chunks=c.minibatches * c.microbatches,
            bin_width=ctx.config.metrics.position_bin,
            num_bins=bins,
            draft_tokens=c.draft_tokens if mode.speculative else 0,
            twin_every=ctx.config.metrics.twin_every,
            all_rows_every=ctx.config.metrics.all_rows_every,
        ),
        speculative=spec_cfg,
        history=bank,
        draft_head=(
            draft_head_setup(c, ctx.model_cfg)
            if mode.speculative and c.draft == "draft_head"
            else None
        ),
        **prune_setup(c, ctx.model_cfg.d_model),
    )


# phi's warm start (distill.warmup_steps) distils to theta, which it leaves frozen, so the
# cached and the recomputed teacher agree: the cheaper, by DistillSettings.exact (a sampled
# estimator reads the recompute's dense log-probs, an exact one a forward of theta itself).
WARMUP_TEACHER = {False: "cached", True: "recomputed"}


def phi_warmup_setup(setup: RLSetup, lora_section) -> RLSetup:
    """The setup of phi's warm start: n samples per prompt, no pruning, phi's objective
    without its PPO term (loss kl_only; the mode's divergence), and its own optimizer:
    AdamW at lora.learning_rate (lora_section), constant."""
    d = setup.distill
    d = dataclasses.replace(d, loss="kl_only", teacher=WARMUP_TEACHER[d.exact])
    tx = steps.make_optimizer(
        lora_section.learning_rate,
        warmup_steps=0,
        total_steps=1,
        weight_decay=lora_section.weight_decay,
        max_grad_norm=lora_section.max_grad_norm,
        schedule="constant",
    )
    return dataclasses.replace(setup, m=setup.n, prune=None, distill=d, lora_tx=tx)


def place(setup: RLSetup, tree):
    """Onto the mesh; one device: committed to it, like restored checkpoints, so a resumed
    run compiles (and hits the compilation cache with) the same programs as a fresh one."""
    if setup.plan is None:
        return jax.device_put(tree, jax.devices()[0])
    return setup.plan.shard_state(tree)


def init_state(ctx: RunContext, setup: RLSetup, params) -> TrainState:
    put = lambda t: place(setup, t)
    params = put(params)
    st = TrainState(params=params, opt_state=put(setup.tx.init(params)))
    if setup.mode.actor_lora:
        st.lora = put(init_lora(ctx.model_cfg, ctx.lora_cfg, jax.random.key(ctx.config.seed + 3)))
    if setup.mode.updates_phi:
        st.lora_opt_state = put(setup.lora_tx.init(st.lora))
    if setup.prune is not None:
        head, head_opt = quality.init(
            setup.head_cfg, setup.head_tx, jax.random.key(ctx.config.seed + 4)
        )
        st.head, st.head_opt_state = put(head), put(head_opt)
    if setup.draft_head is not None:
        h = setup.draft_head
        _, state = draft_head.create(
            ctx.model_cfg, draft_head.DraftHeadConfig(h.layers), jax.random.key(ctx.config.seed + 5)
        )
        st.draft_head, st.draft_head_opt_state = put(state), put(h.tx.init(state))
    return st
