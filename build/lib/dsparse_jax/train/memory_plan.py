"""Device memory: what one device holds during an RL step, estimated before anything
compiles, and the rollout's chunk size.

Per device, in bytes (`Estimate`):
  params       theta: every leaf of the model's state (abstract: `abstract_params`),
               split by its rule in parallel/sharding.py on the mesh
  optimizer    theta's optimizer state (tx.init traced abstractly), split the same way
  phi          the LoRA tree and its optimizer state (modes that apply / train phi)
  outputs      the rollout's outputs of every row (tokens, log-probs, mask, page record)
  kv_chunk     the KV cache (with page summaries) of one chunk of rollout rows
  chunk_work   the chunk's carried record and its prefill and decode temporaries
  activations  what theta's update keeps for its backward pass, one microbatch
  phi_activations  the same for phi's update (the actor's twin on the recorded pages)
Rows are split over the batch axes data x fsdp, KV heads over tensor where they divide
(the rules of sharding.py); a leaf whose rule does not divide stays whole on every device.

Each jitted program is estimated as XLA:CPU lays it out (the copy counts below were read
off its buffer assignment; tests/test_memory_plan.py checks both programs against
`compiled.memory_analysis()` at two sizes, within 20%):
  rollout  params (+ phi, and theta + phi merged when the compute dtype is f32) + the
           outputs of all rows + one chunk's KV cache, carried record and temporaries
  update   params + optimizer state + the minibatch + 2x params (the microbatch gradient
           and its accumulator) + 2x the largest leaf (the optimizer's temporaries) +
           the activations of one microbatch
The phases' peaks add what stays resident around the program: the rollout phase the
optimizer states; the update phases the rollout's outputs of all M rows and the kept n
rows' copy. The activations are the XLA path's (dense attention keeps its [T, T] scores
per layer for the backward pass; no rematerialisation), an upper bound for the kernels.

The rollout runs in sequential chunks of whole prompts (Sampler's `chunks`): `plan`
takes `rl.rollout_chunk_rows`, or the largest chunk whose rollout phase fits the
device's memory (`device_memory`) with HEADROOM to spare, and raises a one-line
UserError naming the config field to change when none does. Speculative and pruned
rollouts are not chunked (their draws span the batch): their whole batch must fit
(estimated as a plain rollout: the drafter's own state is not counted, nor are the
quality and draft heads). The update's estimate is a warning only (XLA on GPU / TPU
fuses more than on CPU).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention.dense import CAUSAL_BLOCK
from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.errors import UserError
from dsparse_jax.model import lora as lora_lib
from dsparse_jax.model.config import ModelConfig
from dsparse_jax.model.transformer import Transformer, layer_info
from dsparse_jax.parallel import sharding
from dsparse_jax.sampling.sampler import buffer_schedule
from dsparse_jax.train.rl_state import optimizer_from, optimizer_steps_per_rl_step

GB = 1e9
F32 = 4
HEADROOM = 0.9  # the plan fills at most this fraction of a device's memory

# f32 copies per token XLA:CPU keeps for theta's backward pass (buffer assignment of the
# compiled update, jax 0.10.2): per layer, of d_model, mlp_dim, the query heads' and the
# KV heads' head_dim vectors, and per key scored (attention path of dense.py); at the
# head, of the vocabulary and d_model; a soft-cap keeps one more of what it caps (its
# tanh). bf16 compute keeps about as much (0.93x).
LAYER_COPIES = {"d_model": 5.0, "mlp": 6.0, "q_heads": 4.0, "kv_heads": 4.0}
SCORE_COPIES = {"full": 3.0, "blocked": 2.25, "banded": 3.0, "gathered": 3.0}
HEAD_COPIES = {"vocab": 3.7, "d_model": 8.0}
# The rollout's temporaries per row and step: logits-sized f32 vectors of the sampler
# (logits, scaled log-probs, the draw), and per prompt token of the prefill the f32
# vectors of one layer at a time.
DECODE_LOGIT_COPIES = 3.0
PREFILL_COPIES = {"d_model": 4.0, "mlp": 3.0, "q_heads": 2.0, "kv_heads": 2.0, "scores": 2.0}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the plan reads from a run (plain data; `settings_of` builds it from a run)."""

    model: ModelConfig
    prompts: int  # P per RL step
    samples: int  # M rows generated per prompt (the rollout has P x M rows)
    kept: int  # n rows kept per prompt (the updates' batch: P x n)
    prompt_width: int  # L, the prompt buffer
    max_new_tokens: int
    page_size: int = 16
    sparse: SparseSpec | None = None  # the actor's block-sparse decode (None: dense)
    trainer_sparse: bool = False  # theta's trainer reads the rollout's pages (sparse_train)
    lora: lora_lib.LoRAConfig | None = None  # phi in the actor (None: no adapter)
    phi_trained: bool = False
    phi_row_stride: int = 1
    minibatches: int = 1
    microbatches: int = 1
    grow_buffer_from: int = 0
    top_logprobs: int = 0
    mesh: tuple[int, int, int] = (1, 1, 1)  # (data, fsdp, tensor)
    chunk_rows: int = 0  # rl.rollout_chunk_rows: rows per rollout chunk (0: automatic)
    unchunkable: str = ""  # why the rollout cannot be chunked ("": it can)
    length_field: str = "data.max_new_tokens"  # the config field of the generation length

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @property
    def batch_shards(self) -> int:
        return self.mesh[0] * self.mesh[1]

    @property
    def width(self) -> int:
        """S: the token buffer (prompt + completion, whole pages)."""
        return buffer_schedule(self.prompt_width, self.max_new_tokens, self.page_size)[-1]

    @property
    def spec(self) -> AttentionSpec:
        """The actor's attention spec (the cache's page summaries follow it)."""
        return AttentionSpec(page_size=self.page_size, sparse=self.sparse)


