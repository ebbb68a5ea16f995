"""Config validation (dsparse_jax/config/validate.py): each bad value is rejected before
anything compiles, with one line that names the field."""

import math
import os

import pytest

from dsparse_jax.config.validate import ConfigError, load_config, validate
from dsparse_jax.data import batches
from dsparse_jax.train import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default():
    return load_config(os.path.join(ROOT, "configs", "gemma_math.py"))


def _set(c, field, value):
    *path, name = field.split(".")
    for p in path:
        c = c[p]
    c[name] = value


# (field, value, expected text after "config.<field>: "); defaults: n = M = 8 samples,
# 4 layers, sparse budget 6 with 1 sink + 2 recent pages, 16 vars, 8 terms, page 16.
CASES = [
    # group sizes: M >= n >= 2
    ("rl.samples_per_prompt", 1, "must be >= 2"),
    ("rl.samples_generated", 4, "must be 0 (= samples_per_prompt) or >= samples_per_prompt"),
    # sparse budget covers the reserved (sink + recent) pages; dense layers <= layers
    ("sparse.budget", 2, "must be >= sink_pages + recent_pages (3)"),
    ("sparse.recent_pages", 0, "must be a positive integer"),
    ("sparse.dense_layers", 5, "must be <= the model's 4 layers"),
    ("sparse.dense_layers", -1, "must be an integer >= 0"),
    ("sparse.group_pages", 1, "must be 0 (flat selection) or an integer >= 2"),
    # learning rates (and gradient clips) finite and positive
    ("rl.learning_rate", 0.0, "must be finite and > 0"),
    ("rl.learning_rate", -1e-4, "must be finite and > 0"),
    ("rl.learning_rate", math.nan, "must be finite and > 0"),
    ("sft.learning_rate", math.inf, "must be finite and > 0"),
    ("lora.learning_rate", 0.0, "must be finite and > 0"),
    ("rl.max_grad_norm", math.nan, "must be finite and > 0"),
    ("lora.weight_decay", -0.1, "must be finite and >= 0"),
    ("rl.warmup_steps", -1, "must be finite and >= 0"),  # RL steps: a fraction allowed
    ("lora.warmup_steps", -0.5, "must be finite and >= 0"),
    ("lora.warmup_steps", math.inf, "must be finite and >= 0"),
    ("rl.temperature", math.inf, "must be finite and > 0"),
    # batch structure, and the batch divisible by the mesh's batch axes (data x fsdp)
    ("rl.minibatches", 3, "must divide the rollout batch"),
    ("mesh.data", 3, "the batch shards data x fsdp = 3 must divide rl.prompts_per_step (8"),
    ("mesh.fsdp", 16, "data x fsdp = 16 must divide rl.prompts_per_step (8 rows)"),
    ("mesh.data", 0, "must be >= 1 or -1"),
    ("mesh.tensor", 0, "must be a positive integer"),
    ("rl.microbatches", 3, "must divide the minibatch size 32"),
    ("rl.prompts_per_step", 0, "must be a positive integer"),
    # rollout chunks of whole prompts' samples that divide the rollout; device memory
    ("rl.rollout_chunk_rows", 12, "must be 0 (automatic) or a multiple of the 8 samples"),
    ("rl.rollout_chunk_rows", 24, "that divides the rollout's 64 rows"),
    ("rl.rollout_chunk_rows", -8, "must be an integer >= 0"),
    ("mesh.device_memory_gb", -1.0, "must be finite and >= 0"),
    # task, model, cache
    ("task.num_terms", 27, "must be <= task.num_vars"),
    ("task.num_vars", 27, "num_vars must be in [1, 26]"),
    ("task.format_reward", 1.0, "must be finite and < 1"),
    ("model.num_layers", 0, "model.num_layers must be positive"),
    ("model.preset", "gemma9", "unknown preset"),
    ("attention.page_size", 0, "must be a positive integer"),
    # loop and reliability settings
    ("rl.max_consecutive_skips", -1, "must be an integer >= 0"),
    ("checkpoint.keep", 0, "must be a positive integer"),
    ("checkpoint.every", 0, "must be a positive integer"),
    ("rl.rollout_mode", "sparsest", "must be one of"),
    # theta's objective (rl/objectives.py), truncated sampling, DAPO's settings
    ("rl.advantage", "gae", "must be one of ('grpo', 'dr_grpo', 'rloo')"),
    ("rl.policy_loss", "ppo", "must be one of ('ppo_clip', 'gspo', 'cispo')"),
    ("rl.loss_agg", "sum", "must be one of"),
    ("rl.clip_low", 1.0, "must be in [0, 1)"),
    ("rl.gspo_clip_low", 1.0, "must be in [0, 1)"),
    ("rl.gspo_clip_high", -1e-4, "must be >= 0"),
    ("rl.cispo_clip_low", -0.1, "must be >= 0 (>= 1: no lower bound)"),
    ("rl.cispo_clip_high", -1.0, "must be >= 0"),
    ("rl.top_k", -1, "must be an integer >= 0"),
    ("rl.top_p", 0.0, "must be in (0, 1]"),
    ("rl.top_p", 1.5, "must be in (0, 1]"),
    ("rl.dynamic_sampling.max_draws", 0, "must be a positive integer"),
    ("rl.overlong.buffer", -1, "must be an integer >= 0"),
    ("rl.overlong.buffer", 75, "must be <= the completion budget (74 tokens, task.num_terms)"),
    ("rl.overlong.penalty", -1.0, "must be finite and >= 0"),
    # speculative drafters
    ("rl.history_draft", "suffix", "must be one of ('latest', 'counts', 'tree')"),
    ("rl.tree_width", 0, "must be a positive integer"),
]


