"""One device mesh (data, fsdp, tensor) and the partition rules of every array of the RL step.

Every phase (rollout, dense recompute, theta update, phi update) is a jax.jit program over
the same mesh. The state lives on the mesh as NamedSharding arrays (placed once by
`MeshPlan.shard_state`; never copied through the host); the jitted functions take them as
sharded inputs and pin their outputs to the same rules with `with_sharding_constraint`
(the `constrain_*` helpers below, no-ops when no mesh is active), so donated buffers are
reused and the next phase gets exactly the layout it expects. Rules (docs/scaling.md):

  array                       shape            partition spec
  embed, lm_head (untied)     [V, D]           (tensor, fsdp)
  attn q_bias / k_bias / v_bias [N|K, H]       (tensor, -)          (Qwen2)
  attn q / k / v              [D, N|K, H]      (fsdp, tensor, -)
  attn o                      [N, H, D]        (tensor, -, fsdp)
  mlp gate / up               [D, F]           (fsdp, tensor)
  mlp down                    [F, D]           (tensor, fsdp)
  norm scales                 [D] / [H]        replicated
  LoRA a (in..., r)           follows W's input dims, rank replicated
  LoRA b (r, out...)          follows W's output dims, rank replicated
  optimizer states (both)     follow the leaf of params / LoRA they mirror; counts replicated
  rollout / train batch       [B, ...]         (data x fsdp, ...)
  KV cache, page summaries    [B, K, S|P, H]   (data x fsdp, tensor, -, -)

A dimension that the assigned axes do not divide stays replicated (e.g. 1 KV head on a
tensor axis of 2: GQA keys and values are then replicated over tensor, as usual).
The mesh uses Auto axis types: with jax 0.10, Explicit axes break the embedding gather.

Multi-host placement rule: the devices of the mesh are ordered so that every process owns
one contiguous block of batch shards (tensor is innermost and must divide the local
device count). Process p generates prompts [p * P / procs, (p + 1) * P / procs) of a step;
the sampler keeps a prompt's M samples contiguous, so each GRPO group is generated on the
host that owns its prompt. Rewards are graded on that host from its local rows and
all-gathered (P * M floats), so filtering, advantages and the minibatch order are computed
identically on every host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the batch dimension is split over both
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")

# Per weight name: the mesh axis of each dimension (None: replicated).
WEIGHT_RULES = {
    "embed": ("tensor", "fsdp"),
    "lm_head": ("tensor", "fsdp"),  # an untied output head, as the embedding
    "q_bias": ("tensor", None),  # biases follow their projection's output dims
    "k_bias": ("tensor", None),
    "v_bias": ("tensor", None),
    "q": ("fsdp", "tensor", None),
    "k": ("fsdp", "tensor", None),
    "v": ("fsdp", "tensor", None),
    "o": ("tensor", None, "fsdp"),
    "gate": ("fsdp", "tensor"),
    "up": ("fsdp", "tensor"),
    "down": ("tensor", "fsdp"),
}
N_IN = {"o": 2}  # input dims of each linear map (LoRA a covers them); others: 1


# ------------------------------------------------------------------------------------ mesh
def mesh_shape(section, num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) from config.mesh; data = -1 takes all remaining devices. The
    product must be the device count, or 1 (the single-device path, whatever the count)."""
    d = int(section.get("data", 1)) if section is not None else 1
    f = int(section.get("fsdp", 1)) if section is not None else 1
    t = int(section.get("tensor", 1)) if section is not None else 1
    if f < 1 or t < 1 or d == 0 or d < -1:
        raise ValueError(f"config.mesh: fsdp, tensor >= 1 and data >= 1 or -1, got ({d}, {f}, {t})")
    if d == -1:
        if num_devices % (f * t):
            raise ValueError(
                f"config.mesh: {num_devices} devices are not divisible by fsdp x tensor = {f * t}"
            )
        d = num_devices // (f * t)
    if d * f * t != num_devices and d * f * t != 1:  # 1 x 1 x 1: one device, unsharded
        raise ValueError(
            f"config.mesh: data x fsdp x tensor = {d} x {f} x {t} = {d * f * t} "
            f"but there are {num_devices} devices"
        )
    return d, f, t


