"""What an RL run derives once from its config (RLSetup), grouped by feature, and the
optimizers of its trainables, whose schedules are stated in RL steps. The rollout mode's
properties (rl/modes.py) decide every choice here: the actor's and the trainer's
attention, and whether phi exists and is trained. What a run carries from step to step
is train/trainables.py."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.config.validate import prune_positions, prune_sizes
from dsparse_jax.model import draft_head, quality_head
from dsparse_jax.parallel import sharding
from dsparse_jax.rl import modes, objectives
from dsparse_jax.rl.corrections import Correction
from dsparse_jax.sampling.pruning import PruneConfig
from dsparse_jax.sampling.sampler import SamplingConfig, buffer_length
from dsparse_jax.sampling.speculative import SpeculativeConfig, SpeculativeSampler
from dsparse_jax.train import distill, recompute, rollouts, steps
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.grpo import GRPOSettings

RL_DATA_OFFSET = 10_000_000  # RL prompts come from train indices disjoint from SFT's


def grpo_settings(c, spec: AttentionSpec = AttentionSpec()) -> GRPOSettings:
    """theta's update settings from the rl section: the policy loss (rl/objectives.py) with
    its own clip range, the aggregation (auto: the loss's), truncated sampling."""
    low, high = objectives.policy_loss(c.policy_loss).clip
    return GRPOSettings(
        temperature=c.temperature,
        clip_low=c[low],
        clip_high=c[high],
        dual_clip=c.dual_clip or None,
        loss_agg=objectives.loss_agg(c.loss_agg, c.policy_loss),
        kl_coef=c.kl_coef,
        kl_kind=c.kl_kind,
        microbatches=c.microbatches,
        spec=spec,
        policy_loss=c.policy_loss,
        top_k=c.top_k,
        top_p=c.top_p,
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


@dataclasses.dataclass(frozen=True)
class Pruning:
    """rl.prune: online rollout pruning and the quality head that ranks the rows."""

    config: PruneConfig  # the sampler's: checkpoints, kept sizes, rho, label rows, head layer
    generated: int  # M' rows generated per prompt
    head: quality_head.QualityHeadConfig
    head_steps: int  # the head's Adam steps per RL step


@dataclasses.dataclass(frozen=True)
class DraftHeadSetup:
    """The learned draft head's static parts (rl.draft_head)."""

    graphdef: object
    layers: tuple[int, ...]
    steps: int
    loss_weight: float
    warmup_steps: int
    unroll: int  # draft steps trained on its own unroll (train/draft_head.py)
    temperature: float  # the policy's and the head's distributions (rl.temperature, or 1)


@dataclasses.dataclass(frozen=True)
class Drafting:
    """rollout_mode=speculative: the drafter (rl.draft) and what it drafts from."""

    sampler: SpeculativeSampler
    config: SpeculativeConfig  # the speculative sampler's settings
    # rl.draft=history: the bank's (prompts, rows per prompt, width); the bank itself is run
    # state (trainables.TrainState.history)
    history_size: tuple[int, int, int] | None = None
    head: DraftHeadSetup | None = None  # rl.draft=draft_head


@dataclasses.dataclass(frozen=True)
class Selection:
    """The select phase: the rewards' overlong shaping, which n of each prompt's M samples
    it keeps, which groups train (dynamic sampling), their advantages, and the rows whose
    loss is masked (docs/objectives.md, "Which rows train")."""

    kind: str  # rl.selection: reward | acceptance (rate vs the dense policy)
    acceptance_c: float  # rl.acceptance_C
    advantage: str = "grpo"  # a key of rl/objectives.ADVANTAGES
    dynamic: bool = False  # rl.dynamic_sampling.enabled (DAPO)
    max_draws: int = 1  # rollouts of prompts_per_step prompts per RL step, at most
    overlong_buffer: int = 0  # rl.overlong.buffer: L_cache (0: no shaping)
    overlong_penalty: float = 1.0
    overlong_filter: bool = False  # mask the loss of truncated rows


@dataclasses.dataclass(frozen=True)
class RLSetup:
    """What a run derives once from its config: the phases (train/phases.py) read these
    and nothing else of it. By phase, then by feature; the trainables and their optimizers
    are run state (train/trainables.py)."""

    mode: modes.RolloutMode
    plan: sharding.MeshPlan | None  # the device mesh (None: one device, unsharded)
    # rollout
    prompts_per_step: int
    seed: int  # config.seed: which training problems each step's prompts are
    sampling: SamplingConfig  # the rollout's: M samples per prompt at rl.temperature
    rollout_spec: AttentionSpec  # the actor's attention
    lora_scale: float  # phi's scale in the actor (1.0: no adapter)
    pruning: Pruning | None  # rl.prune.enabled
    drafting: Drafting | None  # rollout_mode=speculative
    num_samples: int  # log.num_samples: prompts of each step recorded in samples.jsonl
    # The rollout in this many sequential chunks of whole prompts (Sampler's chunks):
    # rl.rollout_chunk_rows, or the memory plan's choice (train/memory_plan.py).
    rollout_chunks: int
    # select
    n: int  # kept samples per prompt (GRPO group)
    selection: Selection
    # recompute
    recompute: recompute.Settings  # dense theta and the actor's twin, their figures
    # the updates: each runs rl.minibatches minibatches per RL step
    minibatches: int
    grpo: GRPOSettings  # theta's; grpo.spec is the trainer's attention
    correction: Correction  # theta's batch (rl.is_correction)
    distill: distill.DistillSettings | None  # phi's (mode.updates_phi)
    phi_row_stride: int  # distill.row_stride: phi trains on every this-th kept row

    @property
    def m(self) -> int:
        """Generated samples per prompt (M >= n): the rollout's SamplingConfig holds it."""
        return self.sampling.samples_per_prompt


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
        steps=h.steps,
        loss_weight=float(h.loss_weight),
        warmup_steps=h.warmup_steps,
        unroll=min(h.unroll, c.draft_tokens),  # a draft has draft_tokens steps to unroll
        temperature=c.temperature or 1.0,
    )


def pruning_from(c, d_model: int) -> Pruning | None:
    """rl.prune (c: the rl config section), None when off."""
    p = c.prune
    if not p.enabled:
        return None
    n, pos = c.samples_per_prompt, prune_positions(p.positions)
    m = p.generated or 2 * n
    return Pruning(
        config=PruneConfig(
            positions=pos,
            sizes=prune_sizes(m, n, len(pos)),
            rho=p.rho,
            label_rows=p.label_rows,
            layer=p.layer,
        ),
        generated=m,
        head=quality_head.QualityHeadConfig(d_model, hidden=p.head_hidden, layer=p.layer),
        head_steps=p.head_steps,
    )


def drafting_from(ctx: RunContext, mode: modes.RolloutMode) -> Drafting | None:
    """rollout_mode=speculative's drafter, None in the other modes."""
    c = ctx.config.rl
    if not mode.speculative:
        return None
    config = SpeculativeConfig(
        draft=c.draft,
        draft_tokens=c.draft_tokens,
        ngram=c.history_ngram,
        history_draft=c.history_draft,
        tree_width=c.tree_width,
        record_pages=mode.updates_phi,  # the phi update's twin replays the draft's pages
    )
    drafting = Drafting(SpeculativeSampler(ctx.graphdef), config)
    if c.draft == "history":
        width = buffer_length(
            ctx.task.prompt_buffer(), ctx.task.completion_budget(), ctx.spec.page_size
        )
        size = (c.history_prompts, c.history_per_prompt, width)
        return dataclasses.replace(drafting, history_size=size)
    if c.draft == "draft_head":
        return dataclasses.replace(drafting, head=draft_head_setup(c, ctx.model_cfg))
    return drafting


def make_setup(ctx: RunContext) -> RLSetup:
    c = ctx.config.rl
    mode = modes.get(c.rollout_mode, c.draft)
    n = c.samples_per_prompt
    m = c.samples_generated or n
    rollout_spec = ctx.rollout_spec if mode.actor_sparse else ctx.spec
    trainer_spec = rollout_spec if mode.trainer_sparse else ctx.spec
    lora_scale = ctx.lora_cfg.scale if mode.actor_lora else 1.0
    dset = None
    if mode.updates_phi:
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
            loss_agg=objectives.loss_agg(c.loss_agg, c.policy_loss),
            microbatches=c.microbatches,
        )
    bins = max(1, math.ceil(ctx.task.completion_budget() / ctx.config.metrics.position_bin))
    plan = sharding.plan_from_config(ctx.config)
    sharding.check_rl_batches(plan, c)
    return RLSetup(
        mode=mode,
        plan=plan,
        prompts_per_step=c.prompts_per_step,
        seed=ctx.config.seed,
        sampling=dataclasses.replace(
            rollouts.sampling_config(ctx, c.temperature, m, c.grow_buffer_from),
            top_k=c.top_k,
            top_p=c.top_p,
        ),
        rollout_spec=rollout_spec,
        lora_scale=lora_scale,
        pruning=pruning_from(c, ctx.model_cfg.d_model),
        drafting=drafting_from(ctx, mode),
        num_samples=ctx.config.log.num_samples,
        rollout_chunks=c.prompts_per_step * m // c.rollout_chunk_rows
        if c.rollout_chunk_rows
        else 1,
        n=n,
        selection=Selection(
            c.selection,
            c.acceptance_C,
            advantage=objectives.advantage_name(c.advantage, c.scale_adv_by_std),
            dynamic=c.dynamic_sampling.enabled,
            max_draws=c.dynamic_sampling.max_draws if c.dynamic_sampling.enabled else 1,
            overlong_buffer=c.overlong.buffer,
            overlong_penalty=c.overlong.penalty,
            overlong_filter=c.overlong.filter,
        ),
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
            top_k=c.top_k,
            top_p=c.top_p,
        ),
        minibatches=c.minibatches,
        grpo=grpo_settings(c, trainer_spec),
        correction=Correction(
            modes.correction_for(mode, c.is_correction), c.tis_cap, c.mis_lo, c.mis_hi, c.mis_level
        ),
        distill=dset,
        phi_row_stride=ctx.config.distill.row_stride,
    )


