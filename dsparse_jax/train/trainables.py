"""What an RL step trains: one table.

theta, phi, the rollout quality head and the learned draft head are each a row of
TRAINABLES: how a run makes it (parameters, optimizer state and the optax transform, a
`Trainable`) and the checkpoint keys it is saved under. A TrainState holds the entries a
run has, and the history drafter's bank. Making it, placing it on the mesh, saving it and
restoring it are each one loop over the table; an optional entry that a checkpoint lacks
(written before the entry existed) restores as initialised.

Adding a trainable: a TrainState field and a row here with its init; its update phase
and the phase's call in rl_step (train/phases.py); its settings, if it has any beyond its
optimizer, in RLSetup (train/rl_state.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
from flax import nnx

from dsparse_jax.model import draft_head, quality_head
from dsparse_jax.model.lora import init_lora
from dsparse_jax.reliability import checkpoints
from dsparse_jax.sampling.history import HistoryBank
from dsparse_jax.train import draft_head as draft_head_train
from dsparse_jax.train import quality
from dsparse_jax.train.context import RunContext
from dsparse_jax.train.rl_state import RLSetup, optimizer_from, optimizer_steps_per_rl_step, place


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trainable:
    """Parameters, their optimizer state and the transform that updates them (static: the
    update phases pass it to their jitted steps)."""

    params: Any
    opt_state: Any  # None where the run applies the parameters but never trains them
    tx: Any = dataclasses.field(default=None, metadata=dict(static=True))

    def replace(self, params, opt_state) -> Trainable:
        return dataclasses.replace(self, params=params, opt_state=opt_state)


@dataclasses.dataclass
class TrainState:
    """What a run carries from step to step: its entries of TRAINABLES (None: not in this
    run) and, with rl.draft=history, the bank of earlier rollouts (sampling/history.py)."""

    theta: Trainable
    phi: Trainable | None = None  # the actor's LoRA adapter (mode.actor_lora)
    quality_head: Trainable | None = None  # rl.prune (model/quality_head.py)
    draft_head: Trainable | None = None  # rl.draft=draft_head (model/draft_head.py)
    history: HistoryBank | None = None

    @property
    def lora(self):
        """phi's parameters, as the actor applies them (None: no adapter)."""
        return None if self.phi is None else self.phi.params


# ------------------------------------------------------------------------------- the table
# Each init returns (initial parameters, transform), or None where the run has no such
# entry; init_state places the parameters and makes the optimizer state from them.
def _theta(ctx: RunContext, setup: RLSetup, params):
    c = ctx.config.rl
    return params, optimizer_from(c, optimizer_steps_per_rl_step(c)["theta"], c.num_steps)


def _phi(ctx: RunContext, setup: RLSetup, params):
    """Where the actor applies phi; with an optimizer where the mode trains it."""
    if not setup.mode.actor_lora:
        return None
    lora = init_lora(ctx.model_cfg, ctx.lora_cfg, jax.random.key(ctx.config.seed + 3))
    if not setup.mode.updates_phi:
        return lora, None
    c = ctx.config.rl
    return lora, optimizer_from(ctx.config.lora, optimizer_steps_per_rl_step(c)["phi"], c.num_steps)


def _quality_head(ctx: RunContext, setup: RLSetup, params):
    if setup.pruning is None:
        return None
    head = quality_head.init_quality_head(setup.pruning.head, jax.random.key(ctx.config.seed + 4))
    return head, quality.make_tx(ctx.config.rl.prune.head_learning_rate)


def _draft_head(ctx: RunContext, setup: RLSetup, params):
    if setup.drafting is None or setup.drafting.head is None:
        return None
    h = ctx.config.rl.draft_head
    head_cfg = draft_head.DraftHeadConfig(setup.drafting.head.layers)
    _, state = draft_head.create(ctx.model_cfg, head_cfg, jax.random.key(ctx.config.seed + 5))
    return state, draft_head_train.make_tx(h.learning_rate, h.max_grad_norm)


class Entry(NamedTuple):
    """A row of TRAINABLES."""

    name: str  # its TrainState field
    params_key: str  # the checkpoint keys of its parameters
    opt_key: str  # and of its optimizer state
    init: Callable  # (ctx, setup, theta's initial params) -> (params, tx) | None (not in run)
    optional: bool = False  # may be absent from a checkpoint (written before it existed)
    saved_as: str = "leaves"  # a key of SAVED_AS


TRAINABLES = (
    Entry("theta", "params", "opt_state", _theta, saved_as="pure_dict"),
    Entry("phi", "lora", "lora_opt_state", _phi),
    Entry("quality_head", "quality_head", "quality_head_opt_state", _quality_head, optional=True),
    Entry("draft_head", "draft_head", "draft_head_opt_state", _draft_head, optional=True),
)


def _from_leaves(template, leaves):
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


# How parameters are written, and read back into a template's structure: nnx's pure dict
# (theta: paths by name) or the flat leaf list (int-keyed dicts stay out of orbax).
# Optimizer states are always leaf lists.
SAVED_AS = {
    "pure_dict": (nnx.to_pure_dict, checkpoints.from_pure_dict),
    "leaves": (jax.tree.leaves, _from_leaves),
}

# Checkpoint keys a restore may miss: the optional entries' and the bank's (a run resumed
# with rl.draft=history from a checkpoint without one starts with an empty bank).
OPTIONAL_KEYS = tuple(k for e in TRAINABLES if e.optional for k in (e.params_key, e.opt_key)) + (
    "history",
)


# ----------------------------------------------------------------------- the loops over it
def init_state(ctx: RunContext, setup: RLSetup, params) -> TrainState:
    """A fresh state, on the mesh (rl_state.place): theta from `params`, every other entry
    the run has; each optimizer state is made from the placed parameters."""
    entries = {}
    for e in TRAINABLES:
        made = e.init(ctx, setup, params)
        if made is not None:
            p, tx = made
            p = place(setup, p)
            opt_state = None if tx is None else place(setup, tx.init(p))
            entries[e.name] = Trainable(p, opt_state, tx)
    st = TrainState(**entries)
    if setup.drafting is not None and setup.drafting.history_size is not None:
        st.history = HistoryBank(*setup.drafting.history_size)
    return st


def to_tree(st: TrainState) -> dict:
    """The checkpoint tree of `st`: every entry under its keys, and the bank. With several
    processes each holds its own bank (the prompts it makes), which a checkpoint of
    replicated host arrays cannot keep apart: it is left out, and a resumed run rebuilds
    it from its next rollouts (the drafts only change speed, never the samples)."""
    tree = {}
    for e in TRAINABLES:
        t = getattr(st, e.name)
        if t is not None:
            tree[e.params_key] = SAVED_AS[e.saved_as][0](t.params)
            tree[e.opt_key] = jax.tree.leaves(t.opt_state)
    if st.history is not None and jax.process_count() == 1:
        tree["history"] = st.history.state()
    return tree


def from_tree(tree: dict, template: TrainState) -> TrainState:
    """The state in a restored checkpoint tree, in the template's structures; an entry (or
    the bank) the tree lacks stays as in the template. The template's bank is loaded in
    place."""
    st = dataclasses.replace(template)
    for e in TRAINABLES:
        t = getattr(template, e.name)
        if t is not None and e.params_key in tree:
            params = SAVED_AS[e.saved_as][1](t.params, tree[e.params_key])
            setattr(st, e.name, t.replace(params, _from_leaves(t.opt_state, tree[e.opt_key])))
    if st.history is not None and "history" in tree:
        st.history.load(tree["history"])
    return st
