"""A whole run: validate the config, build, warm start (SFT), RL, final evaluation."""

from __future__ import annotations

import copy
import json
import os
import time

import jax

from dsparse_jax.config import schema
from dsparse_jax.config.validate import field_error, validate
from dsparse_jax.errors import UserError
from dsparse_jax.model import hf_checkpoint
from dsparse_jax.model.config import preset
from dsparse_jax.parallel import distributed, sharding
from dsparse_jax.report.metrics import MetricsWriter, read_metrics
from dsparse_jax.train import context, rl_loop, sft


def prepare_workdir(workdir: str) -> None:
    """Creates the workdir; a UserError naming it if it cannot be used."""
    if not workdir:
        raise UserError("--workdir: empty; pass --workdir=<dir>")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create workdir {workdir!r}: {e.strerror or e}") from None
    if not os.access(workdir, os.R_OK | os.W_OK | os.X_OK):
        raise UserError(f"workdir {workdir!r} is not readable and writable")
    for name in ("metrics.jsonl", "checkpoints", "sft"):
        path = os.path.join(workdir, name)
        if os.path.exists(path) and not os.access(path, os.R_OK | os.W_OK):
            raise UserError(f"{path!r} in the workdir is not readable and writable")


def backend_warning(model_dtype: str, backend: str) -> str | None:
    """A warning for a model dtype that runs far slower than it should on this backend."""
    if backend == "cpu" and model_dtype == "bfloat16":
        return (
            "model.dtype=bfloat16 on CPU: XLA:CPU converts a bf16 KV cache to f32 and back "
            "at every decode write, O(context) per step (docs/benchmarks.md); use "
            "--config.model.dtype=float32 --config.model.param_dtype=float32 on CPU"
        )
    return None


def write_config(workdir: str, config, model_cfg=None) -> None:
    """<workdir>/config.json, written atomically; with the built model's config, model.*
    holds the resolved values (the preset's where the config left a field unset)."""
    if model_cfg is not None:
        config = copy.deepcopy(config)
        for name in schema.MODEL_FIELDS:
            value = getattr(model_cfg, name)
            config.model[name] = ",".join(value) if name == "layer_pattern" else value
    path = os.path.join(workdir, "config.json")
    with open(path + ".tmp", "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    os.replace(path + ".tmp", path)


# What a workdir's checkpoints depend on: a run with another value of any of these cannot
# resume them (sections: every field in them). Everything else (steps, evaluation,
# logging, learning rates) may change on resume.
IDENTITY = (
    "model",
    "tokenizer",
    "task",
    "lora.rank",
    "lora.targets",
    "lora.layers",
    "rl.rollout_mode",
    "rl.draft",
    "data.source",
)


def _flat(section, prefix: str) -> dict:
    if isinstance(section, dict):
        return {
            k: v for name, sub in section.items() for k, v in _flat(sub, f"{prefix}.{name}").items()
        }
    return {prefix: section}


def _resolved_model(config) -> dict:
    """{"model.<field>": value} of the model `config` builds (the preset and its overrides,
    or the checkpoint's config.json), as config.json records them; vocab_size only where
    set (else it is the tokenizer's). {} where it cannot be read here."""
    c = config.model
    try:
        if c.get("checkpoint_dir", ""):
            cfg = hf_checkpoint.load_model_config(c.checkpoint_dir)
        else:
            cfg = preset(c.preset, **schema.model_overrides(c))
    except (OSError, ValueError, TypeError):
        return {}  # the run's own checks report it
    out = {}
    for name in schema.MODEL_FIELDS:
        value = getattr(cfg, name)
        if name == "vocab_size" and c.get("vocab_size") is None:
            continue
        out[f"model.{name}"] = ",".join(value) if name == "layer_pattern" else value
    return out


def check_workdir(workdir: str, config) -> None:
    """Stops (a UserError naming the fields) before anything is written when the workdir
    holds a run (its SFT or RL checkpoints) whose config differs from `config` in a field
    those checkpoints depend on (IDENTITY); unset model fields (None: the preset's) match
    the recorded values."""
    path = os.path.join(workdir, "config.json")
    trained = any(os.path.exists(os.path.join(workdir, d)) for d in ("checkpoints", "sft"))
    if not trained or not os.path.isfile(path):
        return  # nothing its config matters for (e.g. a run that stopped at a bad input)
    try:
        with open(path) as f:
            before = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e}); pass another --workdir") from None
    now = json.loads(config.to_json_best_effort())
    old, new = {}, {}
    for key in IDENTITY:
        section, _, field = key.partition(".")
        a, b = before.get(section, {}), now.get(section, {})
        if field:
            a, b = {field: a.get(field)} if field in a else {}, {field: b.get(field)}
        old.update(_flat(a, section))
        new.update(_flat(b, section))
    new.update(_resolved_model(config))
    differ = [
        f"{k} ({old[k]!r} -> {v!r})"
        for k, v in new.items()
        if k in old and v is not None and v != old[k] and k != "model.preset"
    ]
    if differ:
        raise UserError(
            f"--workdir: {workdir} holds a run with another {', '.join(differ)}, which its "
            "checkpoints depend on; nothing was changed. Start afresh in another "
            "--workdir (or resume with the recorded values)"
        )


