"""A trained policy out of a run directory (launch/evaluate.py, launch/export.py): theta,
and phi where the rollout mode's actor has it, from the RL checkpoint at a given step or
the newest one; without RL checkpoints, theta of the SFT warm start."""

from __future__ import annotations

import dataclasses
import json
import os

from dsparse_jax.config import schema
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import checkpoints
from dsparse_jax.train import rl_loop, sft
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.rl_state import RLSetup, make_setup
from dsparse_jax.train.trainables import init_state


@dataclasses.dataclass
class Trained:
    params: object  # theta (nnx.State)
    lora: dict | None  # phi, None where the actor has no adapter (or from SFT)
    setup: RLSetup  # the actor's attention and LoRA scale (setup.rollout_spec, lora_scale)
    source: str  # "rl step N" | "sft step N"
    step: int
    head: dict | None = None  # the rollout quality head (rl.prune runs' RL checkpoints)
    draft_head: object = None  # the learned drafter (rl.draft=draft_head runs' RL checkpoints)


def workdir_config(workdir: str):
    """The resolved config a run wrote (<workdir>/config.json) over the current defaults
    (fields added since keep their defaults)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"--workdir: no config.json in {workdir!r} (not a run directory)")
    try:
        with open(path) as f:
            return schema.from_dict(json.load(f))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: cannot be read as a config ({type(e).__name__}: {e})") from e


def load(ctx: RunContext, workdir: str, step: int | None = None) -> Trained:
    """The RL checkpoint at `step` (None: the newest), else the SFT warm start."""
    setup = make_setup(ctx)
    st = init_state(ctx, setup, ctx.init_params)
    rl_dir = os.path.join(workdir, "checkpoints")
    steps = []
    if os.path.isdir(rl_dir):
        ckpt = checkpoints.Checkpointer(workdir, "checkpoints", keep=ctx.config.checkpoint.keep)
        steps = ckpt.all_steps()
        if steps and (step is None or step in steps):
            use = steps[-1] if step is None else step
            try:
                st = rl_loop.restore_state(ckpt, use, st)
            except (checkpoints.CheckpointError, checkpoints.IncompatibleCheckpoint) as e:
                raise UserError(f"{rl_dir}/{use}: {e}") from None
            finally:
                ckpt.close()
            head, drafter = (
                None if t is None else t.params for t in (st.quality_head, st.draft_head)
            )
            return Trained(st.theta.params, st.lora, setup, f"rl step {use}", use, head, drafter)
        ckpt.close()
    found = sft.restore(ctx, workdir, step)
    if found is None:
        raise UserError(
            f"--workdir: no checkpoint{f' at step {step}' if step is not None else ''} in "
            f"{workdir!r} (RL steps {steps or 'none'})"
        )
    return Trained(found[0], None, setup, f"sft step {found[1]}", found[1])