# phi's warm start (distill.warmup_steps) distils to theta, which it leaves frozen, so the
# cached and the recomputed teacher agree: the cheaper, by DistillSettings.exact (a sampled
# estimator reads the recompute's dense log-probs, an exact one a forward of theta itself).
WARMUP_TEACHER = {False: "cached", True: "recomputed"}


def phi_warmup_setup(setup: RLSetup) -> RLSetup:
    """The setup of phi's warm start: n samples per prompt, no pruning, phi's objective
    without its PPO term (loss kl_only; the mode's divergence)."""
    d = setup.distill
    d = dataclasses.replace(d, loss="kl_only", teacher=WARMUP_TEACHER[d.exact])
    sampling = dataclasses.replace(setup.sampling, samples_per_prompt=setup.n)
    return dataclasses.replace(setup, sampling=sampling, pruning=None, distill=d)


def phi_warmup_tx(lora_section):
    """phi's own optimizer in its warm start: AdamW at lora.learning_rate, constant."""
    return steps.make_optimizer(
        lora_section.learning_rate,
        warmup_steps=0,
        total_steps=1,
        weight_decay=lora_section.weight_decay,
        max_grad_norm=lora_section.max_grad_norm,
        schedule="constant",
    )


def place(setup: RLSetup, tree):
    """Onto the mesh; one device: committed to it, like restored checkpoints, so a resumed
    run compiles (and hits the compilation cache with) the same programs as a fresh one."""
    if setup.plan is None:
        return jax.device_put(tree, jax.devices()[0])
    return setup.plan.shard_state(tree)