# ----------------------------------------------------------------------------- sizes
def abstract_params(cfg: ModelConfig):
    """theta's state as jax.ShapeDtypeStructs (nnx.eval_shape of the model: no weights)."""
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))[1]


def tree_bytes(tree, mesh: tuple[int, int, int] = (1, 1, 1)) -> int:
    """Bytes per device of a tree of arrays (or ShapeDtypeStructs): each leaf split by its
    rule on a mesh of this shape (sharding.state_specs; replicated where none applies)."""
    if tree is None:
        return 0
    abstract = jax.sharding.AbstractMesh(tuple(mesh), sharding.AXES)
    sizes = dict(zip(sharding.AXES, mesh))
    specs = sharding.state_specs(tree, abstract)
    total = 0
    for x, spec in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec)):
        axes = [
            a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))
        ]
        split = math.prod(sizes[a] for a in axes)
        total += math.prod(x.shape) * jnp.dtype(x.dtype).itemsize // split
    return total


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def _leaf_max(tree, mesh) -> int:
    """The largest leaf's bytes per device."""
    return max((tree_bytes(x, mesh) for x in jax.tree.leaves(tree)), default=0)


def _rows_per_device(rows: int, s: Settings) -> float:
    """Rows a device holds of a batch split over data x fsdp (all of them if it does not
    divide, as sharding.fit leaves it)."""
    return rows / s.batch_shards if rows % s.batch_shards == 0 else rows


def _kv_split(s: Settings) -> int:
    """The tensor axis splits the KV heads where it divides them."""
    t = s.mesh[2]
    return t if s.model.num_kv_heads % t == 0 else 1


def cache_row_bytes(s: Settings, length: int) -> int:
    """KV cache bytes of one row at `length` positions: every layer's keys, values and page
    summaries as attention/cache.py makes them (shapes only), KV heads split over tensor."""
    cfg = s.model

    def init():
        return [
            kv_cache.init_layer_cache(
                1,
                cfg.num_kv_heads,
                length,
                cfg.head_dim,
                jnp.dtype(cfg.dtype),
                layer_info(cfg, i),
                s.spec,
            )
            for i in range(cfg.num_layers)
        ]

    return tree_bytes(jax.eval_shape(init)) // _kv_split(s)


