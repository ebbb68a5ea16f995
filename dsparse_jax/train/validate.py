"""Config validation that runs before anything compiles: one line naming the bad field."""

from __future__ import annotations

import math

from dsparse_jax.attention.spec import IMPLS, POLICIES
from dsparse_jax.model.config import PRESETS
from dsparse_jax.model.transformer import LINEAR_NAMES
from dsparse_jax.rl.losses import AGG_MODES


class ConfigError(ValueError):
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
    _check(isinstance(v, (int, float)) and math.isfinite(v) and v > 0, field,
           f"must be finite and > 0, got {v!r}")


def validate(c) -> None:
    """Raises ConfigError on the first invalid value."""
    _check(c.model.preset in PRESETS, "model.preset", f"unknown preset {c.model.preset!r}, "
           f"choose from {sorted(PRESETS)}")
    for f in ("model.param_dtype", "model.dtype"):
        _check(_get(c, f) in ("float32", "bfloat16"), f, "must be float32 or bfloat16")
    for f in ("task.num_vars", "task.num_terms", "attention.page_size", "sft.max_steps",
              "sft.batch_size", "sft.eval_every", "rl.num_steps", "rl.prompts_per_step",
              "rl.samples_per_prompt", "rl.minibatches", "rl.microbatches", "eval.every",
              "eval.num_problems", "checkpoint.every", "checkpoint.keep"):
        _positive_int(c, f)
    _check(c.task.num_terms <= c.task.num_vars, "task.num_terms",
           f"must be <= task.num_vars ({c.task.num_vars})")
    _check(c.attention.impl in IMPLS, "attention.impl", f"must be one of {IMPLS}")
    for f in ("sft.learning_rate", "rl.learning_rate", "rl.max_grad_norm", "sft.max_grad_norm"):
        _lr(c, f)
    _check(0.0 <= c.sft.target_accuracy <= 1.0, "sft.target_accuracy", "must be in [0, 1]")
    _check(c.rl.samples_per_prompt >= 2, "rl.samples_per_prompt",
           "must be >= 2 (group-relative advantages need a group)")
    _check(c.rl.temperature > 0, "rl.temperature", "must be > 0 for RL sampling")
    _check(0 <= c.rl.clip_low < 1, "rl.clip_low", "must be in [0, 1)")
    _check(c.rl.clip_high >= 0, "rl.clip_high", "must be >= 0")
    _check(c.rl.dual_clip == 0 or c.rl.dual_clip > 1, "rl.dual_clip", "must be 0 (off) or > 1")
    _check(c.rl.loss_agg in AGG_MODES, "rl.loss_agg", f"must be one of {AGG_MODES}")
    _check(c.rl.kl_kind in ("k1", "k2", "k3"), "rl.kl_kind", "must be k1, k2 or k3")
    _check(c.rl.kl_coef >= 0, "rl.kl_coef", "must be >= 0")
    _check(c.rl.schedule in ("cosine", "constant"), "rl.schedule", "must be cosine or constant")
    batch = c.rl.prompts_per_step * c.rl.samples_per_prompt
    _check(batch % c.rl.minibatches == 0, "rl.minibatches",
           f"must divide the rollout batch prompts_per_step * samples_per_prompt = {batch}")
    _check((batch // c.rl.minibatches) % c.rl.microbatches == 0, "rl.microbatches",
           f"must divide the minibatch size {batch // c.rl.minibatches}")
    _check(c.eval.mean_at_k >= 0, "eval.mean_at_k", "must be >= 0")
    _validate_modes(c)


ROLLOUT_MODES = ("dense", "sparse", "sparse_train", "distillsparse")


def _validate_modes(c) -> None:
    """rl.rollout_mode and its sections: oversampling, IS corrections, sparse, lora, distill."""
    from dsparse_jax.model.lora import parse_targets
    from dsparse_jax.train.distill import DISTILL_LOSSES, KL_KINDS, TEACHERS
    r = c.rl
    _check(r.rollout_mode in ROLLOUT_MODES, "rl.rollout_mode", f"must be one of {ROLLOUT_MODES}")
    _check(isinstance(r.samples_generated, int) and (
        r.samples_generated == 0 or r.samples_generated >= r.samples_per_prompt),
        "rl.samples_generated",
        f"must be 0 (= samples_per_prompt) or >= samples_per_prompt ({r.samples_per_prompt})")
    _check(r.selection in ("reward", "acceptance"), "rl.selection", "must be reward or acceptance")
    _check(r.acceptance_C > 0, "rl.acceptance_C", "must be > 0")
    _check(r.is_correction in ("none", "tis", "mis"), "rl.is_correction",
           "must be none, tis or mis")
    _check(r.tis_cap > 0, "rl.tis_cap", "must be > 0")
    _check(0 < r.mis_lo <= 1, "rl.mis_lo", "must be in (0, 1]")
    _check(r.mis_hi >= 1, "rl.mis_hi", "must be >= 1")
    _check(r.mis_level in ("token", "sequence"), "rl.mis_level", "must be token or sequence")
    s = c.sparse
    _check(s.policy in POLICIES, "sparse.policy", f"must be one of {POLICIES}")
    for f in ("sparse.budget", "sparse.recent_pages"):
        _positive_int(c, f)
    _check(isinstance(s.sink_pages, int) and s.sink_pages >= 0, "sparse.sink_pages",
           "must be an integer >= 0")
    _check(isinstance(s.dense_layers, int) and s.dense_layers >= 0, "sparse.dense_layers",
           "must be an integer >= 0")
    _check(s.budget >= s.sink_pages + s.recent_pages, "sparse.budget",
           f"must be >= sink_pages + recent_pages ({s.sink_pages + s.recent_pages})")
    _positive_int(c, "lora.rank")
    _check(c.lora.alpha > 0, "lora.alpha", "must be > 0")
    targets = parse_targets(c.lora.targets)
    _check(bool(targets) and all(t in LINEAR_NAMES for t in targets)
           and len(set(targets)) == len(targets), "lora.targets",
           f"must be distinct names from {LINEAR_NAMES} (or all | attn | mlp), got "
           f"{c.lora.targets!r}")
    _lr(c, "lora.learning_rate")
    _lr(c, "lora.max_grad_norm")
    _check(c.lora.warmup_steps >= 0, "lora.warmup_steps", "must be >= 0")
    _check(c.lora.schedule in ("cosine", "constant"), "lora.schedule",
           "must be cosine or constant")
    d = c.distill
    _check(d.teacher in TEACHERS, "distill.teacher", f"must be one of {TEACHERS}")
    _check(d.loss in DISTILL_LOSSES, "distill.loss", f"must be one of {DISTILL_LOSSES}")
    _check(d.kl in KL_KINDS, "distill.kl", f"must be one of {KL_KINDS}")
    _check(d.kl_coef >= 0, "distill.kl_coef", "must be >= 0")
    _check(d.loss != "kl_only" or d.kl_coef > 0, "distill.kl_coef",
           "must be > 0 with distill.loss=kl_only (the loss would be zero)")
    _positive_int(c, "metrics.position_bin")
