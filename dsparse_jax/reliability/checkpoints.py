"""Orbax checkpoints of the training state: params, optimizer state, step, RNG, data position.

Params are saved as nnx pure dicts; optimizer states as their flat leaf lists (their tree
structure is rebuilt from a freshly initialised optimizer, so no pytree node type has to
round-trip through orbax). Restores go into abstract targets, so shapes and dtypes (and
shardings, where given) are exact.

Integrity (docs/reliability.md): a save refuses non-finite values and stores a digest of
every leaf (`integrity`: wrapping uint32 sums of the leaf's words, plain and position
weighted); a restore checks the digest and finiteness. `restore_latest` walks back from the
newest step past unreadable or corrupt checkpoints, moving them to <name>.corrupt/.
Orbax writes a step into a temporary directory and renames it when complete, so a write
cut short by a kill never shows up as a step.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from dsparse_jax.parallel import sharding

INTEGRITY = "integrity"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: corrupt, unreadable or with non-finite values."""


class IncompatibleCheckpoint(ValueError):
    """A readable checkpoint whose tree does not match this run's state (another config)."""


def rng_and_step(rng, step: int) -> dict:
    """The checkpoint fields every training state carries: its RNG key's data and step."""
    return {"rng": jax.random.key_data(rng), "step": np.asarray(step, np.int64)}


def read_rng_and_step(tree: dict):
    """(rng, step) of a restored tree (the fields of rng_and_step)."""
    return jax.random.wrap_key_data(tree["rng"]), int(tree["step"])


def to_saveable(params, opt_state, *, rng, step: int, extra: dict | None = None) -> dict:
    tree = {
        "params": nnx.to_pure_dict(params),
        "opt_state": jax.tree.leaves(opt_state),
        **rng_and_step(rng, step),
    }
    for k, v in (extra or {}).items():
        tree[k] = v if isinstance(v, (list, dict)) else np.asarray(v)
    return tree


def from_saveable(tree: dict, params_template, opt_template):
    """(params, opt_state, rng, step, extra) from a restored tree."""
    params = from_pure_dict(params_template, tree["params"])
    opt_state = jax.tree.unflatten(jax.tree.structure(opt_template), tree["opt_state"])
    rng, step = read_rng_and_step(tree)
    extra = {
        k: v for k, v in tree.items() if k not in ("params", "opt_state", "rng", "step", INTEGRITY)
    }
    return params, opt_state, rng, step, extra


def from_pure_dict(state_template, pure):
    """A copy of an nnx State template with the values of its pure dict (nnx.to_pure_dict)."""
    state = jax.tree.map(lambda x: x, state_template)
    nnx.replace_by_pure_dict(state, pure)
    return state


# ------------------------------------------------------------------------------- integrity
def _host_digest(x) -> tuple[np.ndarray, bool]:
    """([sum of words, sum of words * (i + 1)] mod 2**32, all finite) of one leaf."""
    x = np.ascontiguousarray(np.asarray(x))
    finite = bool(np.isfinite(x).all()) if jnp.issubdtype(x.dtype, jnp.floating) else True
    if x.dtype.itemsize % 4 == 0:
        w = x.reshape(-1).view(np.uint32)
    else:
        w = x.reshape(-1).view(np.dtype(f"uint{8 * x.dtype.itemsize}")).astype(np.uint32)
    i = np.arange(1, w.size + 1, dtype=np.uint64).astype(np.uint32)
    return np.array([w.sum(dtype=np.uint32), (w * i).sum(dtype=np.uint32)], np.uint32), finite


@jax.jit
def _device_digests(leaves):
    """_host_digest of each 1/2/4-byte device leaf, computed where the leaf lives."""
    out, fin = [], []
    for x in leaves:
        size = x.dtype.itemsize
        if x.dtype == jnp.bool_:
            w = x.astype(jnp.uint32)
        else:
            w = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * size}")).astype(jnp.uint32)
        w = w.reshape(-1)
        i = jax.lax.iota(jnp.uint32, w.size) + jnp.uint32(1)
        out.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * i, dtype=jnp.uint32)]))
        fin.append(
            jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.bool_(True)
        )
    return out, fin


