"""Orbax checkpoints of the training state: params, optimizer state, step, RNG, data position.

Params are saved as nnx pure dicts; optimizer states as their flat leaf lists (their tree
structure is rebuilt from a freshly initialised optimizer, so no pytree node type has to
round-trip through orbax). Restores go into abstract targets, so shapes and dtypes (and
shardings, where given) are exact.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx


def to_saveable(params, opt_state, *, rng, step: int, extra: dict | None = None) -> dict:
    tree = {"params": nnx.to_pure_dict(params), "opt_state": jax.tree.leaves(opt_state),
            "rng": jax.random.key_data(rng), "step": np.asarray(step, np.int64)}
    for k, v in (extra or {}).items():
        tree[k] = np.asarray(v)
    return tree


def from_saveable(tree: dict, params_template, opt_template):
    """(params, opt_state, rng, step, extra) from a restored tree."""
    params = _replace_pure(params_template, tree["params"])
    opt_state = jax.tree.unflatten(jax.tree.structure(opt_template), tree["opt_state"])
    rng = jax.random.wrap_key_data(tree["rng"])
    extra = {k: v for k, v in tree.items() if k not in ("params", "opt_state", "rng", "step")}
    return params, opt_state, rng, int(tree["step"]), extra


def _replace_pure(state_template, pure):
    state = jax.tree.map(lambda x: x, state_template)
    nnx.replace_by_pure_dict(state, pure)
    return state


class Checkpointer:
    """Keeps the last `keep` checkpoints of one phase under <workdir>/<name>."""

    def __init__(self, workdir: str, name: str, keep: int = 3):
        self.directory = os.path.abspath(os.path.join(workdir, name))
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, tree: dict, force: bool = False) -> None:
        if step in self.manager.all_steps():
            return  # already saved (e.g. the periodic save of the final step)
        self.manager.save(step, args=ocp.args.StandardSave(tree), force=force)

    def restore(self, step: int, template: dict) -> dict:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