def _process_major(devices):
    return sorted(devices, key=lambda dv: (dv.process_index, dv.id))


def make_mesh(shape: tuple[int, int, int], devices=None) -> Mesh:
    """A (data, fsdp, tensor) mesh with Auto axes. Several processes: devices ordered so
    that each process owns a contiguous block of batch shards (the placement rule)."""
    devices = list(jax.devices() if devices is None else devices)
    auto = (AxisType.Auto,) * 3
    if len({dv.process_index for dv in devices}) == 1:
        return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    mesh = jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)
    if not _blocks_ok(mesh):  # fall back to a process-major order
        arr = np.array(_process_major(devices), dtype=object).reshape(shape)
        mesh = Mesh(arr, AXES, axis_types=auto)
    if not _blocks_ok(mesh):
        raise ValueError(
            f"mesh {shape}: each process must own whole tensor groups "
            "(tensor must divide the local device count)"
        )
    return mesh


def _batch_owner(mesh) -> np.ndarray:
    """Process index of every batch shard, or -1 where a tensor group spans processes."""
    procs = np.vectorize(lambda dv: dv.process_index)(mesh.devices)
    procs = procs.reshape(-1, procs.shape[-1])  # [batch shards, tensor]
    return np.where((procs == procs[:, :1]).all(1), procs[:, 0], -1)


def _blocks_ok(mesh) -> bool:
    owner = _batch_owner(mesh)
    if (owner < 0).any():
        return False
    n = len(set(owner.tolist()))
    per = owner.size // n
    return owner.size % n == 0 and all(
        len(set(owner[i * per : (i + 1) * per])) == 1 for i in range(n)
    )


# ----------------------------------------------------------------------------------- rules
def _axis_size(mesh, axis) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[a] for a in names)


def fit(mesh, axes, shape) -> P:
    """PartitionSpec with every axis whose size does not divide its dimension dropped."""
    axes = tuple(axes)[: len(shape)]
    out = [
        a if a is not None and dim % _axis_size(mesh, a) == 0 and _axis_size(mesh, a) > 1 else None
        for a, dim in zip(axes, shape)
    ]
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _names(path) -> list[str]:
    return [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str)]


def leaf_axes(path, ndim: int) -> tuple:
    """The rule's axes of one leaf of params, the LoRA tree or an optimizer state mirroring
    them, found from the names on its path ((): replicated)."""
    names = _names(path)
    if not names:
        return ()
    last = names[-1]
    if last in ("a", "b") and len(names) >= 2 and names[-2] in LINEAR_NAMES:
        w = WEIGHT_RULES[names[-2]]
        n_in = N_IN.get(names[-2], 1)
        return w[:n_in] + (None,) if last == "a" else (None,) + w[n_in:]
    rule = WEIGHT_RULES.get(last, ())
    return rule if len(rule) == ndim else ()