def sparse_layer_count(s: Settings) -> int:
    spec = s.spec
    return sum(spec.is_sparse_layer(layer_info(s.model, i)) for i in range(s.model.num_layers))


def record_row_bytes(s: Settings) -> int:
    """The sampler's per-row record: tokens (int32), log-probs (f32), the page ids read by
    every position of every sparse layer (int32 [S, K, P]) and top log-probs."""
    w, p = s.width, s.sparse.max_pages if s.sparse else 0
    pages = sparse_layer_count(s) * w * s.model.num_kv_heads * p * 4 // _kv_split(s)
    return w * (4 + F32) + pages + 2 * w * s.top_logprobs * 4


def output_row_bytes(s: Settings) -> int:
    """A Rollout's row: the record plus its completion mask (f32)."""
    return record_row_bytes(s) + s.width * F32


def _decode_row_bytes(s: Settings, length: int) -> float:
    """A decode step's temporaries per row: the logits' f32 copies, and the largest
    layer's attention scores (a dense layer: logits and probabilities over the buffer; a
    sparse one: the page scores and its gathered keys and values)."""
    cfg = s.model
    dense = 2 * cfg.num_heads * length * F32
    sparse = 0
    if s.sparse:
        keys = s.sparse.max_pages * s.page_size
        pages = length // s.page_size
        gathered = 2 * keys * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
        sparse = cfg.num_kv_heads * (3 * pages * F32 + gathered) + 2 * cfg.num_heads * keys * F32
    return DECODE_LOGIT_COPIES * cfg.vocab_size * F32 + max(dense, sparse) / _kv_split(s)


def _prefill_token_bytes(s: Settings) -> float:
    """The prefill's temporaries per prompt token: one layer's f32 vectors and scores."""
    cfg, c = s.model, PREFILL_COPIES
    keys, _ = keys_per_query(s.prompt_width, None)
    per = (
        c["d_model"] * cfg.d_model
        + (c["mlp"] * cfg.mlp_dim + c["q_heads"] * cfg.num_heads * cfg.head_dim) / s.mesh[2]
        + c["kv_heads"] * cfg.num_kv_heads * cfg.head_dim / _kv_split(s)
        + c["scores"] * cfg.num_heads * keys / s.mesh[2]
    )
    return per * F32


def keys_per_query(t: int, window: int | None) -> tuple[float, str]:
    """Mean keys per query that dense.sequence_attention scores for a sequence of t tokens
    in a layer with this window, and the path it takes (full, blocked or banded)."""
    if window is not None and t >= 4 * window:
        return 2.0 * window, "banded"
    if t >= 2 * CAUSAL_BLOCK:
        total = 0
        for start in range(0, t, CAUSAL_BLOCK):
            end = min(start + CAUSAL_BLOCK, t)
            first = 0 if window is None else max(0, start - window + 1)
            total += (end - start) * (end - first)
        return total / t, "blocked"
    return float(t), "full"