def digest(tree: dict) -> tuple[np.ndarray, list[str]]:
    """(uint32 [leaves, 2] digest, paths of leaves holding a non-finite value)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    dev = [i for i, (_, x) in enumerate(flat) if isinstance(x, jax.Array) and x.dtype.itemsize <= 4]
    sums, fins = jax.device_get(_device_digests([flat[i][1] for i in dev])) if dev else ([], [])
    rows, finite = [None] * len(flat), [True] * len(flat)
    for i, s, f in zip(dev, sums, fins):
        rows[i], finite[i] = np.asarray(s, np.uint32), bool(f)
    for i, (_, x) in enumerate(flat):
        if rows[i] is None:
            rows[i], finite[i] = _host_digest(x)
    bad = [jax.tree_util.keystr(p) for (p, _), ok in zip(flat, finite) if not ok]
    return np.stack(rows) if rows else np.zeros((0, 2), np.uint32), bad


def _signature(tree) -> list[tuple[str, tuple, str]]:
    """Sorted (path, shape, dtype) of every leaf, keys as strings: template vs metadata."""

    def key(k):
        return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))

    def shape_dtype(x):
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            return tuple(x.shape), str(np.dtype(x.dtype))
        x = np.asarray(x)
        return x.shape, str(x.dtype)

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return sorted(("/".join(key(k) for k in p), *shape_dtype(x)) for p, x in flat)


class Checkpointer:
    """Keeps the last `keep` checkpoints of one phase under <workdir>/<name>."""

    def __init__(self, workdir: str, name: str, keep: int = 3):
        self.directory = os.path.abspath(os.path.join(workdir, name))
        self.quarantine = self.directory + ".corrupt"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_handlers=ocp.StandardCheckpointHandler(),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, tree: dict, force: bool = False) -> None:
        """Saves asynchronously (the arrays are copied first, so the caller may donate
        them). Raises CheckpointError, writing nothing, if any value is non-finite."""
        if step in self.manager.all_steps():
            return  # already saved (e.g. the periodic save of the final step)
        fp, bad = digest(tree)
        if bad:
            raise CheckpointError(
                f"refusing to save step {step} to {self.directory}: "
                f"non-finite values in {', '.join(bad[:5])}"
            )
        tree = dict(tree, **{INTEGRITY: fp})
        tree = sharding.host_local_to_global(tree)  # multi-host: orbax saves global arrays
        self.manager.save(step, args=ocp.args.StandardSave(tree), force=force)

    def restore(self, step: int, template: dict, optional: tuple[str, ...] = ()) -> dict:
        """The checkpoint at `step`, verified. IncompatibleCheckpoint if its tree differs
        from the template's (top-level `optional` keys may be absent: older checkpoints);
        CheckpointError if it is unreadable, fails its digest or holds non-finite values."""
        try:
            meta = self.manager.item_metadata(step)
            stored = dict(meta.tree if hasattr(meta, "tree") else meta)
        except Exception as e:  # noqa: BLE001 -- any failure to read it is corruption
            raise CheckpointError(f"unreadable metadata ({type(e).__name__}: {e})") from e
        has_fp = INTEGRITY in stored
        stored.pop(INTEGRITY, None)
        template = {k: v for k, v in template.items() if k in stored or k not in optional}
        want, got = _signature(template), _signature(stored)
        if want != got:
            diff = sorted(set(want) ^ set(got))[:3]
            raise IncompatibleCheckpoint(
                f"checkpoint tree differs from this run's state (e.g. {diff})"
            )
        target = dict(template)
        if has_fp:
            target[INTEGRITY] = np.zeros((len(jax.tree.leaves(template)), 2), np.uint32)
        abstract = sharding.global_targets(jax.tree.map(ocp.utils.to_shape_dtype_struct, target))
        try:
            tree = dict(self.manager.restore(step, args=ocp.args.StandardRestore(abstract)))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"unreadable data ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            ) from e
        stored_fp = tree.pop(INTEGRITY, None)
        fp, bad = digest(tree)
        if stored_fp is not None and not np.array_equal(np.asarray(stored_fp), fp):
            rows = np.nonzero((np.asarray(stored_fp) != fp).any(1))[0]
            paths = [
                jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
            ]
            raise CheckpointError("digest mismatch in " + ", ".join(paths[r] for r in rows[:5]))
        if bad:
            raise CheckpointError(f"non-finite values in {', '.join(bad[:5])}")
        return tree

    def restore_latest(
        self, template: dict, optional: tuple[str, ...] = ()
    ) -> tuple[int, dict] | None:
        """(step, tree) of the newest usable checkpoint, or None if there is none.

        An unreadable or corrupt one is reported, moved to <name>.corrupt/ and the one
        before it tried. Raises CheckpointError if checkpoints exist (or were moved away
        earlier) but none is usable: starting over silently would lose the run."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                return step, self.restore(step, template, optional)
            except CheckpointError as e:
                dest = self._move_aside(step)
                print(
                    f"[ckpt] WARNING: checkpoint {self.directory}/{step} is corrupt ({e}); "
                    f"moved to {dest}; trying the previous one",
                    flush=True,
                )
        if os.path.isdir(self.quarantine) and os.listdir(self.quarantine):
            raise CheckpointError(
                f"no usable checkpoint in {self.directory}; corrupt ones are in "
                f"{self.quarantine}. Delete that directory to start this phase over."
            )
        return None

    def _move_aside(self, step: int) -> str:
        os.makedirs(self.quarantine, exist_ok=True)
        dest = os.path.join(self.quarantine, f"{step}-{int(time.time())}")
        try:
            shutil.move(os.path.join(self.directory, str(step)), dest)
        except FileNotFoundError:  # another process (multi-host) moved it first
            dest = self.quarantine
        self.manager.reload()
        return dest

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