def test_default_config_is_valid():
    validate(default())


@pytest.mark.parametrize("field,value,message", CASES, ids=[f"{f}={v}" for f, v, _ in CASES])
def test_bad_value_names_the_field(field, value, message):
    c = default()
    _set(c, field, value)
    with pytest.raises(ConfigError) as e:
        validate(c)
    text = str(e.value)
    assert text.startswith(f"config.{field}: "), text
    assert message in text, text
    assert "\n" not in text


# Settings that contradict the rollout mode or each other (validate.CONFLICTS): the
# overrides, the field named and the text after "config.<field>: ".
SPEC = {"rl.rollout_mode": "speculative"}
M2N = {"rl.samples_generated": 16}  # M = 2n
ACCEPTANCE = {"rl.selection": "acceptance", **M2N}
SPARSE_ACTOR = "acceptance needs a sparse actor"
TRUNCATED = "must be off with rl.rollout_mode distillsparse or speculative"
CONFLICTS = [
    ({**SPEC, "rl.prune.enabled": True}, "rl.prune.enabled", "must be false with rl.rollout_mode"),
    ({**SPEC, "rl.grow_buffer_from": 64}, "rl.grow_buffer_from", "must be 0 with rl.rollout_mode"),
    ({**SPEC, **ACCEPTANCE}, "rl.selection", SPARSE_ACTOR),
    ({**SPEC, "rl.draft": "history", **ACCEPTANCE}, "rl.selection", SPARSE_ACTOR),
    ({"rl.rollout_mode": "dense", **ACCEPTANCE}, "rl.selection", SPARSE_ACTOR),
    ({"rl.selection": "acceptance"}, "rl.selection", "acceptance keeps n of M > n samples"),
    (
        {"rl.selection": "acceptance", "rl.prune.enabled": True},
        "rl.selection",
        "acceptance keeps n of M > n samples",
    ),
    ({**SPEC, "rl.rollout_chunk_rows": 16}, "rl.rollout_chunk_rows", "must be 0 with"),
    (
        {"rl.prune.enabled": True, "rl.rollout_chunk_rows": 16},
        "rl.rollout_chunk_rows",
        "their draws span the whole batch",
    ),
    ({"rl.draft": "history"}, "rl.draft", "is read only with rl.rollout_mode=speculative"),
    ({"rl.draft": "draft_head", "rl.rollout_mode": "sparse"}, "rl.draft", "is read only"),
    ({**SPEC, "rl.history_draft": "tree"}, "rl.history_draft", "and rl.draft=history"),
    ({"rl.history_draft": "counts"}, "rl.history_draft", "is read only with"),
    (
        {"rl.policy_loss": "gspo", "rl.dual_clip": 3.0},
        "rl.dual_clip",
        "must be 0 with rl.policy_loss=gspo",
    ),
    ({"rl.policy_loss": "cispo", "rl.dual_clip": 3.0}, "rl.dual_clip", "a dual clip is ppo_clip's"),
    (
        {"rl.advantage": "rloo", "rl.scale_adv_by_std": False},
        "rl.scale_adv_by_std",
        "rloo has no std",
    ),
    ({"rl.top_k": 4}, "rl.top_k", TRUNCATED),  # the default mode, distillsparse, trains phi
    ({"rl.top_p": 0.9}, "rl.top_p", TRUNCATED),
    ({**SPEC, "rl.draft": "history", "rl.top_k": 4}, "rl.top_k", TRUNCATED),
]
# Neighbours of the refused pairs that make sense and stay allowed.
ALLOWED = [
    {"rl.rollout_mode": mode, **ACCEPTANCE} for mode in ("sparse", "sparse_train", "distillsparse")
] + [
    {**SPEC, "rl.draft": "history", **M2N},  # reward selection of exact rollouts
    {**SPEC, "rl.draft": "history", "rl.history_draft": "tree", "rl.tree_width": 3},
    {**SPEC, "rl.is_correction": "tis"},  # a no-op on exact rollouts, harmless
    {"rl.rollout_mode": "dense", "rl.prune.enabled": True},
    {"rl.rollout_mode": "sparse", "rl.grow_buffer_from": 64},
    {"rl.rollout_chunk_rows": 16, "rl.grow_buffer_from": 64},
    {"rl.rollout_chunk_rows": 32, "rl.samples_generated": 16},  # 2 prompts' M = 16 rows
    {"rl.rollout_mode": "dense", "rl.top_k": 4, "rl.top_p": 0.9},
    {"rl.rollout_mode": "sparse_train", "rl.top_p": 0.9},
    {"rl.policy_loss": "ppo_clip", "rl.dual_clip": 3.0},
    {"rl.advantage": "dr_grpo", "rl.scale_adv_by_std": False},  # the older spelling agrees
    {"rl.policy_loss": "gspo", "rl.loss_agg": "token-mean"},
]