def _layer_token_bytes(s: Settings, i: int, spec: AttentionSpec, lora) -> float:
    """Layer i's activations per token in a teacher-forced backward pass: its f32 vectors
    and its attention scores (a sparse layer on recorded pages: the prompt block, then
    every later query's gathered pages and their keys and values)."""
    cfg, c, t, tensor = s.model, LAYER_COPIES, s.width, s.mesh[2]
    per = (
        c["d_model"] * cfg.d_model
        + (c["mlp"] * cfg.mlp_dim + c["q_heads"] * cfg.num_heads * cfg.head_dim) / tensor
        + c["kv_heads"] * cfg.num_kv_heads * cfg.head_dim / _kv_split(s)
    )
    info = layer_info(cfg, i)
    if spec.sparse is not None and spec.is_sparse_layer(info):
        w = min(t, s.prompt_width)
        keys = spec.sparse.max_pages * s.page_size
        head = w * w * SCORE_COPIES["full"] * F32
        gathered = 2 * keys * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize  # its keys, values
        tail = (t - w) * (
            keys * SCORE_COPIES["gathered"] * F32 + gathered * cfg.num_kv_heads / cfg.num_heads
        )
        scores = cfg.num_heads * (head + tail) / t / F32
    else:
        keys, path = keys_per_query(t, info.window)
        scores = cfg.num_heads * keys * (SCORE_COPIES[path] + (cfg.attn_softcap is not None))
    del lora  # the adapter's rank-r vectors are small beside the rest
    return (per + scores / tensor) * F32


def activation_bytes(s: Settings, rows: float, spec: AttentionSpec, lora=None) -> float:
    """What a teacher-forced backward pass of `rows` rows (per device) keeps: every layer's
    activations and the head's (logits-sized f32 vectors), S tokens per row."""
    cfg, c = s.model, HEAD_COPIES
    vocab = c["vocab"] + (cfg.final_softcap is not None)
    head = (vocab * cfg.vocab_size / s.mesh[2] + c["d_model"] * cfg.d_model) * F32
    layers = sum(_layer_token_bytes(s, i, spec, lora) for i in range(cfg.num_layers))
    return rows * s.width * (head + layers)


# ------------------------------------------------------------------------- programs
def rollout_program(s: Settings, params, lora, chunks: int) -> dict:
    """The jitted rollout's bytes per device by part, its P x M rows in `chunks` chunks:
    weights (theta, phi, and theta + phi merged in f32 compute), outputs (all rows), the
    chunk's KV cache and its work (carried record, prefill and decode temporaries)."""
    rows = _rows_per_device(s.rows, s)
    chunk = rows / chunks
    sizes = buffer_schedule(s.prompt_width, s.max_new_tokens, s.page_size, s.grow_buffer_from)
    cache = chunk * cache_row_bytes(s, sizes[-1])
    if len(sizes) > 1:  # the last growth holds the previous buffer beside the full one
        cache += chunk * cache_row_bytes(s, sizes[-2])
    merged = 0
    if lora is not None and jnp.dtype(s.model.dtype) == jnp.float32:  # Transformer.merge_lora
        merged = tree_bytes(merged_weights(lora), s.mesh)
    carry = chunk * record_row_bytes(s) if chunks > 1 else 0  # chunks == 1: the outputs
    prompts = _rows_per_device(s.prompts, s) / chunks
    work = (
        carry
        + chunk * _decode_row_bytes(s, sizes[-1])
        + prompts * s.prompt_width * _prefill_token_bytes(s)
    )
    return {
        "weights": tree_bytes(params, s.mesh) + tree_bytes(lora, s.mesh) + merged,
        "outputs": rows * output_row_bytes(s),
        "kv_chunk": cache,
        "chunk_work": work,
    }


def merged_weights(lora) -> dict:
    """The f32 weights W + A.B that a LoRA tree's pairs make (their shapes: A's input
    dims, B's output dims), named like their maps so the weights' rules split them."""
    return {
        i: {
            name: jax.ShapeDtypeStruct(ab["a"].shape[:-1] + ab["b"].shape[1:], jnp.float32)
            for name, ab in maps.items()
        }
        for i, maps in lora.items()
    }


