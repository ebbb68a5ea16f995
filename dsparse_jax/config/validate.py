"""Config validation that runs before anything compiles: one line naming the bad field.

Unknown and missing keys are checked against the schema (config/schema.py,
which declares every field); then values, derived shapes (task, model, KV cache) and the
rollout-mode sections. docs/reliability.md lists the checks.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import re

from dsparse_jax.attention.spec import IMPLS, POLICIES, min_candidate_groups
from dsparse_jax.config import schema
from dsparse_jax.errors import UserError
from dsparse_jax.model import attention_dispatch
from dsparse_jax.model.config import PRESETS
from dsparse_jax.model.transformer import LINEAR_NAMES
from dsparse_jax.rl import modes, objectives
from dsparse_jax.rl.losses import AGG_MODES
from dsparse_jax.rl.modes import DRAFTS, MODES
from dsparse_jax.sampling.speculative import HISTORY_DRAFTS


class ConfigError(UserError, ValueError):
    """A config value that cannot work; the message starts with the field's name."""


def _check(ok: bool, field: str, msg: str):
    if not ok:
        raise ConfigError(f"config.{field}: {msg}")


def _positive_int(c, field):
    v = _get(c, field)
    _check(isinstance(v, int) and v > 0, field, f"must be a positive integer, got {v!r}")


def _get(c, field):
    for part in field.split("."):
        c = c[part]
    return c


def _lr(c, field):
    v = _get(c, field)
    _check(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
        field,
        f"must be finite and > 0, got {v!r}",
    )


def _nonneg(c, field, integer: bool = False):
    v = _get(c, field)
    ok = isinstance(v, int) if integer else isinstance(v, (int, float)) and math.isfinite(v)
    _check(
        ok and not isinstance(v, bool) and v >= 0,
        field,
        f"must be {'an integer' if integer else 'finite and'} >= 0, got {v!r}",
    )