def _override(overrides: dict):
    c = default()
    for field, value in overrides.items():
        _set(c, field, value)
    return c


@pytest.mark.parametrize(
    "overrides,field,message",
    CONFLICTS,
    ids=[",".join(map(str, o.values())) for o, *_ in CONFLICTS],
)
def test_contradictory_settings_name_the_field(overrides, field, message):
    with pytest.raises(ConfigError) as e:
        validate(_override(overrides))
    text = str(e.value)
    assert text.startswith(f"config.{field}: "), text
    assert message in text and "\n" not in text, text


@pytest.mark.parametrize(
    "overrides", ALLOWED, ids=[",".join(map(str, o.values())) for o in ALLOWED]
)
def test_compatible_settings_are_allowed(overrides):
    validate(_override(overrides))


@pytest.mark.parametrize(
    "field,hint",
    [
        ("rl.learning_rat", " (did you mean rl.learning_rate?)"),
        ("sparse.budgets", " (did you mean sparse.budget?)"),
        ("optimizer", ""),
    ],
)
def test_unknown_keys_are_rejected(field, hint):
    c = default()
    *path, name = field.split(".")
    section = c
    for p in path:
        section = section[p]
    section[name] = 1
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert str(e.value) == f"config.{field}: unknown key{hint}"


def test_dataset_lengths_fit_the_cache():
    c = default()
    c.data.source = "jsonl:/nonexistent/train.jsonl"  # not read by validation
    validate(c)
    c.data.max_new_tokens = 0
    with pytest.raises(ConfigError, match=r"^config\.data\.max_new_tokens: must be a positive"):
        validate(c)


def test_missing_key_is_reported():
    c = default()
    del c.rl["tis_cap"]
    with pytest.raises(ConfigError, match=r"^config\.rl\.tis_cap: missing"):
        validate(c)


@pytest.mark.parametrize(
    "broken,field",
    [
        (lambda task, page: 16 * 7 + 3, "attention.page_size"),  # not whole pages
        (lambda task, page: 16, "task.num_terms"),  # prompt + generation do not fit
    ],
)
def test_cache_shape_invariants(monkeypatch, broken, field):
    """The KV cache length is derived (whole pages of prompt + generation); the checks
    guard that derivation."""
    monkeypatch.setattr(batches, "sequence_buffer", broken)
    with pytest.raises(ConfigError, match=rf"^config\.{field}: "):
        validate(default())


def test_validation_runs_before_anything_is_built(tmp_path, monkeypatch):
    from dsparse_jax.train import context

    def boom(_):
        raise AssertionError("context.build ran before validation")

    monkeypatch.setattr(context, "build", boom)
    c = default()
    c.rl.samples_generated = 3
    with pytest.raises(ConfigError, match="config.rl.samples_generated"):
        run.main(c, str(tmp_path / "wd"))
    assert not os.path.exists(tmp_path / "wd")  # nothing written either


def test_backend_warning_names_bf16_on_cpu_only():
    # XLA:CPU upcasts a bf16 cache write to f32 over the whole cache (docs/benchmarks.md).
    assert "model.dtype=bfloat16 on CPU" in run.backend_warning("bfloat16", "cpu")
    assert run.backend_warning("float32", "cpu") is None
    assert run.backend_warning("bfloat16", "gpu") is None
    assert run.backend_warning("bfloat16", "tpu") is None


def test_renamed_policy_value_is_read_under_its_new_name(capsys):
    """sparse.policy='distillsparse' (the centroid scorer's old name) still loads, from a
    config file with a one-line note and from an old run's config.json silently."""
    from dsparse_jax.config import cli, schema

    path = os.path.join(ROOT, "configs", "gemma_math.py")
    config = cli.load_config(path, {"sparse.policy": "distillsparse"})
    assert config.sparse.policy == "centroid"
    assert capsys.readouterr().err.strip().splitlines() == [
        "note: sparse.policy='distillsparse' is now called 'centroid' (read as that)"
    ]
    validate(config)
    old_run = schema.from_dict({"sparse": {"policy": "distillsparse"}})
    assert old_run.sparse.policy == "centroid"
    assert schema.from_dict({"sparse": {"policy": "quest"}}).sparse.policy == "quest"