def update_program(s: Settings, params, opt_state, rows: int, spec: AttentionSpec) -> dict:
    """A jitted optimizer step's bytes per device by part (theta's: train/grpo.py): the
    parameters and their optimizer state (donated: in and out in place), the minibatch of
    `rows` rows, the gradients (one microbatch's and the accumulator) and the optimizer's
    temporaries, and one microbatch's activations."""
    per_dev = _rows_per_device(rows, s)
    batch_row = s.width * (4 + 3 * F32)  # tokens, mask, old log-probs, one more weight
    if spec.sparse is not None:
        batch_row += record_row_bytes(s) - s.width * (4 + F32)  # the page record
    p = tree_bytes(params, s.mesh)
    return {
        "state": p + tree_bytes(opt_state, s.mesh),
        "batch": per_dev * batch_row,
        "gradients": 2 * p + 2 * _leaf_max(params, s.mesh),
        "activations": activation_bytes(s, per_dev / s.microbatches, spec),
    }


def phi_program(s: Settings, params, lora, lora_opt, rows: int) -> dict:
    """phi's optimizer step (train/distill.py): theta frozen (an input), phi and its
    optimizer state donated, phi's gradients, one microbatch's activations of the actor's
    twin on the recorded pages."""
    per_dev = _rows_per_device(rows, s)
    batch_row = record_row_bytes(s) + s.width * 3 * F32
    q = tree_bytes(lora, s.mesh)
    return {
        "state": tree_bytes(params, s.mesh) + q + tree_bytes(lora_opt, s.mesh),
        "batch": per_dev * batch_row,
        "gradients": 2 * q + 2 * _leaf_max(params, s.mesh),
        "activations": activation_bytes(s, per_dev / s.microbatches, s.spec, lora),
    }


# ----------------------------------------------------------------------------- the plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """The rollout's chunks and what one device holds (bytes), against its limit."""

    settings: Settings
    chunks: int  # the rollout in this many sequential chunks of whole prompts
    limit: int  # bytes per device the plan fills at most: HEADROOM x memory
    memory: int  # the device's memory (bytes)
    source: str  # where `memory` came from
    parts: dict  # per-device bytes: params, optimizer, phi, outputs, kv_chunk, ...
    peaks: dict  # per-device bytes at the peak of each phase: rollout, update, phi

    @property
    def chunk_rows(self) -> int:
        return self.settings.rows // self.chunks

    def line(self) -> str:
        """The plan in one line."""
        s, p = self.settings, self.parts
        mb_rows = s.prompts * s.kept // s.minibatches // s.microbatches
        phi = f", phi {fmt(p['phi'])}" if s.lora is not None else ""
        acts = f"activations {fmt(p['activations'])} per microbatch of {_rows(mb_rows)}"
        if s.batch_shards > 1:
            acts += f" ({_rows(_rows_per_device(mb_rows, s))} per device)"
        if s.phi_trained:
            acts += f" (phi's {fmt(p['phi_activations'])})"
        peaks = ", ".join(f"{k} {fmt(v)}" for k, v in self.peaks.items())
        return (
            f"per device (mesh {'x'.join(map(str, s.mesh))}; limit {fmt(self.limit)} = "
            f"{HEADROOM} x {fmt(self.memory)} {self.source}): params {fmt(p['params'])}, "
            f"optimizer {fmt(p['optimizer'])}{phi}, rollout outputs {fmt(p['outputs'])} "
            f"({_rows(s.rows)}), KV cache {fmt(p['kv_chunk'])} per chunk of "
            f"{_rows(self.chunk_rows)} ({self.chunks} chunk{'s' * (self.chunks > 1)}), "
            f"{acts}; peaks: {peaks}"
        )

    def warnings(self) -> list[str]:
        """The updates whose estimate passes the limit, with the setting that would fit."""
        out = []
        for phase in ("update", "phi"):
            if phase in self.peaks and self.peaks[phase] > self.limit:
                out.append(
                    f"{phase}'s estimate {fmt(self.peaks[phase])} per device passes the "
                    f"limit {fmt(self.limit)}: {self._update_fix(phase)}"
                )
        return out

    def _update_fix(self, phase: str) -> str:
        """The microbatch count that would fit the update, or the length field."""
        s, key = self.settings, "activations" if phase == "update" else "phi_activations"
        rows = s.prompts * s.kept // s.minibatches // (s.phi_row_stride if phase == "phi" else 1)
        per_row = self.parts[key] * s.microbatches / rows
        room = self.limit - (self.peaks[phase] - self.parts[key])
        for m in range(s.microbatches + 1, rows + 1):
            if rows % m == 0 and rows // m * per_row <= room:
                return f"config.rl.microbatches={m} would fit (estimated)"
        return f"one row per microbatch does not fit: shorten config.{s.length_field}"