def state_specs(tree, mesh):
    """PartitionSpecs of params, a LoRA tree or an optimizer state (same tree structure)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: fit(mesh, leaf_axes(p, np.ndim(x)), np.shape(x)), tree
    )


def batch_spec(mesh, shape) -> P:
    """[B, ...] arrays: B over data x fsdp (replicated if it does not divide)."""
    return fit(mesh, (BATCH,), shape)


def cache_spec(mesh, shape) -> P:
    """KV cache and page summaries [B, K, S|P, H]: batch over data x fsdp, heads over tensor."""
    return fit(mesh, (BATCH, "tensor"), shape)


# -------------------------------------------- constraints inside jit (no-ops without a mesh)
def active_mesh():
    """The mesh set with jax.set_mesh (abstract inside jit), or None."""
    m = jax.sharding.get_abstract_mesh()
    return None if m is None or m.empty or math.prod(m.shape.values()) == 1 else m


def _constrain(tree, spec_fn):
    mesh = active_mesh()
    if mesh is None:
        return tree
    specs = spec_fn(tree, mesh)
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(x, s), tree, specs)


def constrain_state(tree):
    """Pins params / LoRA / optimizer-state outputs to their rules."""
    return _constrain(tree, state_specs)


def constrain_batch(tree):
    """Pins [B, ...] arrays to batch over data x fsdp."""
    return _constrain(tree, lambda t, m: jax.tree.map(lambda x: batch_spec(m, x.shape), t))


def constrain_cache(caches):
    """Pins the KV cache (a list of per-layer dicts) to batch x KV heads."""
    return _constrain(caches, lambda t, m: jax.tree.map(lambda x: cache_spec(m, x.shape), t))


def constrain_update(out):
    """(wrt, opt_state, metrics) of an optimizer step: state pinned, metrics replicated."""
    wrt, opt_state, metrics = out
    metrics = _constrain(metrics, lambda t, m: jax.tree.map(lambda x: P(), t))
    return constrain_state(wrt), constrain_state(opt_state), metrics


# ------------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True, eq=False)
class MeshPlan:
    """The run's mesh and how host data and state are placed on it."""

    mesh: Mesh

    @property
    def batch_shards(self) -> int:
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    @property
    def multiprocess(self) -> bool:
        return jax.process_count() > 1

    def active(self):
        """Context manager: jitted functions traced inside see this mesh."""
        return jax.set_mesh(self.mesh)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # -- state
    def state_shardings(self, tree):
        return jax.tree.map(lambda x, s: self.sharding(s), tree, state_specs(tree, self.mesh))

    def shard_state(self, tree):
        """Places params / LoRA / an optimizer state on the mesh by the rules."""
        if tree is None:
            return None
        return jax.tree.map(self.put, tree, self.state_shardings(tree))

    def put(self, x, sh: NamedSharding):
        """x onto the mesh with sharding sh: a global array is resharded on device; a
        host or single-device value (the same on every process) is split from the host."""
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(self.put(jax.random.key_data(x), sh))
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sh)  # global: resharded device to device
        if not self.multiprocess:
            return jax.device_put(x, sh)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])

    def replicate(self, x):
        """A value every process holds identically (e.g. the RNG key), replicated."""
        return self.put(x, self.sharding(P()))

    # -- batches
    def check_batch(self, rows: int, what: str) -> None:
        if rows % self.batch_shards:
            raise ValueError(
                f"{what} = {rows} rows is not divisible by the mesh's batch "
                f"shards data x fsdp = {self.batch_shards} "
                f"(mesh {dict(self.mesh.shape)})"
            )

    def shard_batch(self, tree):
        """[B, ...] arrays (global values, the same on every process) -> batch-sharded."""
        return jax.tree.map(
            lambda x: self.put(x, self.sharding(batch_spec(self.mesh, np.shape(x)))), tree
        )

    def take_rows(self, tree, rows):
        """tree of [B, ...] arrays -> their rows `rows` (numpy, the same on every
        process), gathered on the mesh and batch-sharded."""
        rows = np.asarray(rows, np.int32)
        out = jax.tree.map(
            lambda x: self.sharding(batch_spec(self.mesh, (len(rows),) + tuple(x.shape[1:]))), tree
        )
        return _take(tree, self.replicate(rows), out)

    def global_batch(self, local_rows):
        """This process's rows (numpy) -> one global batch-sharded array (placement rule)."""
        local_rows = np.asarray(local_rows)
        if not self.multiprocess:
            return self.shard_batch(local_rows)
        shape = (local_rows.shape[0] * jax.process_count(),) + local_rows.shape[1:]
        return jax.make_array_from_process_local_data(
            self.sharding(batch_spec(self.mesh, shape)), local_rows, shape
        )

    def local_slice(self, rows: int) -> slice:
        """This process's block of a global batch of `rows` (the placement rule)."""
        n, p = jax.process_count(), jax.process_index()
        if rows % n:
            raise ValueError(f"{rows} rows not divisible by {n} processes")
        return slice(p * rows // n, (p + 1) * rows // n)

    def local_rows(self, x) -> np.ndarray:
        """This process's rows of a batch-sharded global array, as numpy."""
        if not self.multiprocess:
            return np.asarray(x)
        return np.asarray(
            multihost_utils.global_array_to_host_local_array(
                x, self.mesh, batch_spec(self.mesh, x.shape)
            )
        )

    def local_rollout(self, rollout):
        """This process's rows of a Rollout's [B, ...] arrays, as numpy (for grading)."""
        return rollout.replace(
            tokens=self.local_rows(rollout.tokens),
            prompt_lengths=self.local_rows(rollout.prompt_lengths),
            completion_lengths=self.local_rows(rollout.completion_lengths),
            completion_mask=self.local_rows(rollout.completion_mask),
            logprobs=self.local_rows(rollout.logprobs),
            page_ids={},
            top_logprobs=None,
        )

    def gather_rows(self, local) -> np.ndarray:
        """Every process's rows (in process order), on every process."""
        local = np.asarray(local)
        if not self.multiprocess:
            return local
        return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def _take(tree, rows, out_shardings):
    return _take_jit(out_shardings)(tree, rows)


@functools.lru_cache(maxsize=None)
def _take_jit_cached(out_treedef, out_leaves):
    out = jax.tree.unflatten(out_treedef, out_leaves)
    return jax.jit(lambda t, r: jax.tree.map(lambda x: x[r], t), out_shardings=out)


def _take_jit(out_shardings):
    leaves, treedef = jax.tree.flatten(out_shardings)
    return _take_jit_cached(treedef, tuple(leaves))


def to_host(x) -> np.ndarray:
    """numpy of a jax array on any number of processes (all-gathers a non-addressable one)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _everywhere() -> NamedSharding:
    """Replicated over every device of every process."""
    return NamedSharding(Mesh(np.array(jax.devices()), ("all",)), P())


def host_local_to_global(tree):
    """Several processes: host-local jax arrays (each process's identical copy, e.g. the
    unsharded SFT state or a step counter) -> replicated global arrays, which orbax can
    save from all hosts. Unchanged on one process."""
    if jax.process_count() == 1:
        return tree

    def conv(x):
        if not (isinstance(x, jax.Array) and x.is_fully_addressable):
            return x
        v = np.asarray(x)
        return jax.make_array_from_callback(v.shape, _everywhere(), lambda idx: v[idx])

    return jax.tree.map(conv, tree)


def global_targets(abstract):
    """Several processes: restore targets that live on one local device -> replicated
    over all devices (orbax restores global arrays only). Unchanged on one process."""
    if jax.process_count() == 1:
        return abstract

    def conv(a):
        sh = getattr(a, "sharding", None)
        if isinstance(a, jax.ShapeDtypeStruct) and sh is not None and sh.is_fully_addressable:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_everywhere())
        return a

    return jax.tree.map(conv, abstract)


def plan_from_config(config) -> MeshPlan | None:
    """The run's MeshPlan, or None for one device (the unsharded single-device path)."""
    section = config.get("mesh", None)
    shape = mesh_shape(section, jax.device_count())
    if math.prod(shape) == 1:
        return None
    return MeshPlan(make_mesh(shape))


def check_rl_batches(plan: MeshPlan | None, rl) -> None:
    """Clear errors for RL batch sizes the mesh cannot split evenly."""
    if plan is None:
        return
    procs = jax.process_count()
    p, n = rl.prompts_per_step, rl.samples_per_prompt
    m = rl.samples_generated or n
    if p % procs:
        raise ValueError(
            f"config.rl.prompts_per_step = {p} is not divisible by the "
            f"{procs} processes (each host generates P / processes prompts)"
        )
    plan.check_batch(p, "config.rl.prompts_per_step")
    plan.check_batch(p * m, "the rollout batch prompts_per_step x samples_generated")
    plan.check_batch(
        p * n // rl.minibatches,
        "a minibatch (prompts_per_step x samples_per_prompt / rl.minibatches)",
    )


@contextlib.contextmanager
def maybe_active(plan: MeshPlan | None):
    """plan.active() or nothing."""
    if plan is None:
        yield
    else:
        with plan.active():
            yield


def as_global(plan: MeshPlan | None, x):
    """A value every process computed identically (e.g. advantages from all-gathered
    rewards) as a batch-sharded array on the mesh; unchanged without a plan."""
    return x if plan is None else plan.shard_batch(x)


__all__ = [
    "AXES",
    "BATCH",
    "MeshPlan",
    "make_mesh",
    "mesh_shape",
    "plan_from_config",
    "state_specs",
    "batch_spec",
    "cache_spec",
    "constrain_state",
    "constrain_batch",
    "constrain_cache",
    "constrain_update",
    "to_host",
    "check_rl_batches",
    "maybe_active",
    "as_global",
]