def main(config, workdir: str, sft_only: bool = False) -> dict:
    """The whole run; with sft_only, the SFT warm start alone (no RL)."""
    validate(config)  # before anything compiles
    distributed.initialize(config)  # multi-host: before any device is touched
    try:  # the mesh and the RL batch sizes it must split, before the SFT warm start
        sharding.check_rl_batches(sharding.plan_from_config(config), config.rl)
    except ValueError as e:
        raise field_error("mesh", e) from None
    prepare_workdir(workdir)
    check_workdir(workdir, config)  # before anything is written into it
    write_config(workdir, config)
    t0 = time.time()
    ctx = context.build(config)
    write_config(workdir, config, ctx.model_cfg)
    print(
        f"[run] {config.name}: model {ctx.model_cfg.d_model}d x {ctx.model_cfg.num_layers} "
        f"layers, {ctx.num_params / 1e6:.2f}M params, vocab {ctx.tok.vocab_size}; "
        f"task {ctx.task.describe()}, sequences of {ctx.seq_width} tokens; "
        f"workdir {workdir}",
        flush=True,
    )
    warning = backend_warning(ctx.model_cfg.dtype, jax.default_backend())
    if warning:
        print(f"[run] warning: {warning}", flush=True)
    # Multi-host: process 0 logs to the workdir, the others to <workdir>/process<i>.
    pid = jax.process_index()
    log_dir = workdir if pid == 0 else os.path.join(workdir, f"process{pid}")
    os.makedirs(log_dir, exist_ok=True)
    wandb = None
    if config.log.wandb and pid == 0:
        wandb = {
            "project": config.log.wandb_project,
            "name": os.path.basename(os.path.abspath(workdir)),
            "config": config.to_dict(),
        }
    writer = MetricsWriter(log_dir, tensorboard=config.log.tensorboard, wandb=wandb)
    try:
        # The RL step's device memory, before the warm start and any compile: a config
        # that cannot fit at any rollout chunk size stops here (a UserError naming a field).
        plan = None if sft_only else rl_loop.plan_memory(ctx)
        sft_params, sft_acc = sft.warm_start(ctx, workdir, writer)
        if not sft_only:
            rl_loop.train_rl(ctx, workdir, sft_params, writer, plan)
    finally:
        writer.close()
        ctx.rewarder.close()
    evals = [r for r in read_metrics(log_dir) if r["phase"] == "eval"]
    summary = {
        "sft_greedy_accuracy": sft_acc,
        "rl_greedy_accuracy": evals[-1]["greedy_accuracy"] if evals else None,
        "wall_time_s": time.time() - t0,
    }
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[run] done: {json.dumps(summary)}", flush=True)
    return summary