def load_config(path: str):
    """get_config() of a config file (configs/*.py): a fresh ConfigDict on every call."""
    name = "_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _suggest(name: str, choices) -> str:
    """' (did you mean x?)' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _flat_keys(c, prefix: str = "") -> list[str]:
    """Every field of a config as a dotted path (sections included)."""
    out = []
    for k in c.keys():
        out.append(prefix + k)
        if hasattr(c[k], "keys"):
            out += _flat_keys(c[k], prefix + k + ".")
    return out


def unknown_key(field: str, config) -> ConfigError:
    """The error for config.<field>, which `config` does not declare, naming its closest
    declared key."""
    return ConfigError(f"config.{field}: unknown key{_suggest(field, _flat_keys(config))}")


def field_error(field: str, e: Exception) -> ConfigError:
    """`e` as a ConfigError naming config.<field>, unless its message already names one."""
    msg = str(e)
    return ConfigError(msg if msg.startswith("config.") else f"config.{field}: {msg}")


def check_keys(c, reference, prefix: str = "") -> None:
    """Every key of `c` exists in `reference` (a typo is not silently ignored) and every
    key of `reference` exists in `c` (the code reads them all)."""
    for k in c.keys():
        field = prefix + k
        if k not in reference:
            raise unknown_key(field, schema.defaults())
        sub, ref = c[k], reference[k]
        if hasattr(ref, "keys"):
            _check(hasattr(sub, "keys"), field, "must be a section (ConfigDict)")
            check_keys(sub, ref, field + ".")
    for k in reference.keys():
        _check(k in c, prefix + k, "missing (declared in dsparse_jax/config/schema.py)")


def validate(c) -> None:
    """Raises ConfigError on the first invalid value; keys are checked against the schema
    (dsparse_jax/config/schema.py)."""
    check_keys(c, schema.defaults())
    _check(isinstance(c.seed, int) and c.seed >= 0, "seed", "must be an integer >= 0")
    _check(
        c.model.preset in PRESETS,
        "model.preset",
        f"unknown preset {c.model.preset!r}, choose from {sorted(PRESETS)}",
    )
    for f in ("model.param_dtype", "model.dtype"):
        _check(_get(c, f) in ("float32", "bfloat16"), f, "must be float32 or bfloat16")
    ckpt = c.model.get("checkpoint_dir", "")
    _check(
        not ckpt or os.path.isdir(ckpt),
        "model.checkpoint_dir",
        f"{ckpt!r} is not a directory (a Hugging Face checkpoint directory: config.json, "
        "*.safetensors, its tokenizer files)",
    )
    for f in (
        "task.num_vars",
        "task.num_terms",
        "attention.page_size",
        "sft.max_steps",
        "sft.batch_size",
        "sft.eval_every",
        "rl.num_steps",
        "rl.prompts_per_step",
        "rl.samples_per_prompt",
        "rl.minibatches",
        "rl.microbatches",
        "eval.every",
        "eval.num_problems",
        "checkpoint.every",
        "checkpoint.keep",
        "log.every",
    ):
        _positive_int(c, f)
    _check(
        c.task.num_terms <= c.task.num_vars or c.task.repeat_terms,
        "task.num_terms",
        f"must be <= task.num_vars ({c.task.num_vars}) unless task.repeat_terms",
    )
    _check(c.attention.impl in IMPLS, "attention.impl", f"must be one of {IMPLS}")
    # The KV cache is in the compute dtype (model.dtype).
    error = attention_dispatch.kernel_shape_error(
        c.attention.impl, c.attention.page_size, c.model.dtype
    )
    _check(error is None, "attention.page_size", f"{error} (model.dtype {c.model.dtype})")
    for f in ("sft.learning_rate", "rl.learning_rate", "rl.max_grad_norm", "sft.max_grad_norm"):
        _lr(c, f)
    for f in (
        "sft.warmup_steps",
        "sft.max_consecutive_skips",
        "rl.max_consecutive_skips",
        "rl.grow_buffer_from",
        "rl.rollout_chunk_rows",
        "task.agg_every",
        "task.train_size",
        "log.num_samples",
    ):
        _nonneg(c, f, integer=True)
    for f in (
        "sft.weight_decay",
        "rl.weight_decay",
        "lora.weight_decay",
        "rl.warmup_steps",  # RL steps: a fraction allowed
        "lora.warmup_steps",
    ):
        _nonneg(c, f)
    _check(
        isinstance(c.task.format_reward, (int, float))
        and math.isfinite(c.task.format_reward)
        and c.task.format_reward < 1,
        "task.format_reward",
        "must be finite and < 1 (the reward of a right answer)",
    )
    _check(0.0 <= c.sft.target_accuracy <= 1.0, "sft.target_accuracy", "must be in [0, 1]")
    _check(
        c.rl.samples_per_prompt >= 2,
        "rl.samples_per_prompt",
        "must be >= 2 (group-relative advantages need a group)",
    )
    _check(
        math.isfinite(c.rl.temperature) and c.rl.temperature > 0,
        "rl.temperature",
        "must be finite and > 0 for RL sampling",
    )
    _validate_objective(c)
    _check(c.rl.kl_kind in ("k1", "k2", "k3"), "rl.kl_kind", "must be k1, k2 or k3")
    _check(c.rl.kl_coef >= 0, "rl.kl_coef", "must be >= 0")
    _check(c.rl.schedule in ("cosine", "constant"), "rl.schedule", "must be cosine or constant")
    batch = c.rl.prompts_per_step * c.rl.samples_per_prompt
    _check(
        batch % c.rl.minibatches == 0,
        "rl.minibatches",
        f"must divide the rollout batch prompts_per_step * samples_per_prompt = {batch}",
    )
    _check(
        (batch // c.rl.minibatches) % c.rl.microbatches == 0,
        "rl.microbatches",
        f"must divide the minibatch size {batch // c.rl.minibatches}",
    )
    _check(c.eval.mean_at_k >= 0, "eval.mean_at_k", "must be >= 0")
    _validate_reward(c)
    _check(
        not c.log.wandb or importlib.util.find_spec("wandb") is not None,
        "log.wandb",
        "needs the wandb package (pip install wandb; not in requirements.txt)",
    )
    _validate_modes(c)
    _validate_conflicts(c)
    _validate_shapes(c)


def _validate_objective(c) -> None:
    """theta's objective (rl/objectives.py tables): the names, every clip range, the
    aggregation, the dual clip where the loss has one; truncated sampling; DAPO's dynamic
    sampling and overlong settings (the budget is checked with the task's shapes)."""
    r = c.rl
    try:
        objectives.advantage_name(r.advantage, r.scale_adv_by_std)
        loss = objectives.policy_loss(r.policy_loss)
    except ValueError as e:  # the message names the field
        raise ConfigError(str(e)) from None
    for f in ("clip_low", "gspo_clip_low"):  # the clipped ratio stays > 0
        _check(0 <= r[f] < 1, f"rl.{f}", "must be in [0, 1)")
    _check(r.cispo_clip_low >= 0, "rl.cispo_clip_low", "must be >= 0 (>= 1: no lower bound)")
    for f in ("clip_high", "gspo_clip_high", "cispo_clip_high"):
        _check(r[f] >= 0, f"rl.{f}", "must be >= 0")
    _check(r.dual_clip == 0 or r.dual_clip > 1, "rl.dual_clip", "must be 0 (off) or > 1")
    _check(
        r.dual_clip == 0 or loss.dual_clip,
        "rl.dual_clip",
        f"must be 0 with rl.policy_loss={r.policy_loss} (a dual clip is ppo_clip's)",
    )
    aggs = (*AGG_MODES, "auto")
    _check(r.loss_agg in aggs, "rl.loss_agg", f"must be one of {aggs}")
    _nonneg(c, "rl.top_k", integer=True)
    _check(
        isinstance(r.top_p, (int, float)) and 0 < r.top_p <= 1,
        "rl.top_p",
        f"must be in (0, 1], got {r.top_p!r}",
    )
    d = r.dynamic_sampling
    _check(isinstance(d.enabled, bool), "rl.dynamic_sampling.enabled", "must be true or false")
    _positive_int(c, "rl.dynamic_sampling.max_draws")
    _nonneg(c, "rl.overlong.buffer", integer=True)
    _nonneg(c, "rl.overlong.penalty")
    _check(isinstance(r.overlong.filter, bool), "rl.overlong.filter", "must be true or false")


def _validate_reward(c) -> None:
    """reward.*: the function references parse, their files exist, one weight each; the grader's package.
    (The functions themselves are imported, and their signatures checked, by the reward
    worker when the run is built.)"""
    from dsparse_jax.data.rewards import graders, rewarder, user

    r = c.reward
    try:
        for ref in rewarder.parse_refs(r.fn):
            if ref != user.BUILTIN:
                target, _, is_file = user.split_ref(ref)
                _check(
                    not is_file or os.path.isfile(target), "reward.fn", f"no such file {target!r}"
                )
        rewarder.parse_weights(r.weights, len(rewarder.parse_refs(r.fn)))
    except ConfigError:
        raise
    except UserError as e:  # its message names the field
        raise ConfigError(str(e)) from None
    _check(r.grader in graders.GRADERS, "reward.grader", f"must be one of {graders.GRADERS}")
    _check(
        not r.grader.startswith("math_verify")
        or importlib.util.find_spec("math_verify") is not None,
        "reward.grader",
        "math_verify needs the math-verify package: pip install math-verify",
    )
    _lr(c, "reward.timeout_s")
    _check(0.0 <= r.max_error_fraction <= 1.0, "reward.max_error_fraction", "must be in [0, 1]")
    _check(r.error_window >= 1, "reward.error_window", "must be >= 1 (rows)")
    _check(
        1 <= r.error_min_rows <= r.error_window,
        "reward.error_min_rows",
        f"must be in [1, reward.error_window={r.error_window}]",
    )


def _validate_shapes(c) -> None:
    """The task (synthetic chain or a dataset's widths), the model (preset + overrides;
    a checkpoint's shapes are checked when it is read), the KV cache, the mesh."""
    from dsparse_jax.data import batches, curriculum, math_task
    from dsparse_jax.model.config import preset

    source = c.data.source if "data" in c else "synthetic:chain"
    page = c.attention.page_size
    if str(source).startswith("synthetic:"):
        t = c.task
        try:
            task = math_task.from_config(t)
        except ValueError as e:  # its messages start with the field's name
            raise ConfigError(f"config.task.{str(e).split(' ')[0]}: {e}") from None
        prompt, gen = task.prompt_buffer(), task.completion_budget()
        cache = batches.sequence_buffer(task, page)
        gen_field = "task.num_terms"
        try:
            curriculum.stages(c.sft.curriculum, task, c.sft.batch_size, c.sft.max_steps)
        except ValueError as e:
            raise ConfigError(f"config.sft.curriculum: {e}") from None
    else:
        _check(
            not str(c.sft.curriculum).strip(),
            "sft.curriculum",
            "a curriculum needs the synthetic chain task (data.source synthetic:)",
        )
        for f in ("data.max_prompt_tokens", "data.max_new_tokens"):
            _positive_int(c, f)
        prompt, gen = c.data.max_prompt_tokens, c.data.max_new_tokens
        cache = -(-(prompt + gen) // page) * page
        gen_field = "data.max_new_tokens"
    _check(
        c.rl.overlong.buffer <= gen,
        "rl.overlong.buffer",
        f"must be <= the completion budget ({gen} tokens, {gen_field})",
    )
    _check(
        cache % page == 0,
        "attention.page_size",
        f"must divide the KV cache length ({cache} tokens)",
    )
    _check(
        prompt + gen <= cache,
        gen_field,
        f"prompt ({prompt}) + generation ({gen}) tokens exceed the KV cache ({cache})",
    )
    if not c.model.get("checkpoint_dir", ""):
        try:
            model = preset(c.model.preset, **schema.model_overrides(c.model))
        except (ValueError, TypeError) as e:  # "ModelConfig.<field> must ..."
            m = re.search(r"ModelConfig\.(\w+)", str(e))
            field = f"model.{m.group(1)}" if m else "model"
            raise ConfigError(
                f"config.{field}: {str(e).replace('ModelConfig.', 'model.')}"
            ) from None
        _check(
            c.sparse.dense_layers <= model.num_layers,
            "sparse.dense_layers",
            f"must be <= the model's {model.num_layers} layers",
        )
    if "mesh" in c:
        _validate_mesh(c)


def _validate_mesh(c) -> None:
    """Axis sizes, and the RL batches split over the batch axes (data x fsdp) when their
    size is explicit (data = -1 depends on the device count: checked at setup)."""
    mesh, r = c.mesh, c.rl
    for f in ("mesh.fsdp", "mesh.tensor"):
        _positive_int(c, f)
    _nonneg(c, "mesh.device_memory_gb")
    _check(
        isinstance(mesh.data, int) and (mesh.data >= 1 or mesh.data == -1),
        "mesh.data",
        f"must be >= 1 or -1 (all devices left), got {mesh.data!r}",
    )
    if mesh.data == -1:
        return
    shards = mesh.data * mesh.fsdp
    m = r.samples_generated or r.samples_per_prompt
    for rows, what in (
        (r.prompts_per_step, "rl.prompts_per_step"),
        (r.prompts_per_step * m, "the rollout batch prompts_per_step x M"),
        (r.prompts_per_step * r.samples_per_prompt // r.minibatches, "a minibatch"),
        (
            r.prompts_per_step * r.samples_per_prompt // c.distill.row_stride // r.minibatches,
            "phi's minibatch (distill.row_stride)",
        ),
        (r.rollout_chunk_rows or shards, "a rollout chunk (rl.rollout_chunk_rows)"),
    ):
        _check(
            rows % shards == 0,
            "mesh.fsdp" if mesh.fsdp > 1 else "mesh.data",
            f"the batch shards data x fsdp = {shards} must divide {what} ({rows} rows)",
        )


def _validate_modes(c) -> None:
    """rl.rollout_mode and its sections: oversampling, IS corrections, sparse, lora, distill."""
    from dsparse_jax.model.lora import parse_targets

    r = c.rl
    _check(r.rollout_mode in MODES, "rl.rollout_mode", f"must be one of {tuple(MODES)}")
    _check(
        isinstance(r.samples_generated, int)
        and (r.samples_generated == 0 or r.samples_generated >= r.samples_per_prompt),
        "rl.samples_generated",
        f"must be 0 (= samples_per_prompt) or >= samples_per_prompt ({r.samples_per_prompt})",
    )
    m, chunk = r.samples_generated or r.samples_per_prompt, r.rollout_chunk_rows
    _check(
        chunk == 0 or (chunk % m == 0 and r.prompts_per_step * m % chunk == 0),
        "rl.rollout_chunk_rows",
        f"must be 0 (automatic) or a multiple of the {m} samples per prompt that divides "
        f"the rollout's {r.prompts_per_step * m} rows, got {chunk}",
    )
    _check(
        r.history_draft in HISTORY_DRAFTS,
        "rl.history_draft",
        f"must be one of {tuple(HISTORY_DRAFTS)}",
    )
    _positive_int(c, "rl.tree_width")
    if r.rollout_mode == "speculative":
        _check(r.draft in DRAFTS, "rl.draft", f"must be one of {tuple(DRAFTS)}")
        for f in ("rl.draft_tokens", "rl.history_ngram", "rl.history_prompts"):
            _positive_int(c, f)
        _positive_int(c, "rl.history_per_prompt")
        if r.draft == "draft_head":
            _validate_draft_head(c)
    _check(r.selection in ("reward", "acceptance"), "rl.selection", "must be reward or acceptance")
    _check(r.acceptance_C > 0, "rl.acceptance_C", "must be > 0")
    _check(
        r.is_correction in ("auto",) + modes.CORRECTIONS,
        "rl.is_correction",
        "must be auto, none, tis or mis",
    )
    _check(r.tis_cap > 0, "rl.tis_cap", "must be > 0")
    _check(0 < r.mis_lo <= 1, "rl.mis_lo", "must be in (0, 1]")
    _check(r.mis_hi >= 1, "rl.mis_hi", "must be >= 1")
    _check(r.mis_level in ("token", "sequence"), "rl.mis_level", "must be token or sequence")
    s = c.sparse
    _check(s.policy in POLICIES, "sparse.policy", f"must be one of {POLICIES}")
    for f in ("sparse.budget", "sparse.recent_pages"):
        _positive_int(c, f)
    _check(
        isinstance(s.sink_pages, int) and s.sink_pages >= 0,
        "sparse.sink_pages",
        "must be an integer >= 0",
    )
    _check(
        isinstance(s.dense_layers, int) and s.dense_layers >= 0,
        "sparse.dense_layers",
        "must be an integer >= 0",
    )
    _check(
        s.budget >= s.sink_pages + s.recent_pages,
        "sparse.budget",
        f"must be >= sink_pages + recent_pages ({s.sink_pages + s.recent_pages})",
    )
    _check(
        isinstance(s.group_pages, int) and (s.group_pages == 0 or s.group_pages >= 2),
        "sparse.group_pages",
        "must be 0 (flat selection) or an integer >= 2",
    )
    if s.group_pages:
        _check(s.policy != "streaming", "sparse.group_pages", "needs a scored policy")
        need = min_candidate_groups(s.group_pages, s.budget, s.sink_pages, s.recent_pages)
        _check(
            isinstance(s.candidate_groups, int) and s.candidate_groups >= need,
            "sparse.candidate_groups",
            f"must be >= {need}: the groups that can hold reserved pages plus enough whole "
            f"groups of {s.group_pages} pages for the budget",
        )
    _positive_int(c, "lora.rank")
    _check(c.lora.alpha > 0, "lora.alpha", "must be > 0")
    targets = parse_targets(c.lora.targets)
    _check(
        bool(targets)
        and all(t in LINEAR_NAMES for t in targets)
        and len(set(targets)) == len(targets),
        "lora.targets",
        f"must be distinct names from {LINEAR_NAMES} (or all | attn | mlp), got {c.lora.targets!r}",
    )
    _lr(c, "lora.learning_rate")
    _lr(c, "lora.max_grad_norm")
    _check(c.lora.schedule in ("cosine", "constant"), "lora.schedule", "must be cosine or constant")
    _validate_distill(c)
    _positive_int(c, "metrics.position_bin")
    _nonneg(c, "metrics.all_rows_every", integer=True)
    _nonneg(c, "metrics.twin_every", integer=True)
    _validate_prune(c)


def _validate_distill(c) -> None:
    """distill.*: phi's objective (rl/modes.phi_objective: the values, and the estimators and
    terms a mode refuses), checked for the mode that trains phi (distillsparse when the
    mode trains none: its values must still be valid)."""
    d, r = c.distill, c.rl
    mode = modes.get(r.rollout_mode, r.draft) if r.rollout_mode in MODES else None
    _nonneg(c, "distill.warmup_steps", integer=True)
    _check(
        d.warmup_steps == 0 or (mode is not None and mode.updates_phi),
        "distill.warmup_steps",
        f"must be 0 with rl.rollout_mode={r.rollout_mode}"
        + (f", rl.draft={r.draft}" if r.rollout_mode == "speculative" else "")
        + ": it trains no phi",
    )
    if mode is None or not mode.updates_phi:
        mode = MODES["distillsparse"]
    try:
        objective = modes.phi_objective(mode, d.loss, d.teacher, d.kl)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check(d.kl_coef >= 0, "distill.kl_coef", "must be >= 0")
    _check(
        objective.loss != "kl_only" or d.kl_coef > 0,
        "distill.kl_coef",
        "must be > 0 with distill.loss=kl_only (the loss would be zero)",
    )
    _check(
        d.warmup_steps == 0 or d.kl_coef > 0,
        "distill.kl_coef",
        "must be > 0 with distill.warmup_steps > 0 (the warm start's loss is its KL term)",
    )
    _positive_int(c, "distill.row_stride")
    batch, split = r.prompts_per_step * r.samples_per_prompt, r.minibatches * r.microbatches
    _check(
        batch % d.row_stride == 0 and (batch // d.row_stride) % split == 0,
        "distill.row_stride",
        f"the {batch} kept rows / {d.row_stride} must be a whole multiple of "
        f"rl.minibatches x rl.microbatches = {split} (phi's microbatches)",
    )


def _validate_draft_head(c) -> None:
    """rl.draft_head: layers inside the model, positive steps, a learning rate, an unroll
    >= 0 (capped at rl.draft_tokens by rl_state.draft_head_setup)."""
    from dsparse_jax.model.draft_head import parse_layers

    h = c.rl.draft_head
    layers = 10**6  # a checkpoint's depth is checked when the head is built
    if not c.model.get("checkpoint_dir", ""):
        try:
            from dsparse_jax.model.config import preset

            layers = preset(c.model.preset, **schema.model_overrides(c.model)).num_layers
        except (ValueError, TypeError):
            pass
    try:
        parse_layers(h.layers, layers)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config.rl.draft_head.layers: {e}") from None
    _lr(c, "rl.draft_head.learning_rate")
    _check(h.max_grad_norm > 0, "rl.draft_head.max_grad_norm", "must be > 0")
    _check(h.loss_weight > 0, "rl.draft_head.loss_weight", "must be > 0")
    _positive_int(c, "rl.draft_head.steps")
    _nonneg(c, "rl.draft_head.warmup_steps", integer=True)
    _nonneg(c, "rl.draft_head.unroll", integer=True)


# Settings that contradict the rollout mode (rl/modes.py properties) or each other:
# (field, refused(config.rl, mode), why). Each would otherwise be ignored in silence, make
# a meaningless choice, or fail only inside the first RL step.
CONFLICTS = (
    (
        "rl.prune.enabled",
        lambda r, mode: r.prune.enabled and mode.speculative,
        "must be false with rl.rollout_mode=speculative (its rollout never prunes)",
    ),
    (
        "rl.rollout_chunk_rows",
        lambda r, mode: r.rollout_chunk_rows > 0 and (mode.speculative or r.prune.enabled),
        "must be 0 with rl.rollout_mode=speculative or rl.prune.enabled: their draws span "
        "the whole batch, which they roll out at once (not chunked)",
    ),
    (
        "rl.grow_buffer_from",
        lambda r, mode: r.grow_buffer_from > 0 and mode.speculative,
        "must be 0 with rl.rollout_mode=speculative (its loop uses one cache buffer)",
    ),
    (
        "rl.selection",
        lambda r, mode: r.selection == "acceptance" and (mode.speculative or not mode.has_twin),
        "acceptance needs a sparse actor (rl.rollout_mode sparse, sparse_train or "
        "distillsparse): dense and speculative rollouts are the dense policy's own, every "
        "token passes and the selection would be random",
    ),
    (
        "rl.selection",
        lambda r, mode: r.selection == "acceptance" and r.samples_generated <= r.samples_per_prompt,
        "acceptance keeps n of M > n samples per prompt: needs rl.samples_generated > "
        "rl.samples_per_prompt (with M = n, as rl.prune.enabled has, every row is kept)",
    ),
    *(
        (
            f"rl.{field}",
            lambda r, mode, field=field, off=off: (
                r[field] != off and (mode.updates_phi or mode.speculative)
            ),
            "must be off with rl.rollout_mode distillsparse or speculative: phi's distillation "
            "and the drafters target the untruncated policy (docs/objectives.md)",
        )
        for field, off in (("top_k", 0), ("top_p", 1.0))
    ),
    (
        "rl.draft",
        lambda r, mode: r.draft != schema.defaults().rl.draft and not mode.speculative,
        "is read only with rl.rollout_mode=speculative (elsewhere leave it at its default)",
    ),
    (
        "rl.history_draft",
        lambda r, mode: (
            r.history_draft != schema.defaults().rl.history_draft
            and not (mode.speculative and r.draft == "history")
        ),
        "is read only with rl.rollout_mode=speculative and rl.draft=history",
    ),
)


def _validate_conflicts(c) -> None:
    """No setting contradicts the rollout mode or another setting (CONFLICTS)."""
    r = c.rl
    mode = modes.get(r.rollout_mode, r.draft)
    for field, refused, why in CONFLICTS:
        _check(not refused(r, mode), field, why)


def prune_positions(text: str) -> tuple[int, ...]:
    """rl.prune.positions as a tuple of ints (ValueError if it does not parse)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    return tuple(int(p) for p in parts)


def _validate_prune(c) -> None:
    """rl.prune: M' > n, checkpoints inside the completion budget, label rows that fit."""
    from dsparse_jax.data import math_task

    p, r = c.rl.prune, c.rl
    _check(isinstance(p.enabled, bool), "rl.prune.enabled", "must be true or false")
    n = r.samples_per_prompt
    _check(
        isinstance(p.generated, int) and (p.generated == 0 or p.generated > n),
        "rl.prune.generated",
        f"must be 0 (= 2n) or > rl.samples_per_prompt ({n}), got {p.generated!r}",
    )
    try:
        pos = prune_positions(p.positions)
    except ValueError:
        pos = ()
    _check(
        bool(pos) and all(x >= 1 for x in pos) and list(pos) == sorted(set(pos)),
        "rl.prune.positions",
        f"must be a comma list of increasing token counts >= 1, got {p.positions!r}",
    )
    _check(0.0 <= p.rho <= 1.0, "rl.prune.rho", f"must be in [0, 1], got {p.rho!r}")
    _nonneg(c, "rl.prune.label_rows", integer=True)
    _check(isinstance(p.layer, int), "rl.prune.layer", "must be an integer")
    _nonneg(c, "rl.prune.head_hidden", integer=True)
    _lr(c, "rl.prune.head_learning_rate")
    _positive_int(c, "rl.prune.head_steps")
    if not p.enabled:
        return
    m = p.generated or 2 * n
    sizes = prune_sizes(m, n, len(pos))
    groups = (m,) + sizes
    _check(
        all(g > k for g, k in zip(groups, groups[1:])),
        "rl.prune.positions",
        f"{len(pos)} checkpoints cannot each prune from {m} to {n} rows per prompt",
    )
    for g, k in zip(groups, groups[1:]):
        _check(
            g - k >= p.label_rows,
            "rl.prune.label_rows",
            f"must be <= the {g - k} rows pruned per prompt at a checkpoint ({g} -> {k})",
        )
    _check(r.samples_generated == 0, "rl.samples_generated", "must be 0 with rl.prune.enabled")
    if str(c.data.source).startswith("synthetic:"):
        try:
            budget = math_task.from_config(c.task).completion_budget()
        except ValueError:
            return  # reported by the shape checks
    else:
        budget = c.data.max_new_tokens
    _check(
        pos[-1] < budget,
        "rl.prune.positions",
        f"the last checkpoint ({pos[-1]}) must be < the completion budget ({budget} tokens)",
    )
    if c.model.get("checkpoint_dir", ""):
        return  # the checkpoint's depth is checked when the head is built
    try:
        from dsparse_jax.model.config import preset

        layers = preset(c.model.preset, **schema.model_overrides(c.model)).num_layers
    except (ValueError, TypeError):
        return
    _check(-layers <= p.layer < layers, "rl.prune.layer", f"must be in [-{layers}, {layers - 1}]")


def prune_sizes(generated: int, n: int, checkpoints: int) -> tuple[int, ...]:
    """Rows kept per prompt after each checkpoint: from M' down to n in even steps."""
    return tuple(
        round(generated - (generated - n) * (i + 1) / checkpoints) for i in range(checkpoints)
    )