def _rows(n: float) -> str:
    return f"{n:g} row{'s' * (n != 1)}"


def fmt(b: float) -> str:
    """Bytes as GB / MB / KB (decimal)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b / 1e3:.1f} KB"


def estimate(s: Settings, params, opt_state, lora=None, lora_opt=None, chunks: int = 1):
    """(parts, peaks) per device with the rollout in `chunks` chunks (module doc)."""
    roll = rollout_program(s, params, lora, chunks)
    kept = s.prompts * s.kept
    theta_spec = s.spec if s.trainer_sparse else AttentionSpec(page_size=s.page_size)
    upd = update_program(s, params, opt_state, kept // s.minibatches, theta_spec)
    phi = tree_bytes(lora, s.mesh) + tree_bytes(lora_opt, s.mesh)
    # Around the updates: the rollout's outputs (all M rows) and the kept rows' copy.
    rollout_out = roll["outputs"] + _rows_per_device(kept, s) * output_row_bytes(s)
    parts = {
        "params": tree_bytes(params, s.mesh),
        "optimizer": tree_bytes(opt_state, s.mesh),
        "phi": phi,
        "outputs": roll["outputs"],
        "kv_chunk": roll["kv_chunk"],
        "chunk_work": roll["chunk_work"],
        "activations": upd["activations"],
    }
    peaks = {
        "rollout": sum(roll.values()) + parts["optimizer"] + tree_bytes(lora_opt, s.mesh),
        "update": sum(upd.values()) + phi + rollout_out,
    }
    if s.phi_trained:
        rows = kept // s.phi_row_stride // s.minibatches
        prog = phi_program(s, params, lora, lora_opt, rows)
        parts["phi_activations"] = prog["activations"]
        peaks["phi"] = sum(prog.values()) + parts["optimizer"] + rollout_out
    return parts, peaks


def chunk_counts(s: Settings) -> list[int]:
    """The rollout's possible chunk counts, fewest first: chunks of whole prompts, equal,
    each split evenly over the batch shards; rl.rollout_chunk_rows fixes one; a rollout
    that cannot be chunked has one."""
    if s.unchunkable:
        return [1]
    if s.chunk_rows:
        return [s.rows // s.chunk_rows]
    return [
        c
        for c in range(1, s.prompts + 1)
        if s.prompts % c == 0 and (s.rows // c) % s.batch_shards == 0
    ] or [1]


def plan(s: Settings, params, opt_state, lora, lora_opt, memory: int, source: str) -> Plan:
    """The fewest rollout chunks whose rollout phase fits HEADROOM x `memory` per device;
    a UserError naming the config field to change when none does."""
    limit = int(HEADROOM * memory)
    for chunks in chunk_counts(s):
        parts, peaks = estimate(s, params, opt_state, lora, lora_opt, chunks)
        if peaks["rollout"] <= limit:
            return Plan(s, chunks, limit, memory, source, parts, peaks)
    raise UserError(_fit_error(s, parts, peaks, chunks, limit))


def _fit_error(s: Settings, parts: dict, peaks: dict, chunks: int, limit: int) -> str:
    """One line: the field to change, what does not fit (the smallest chunk's estimate)."""
    rows = parts["outputs"] + parts["kv_chunk"] + parts["chunk_work"]
    fixed = peaks["rollout"] - rows  # the weights (and their merged copy), the optimizers
    need = f"the rollout needs {fmt(peaks['rollout'])} per device, the limit is {fmt(limit)}"
    if fixed > limit:
        field, why = "mesh.fsdp", f"theta, phi and their optimizers alone take {fmt(fixed)}"
    elif fixed + parts["outputs"] > limit:
        field = "rl.prompts_per_step"
        why = f"the outputs of its {s.rows} rows take {fmt(parts['outputs'])}" + (
            " (the page record of every position)" if s.sparse else ""
        )
    elif s.chunk_rows:
        field = "rl.rollout_chunk_rows"
        why = f"a chunk of {s.chunk_rows} rows holds a {fmt(parts['kv_chunk'])} KV cache"
    elif s.unchunkable:
        field = "rl.prompts_per_step"
        why = f"{s.unchunkable} rolls out the whole batch at once (not chunked)"
    else:
        field = s.length_field
        why = f"even {s.rows // chunks} rows at once hold a {fmt(parts['kv_chunk'])} KV cache"
    return f"config.{field}: {need} at any chunk size: {why}"


def device_memory(config) -> tuple[int, str]:
    """(bytes one device may hold, where the figure came from): mesh.device_memory_gb if
    set, else the device's allocator limit (memory_stats()['bytes_limit']), else (CPU)
    the host's RAM shared by its local devices."""
    gb = config.mesh.device_memory_gb
    if gb:
        return int(gb * GB), "(mesh.device_memory_gb)"
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "(device bytes_limit)"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // jax.local_device_count(), "(host RAM)"


def settings_of(ctx, setup) -> Settings:
    """A run's Settings: its model, task widths, RL batch, mode and mesh (ctx: a
    RunContext, setup: its rl_state.RLSetup)."""
    c, mode = ctx.config, setup.mode
    samples, unchunkable = setup.m, ""
    if setup.drafting is not None:
        unchunkable = "rl.rollout_mode=speculative"
    if setup.pruning is not None:
        samples, unchunkable = setup.pruning.generated, "rl.prune.enabled"
    synthetic = str(c.data.source).startswith("synthetic:")
    return Settings(
        model=ctx.model_cfg,
        prompts=setup.prompts_per_step,
        samples=samples,
        kept=setup.n,
        prompt_width=ctx.task.prompt_buffer(),
        max_new_tokens=ctx.task.completion_budget(),
        page_size=ctx.spec.page_size,
        sparse=setup.rollout_spec.sparse,
        trainer_sparse=mode.trainer_sparse,
        lora=ctx.lora_cfg if mode.actor_lora else None,
        phi_trained=mode.updates_phi,
        phi_row_stride=setup.phi_row_stride,
        minibatches=setup.minibatches,
        microbatches=c.rl.microbatches,
        grow_buffer_from=setup.sampling.grow_buffer_from,
        top_logprobs=setup.sampling.top_logprobs,
        mesh=sharding.mesh_shape(c.mesh, jax.device_count()),
        chunk_rows=c.rl.rollout_chunk_rows,
        unchunkable=unchunkable,
        length_field="task.num_terms" if synthetic else "data.max_new_tokens",
    )


def for_run(ctx, setup) -> Plan:
    """The plan of a run: its settings, theta's and phi's abstract parameters and
    optimizer states (the run's own transforms), the device's memory."""
    s = settings_of(ctx, setup)
    c = ctx.config
    per_step = optimizer_steps_per_rl_step(c.rl)
    params = abstract_params(ctx.model_cfg)
    opt_state = jax.eval_shape(optimizer_from(c.rl, per_step["theta"], c.rl.num_steps).init, params)
    lora = lora_opt = None
    if s.lora is not None:
        lora = lora_lib.lora_shapes(ctx.model_cfg, s.lora)
    if s.phi_trained:
        tx = optimizer_from(c.lora, per_step["phi"], c.rl.num_steps)
        lora_opt = jax.eval_shape(tx.init, lora)
    return plan(s, params, opt_state, lora, lora_opt, *device_memory(c))
