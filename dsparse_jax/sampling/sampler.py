"""Jitted rollout: one dense prefill, then a lax.while_loop of decode steps.

Log-prob convention (RL ratios depend on it): `logprobs` holds, for every sampled token,
log p(token) under the distribution it was actually drawn from, i.e.
log_softmax(truncate(logits / temperature)) where truncate applies top-k, then top-p,
and renormalises. With top_k=0 and top_p=1 (the RL default) this is exactly
log_softmax(logits / temperature) at the sampled token, which is what a trainer
recomputes teacher-forced. With temperature=0 (greedy) the token is the argmax and its
log-prob is log_softmax(logits) (temperature 1). Optional `top_logprobs` are the k
largest entries of log_softmax(logits / temperature) before truncation (temperature 1
when greedy, as for `logprobs`).

Layout: `tokens` is [B, S]: row b holds its prompt at [0, prompt_len_b) and its
completion right after it, then pad; S = prompt buffer + max_new_tokens rounded up to the
page size. The completion's EOS, if sampled, belongs to the completion (mask 1).
Weights (the nnx state) and the LoRA tree enter jit as arguments: new values never
recompile; the static settings (SamplingConfig, AttentionSpec) do.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention.selection import PageRecord
from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.model import quality_head, transformer
from dsparse_jax.parallel import sharding
from dsparse_jax.sampling import pruning


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int
    eos_id: int
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    samples_per_prompt: int = 1
    top_logprobs: int = 0  # also return the k largest log-probs per step (0: off)
    # 0: decode over one cache buffer of prompt + max_new_tokens. N > 0: the buffer starts at
    # prompt + N tokens and doubles until it holds max_new_tokens (see buffer_schedule).
    grow_buffer_from: int = 0
    # More tokens that end a row besides eos_id (a checkpoint's generation_config.json
    # lists several: the tokenizer's stop_ids).
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError("SamplingConfig.max_new_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("SamplingConfig.temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("SamplingConfig.top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("SamplingConfig.top_p must be in (0, 1]")
        if self.samples_per_prompt < 1:
            raise ValueError("SamplingConfig.samples_per_prompt must be >= 1")
        if self.top_logprobs < 0:
            raise ValueError("SamplingConfig.top_logprobs must be >= 0")
        if self.grow_buffer_from < 0:
            raise ValueError("SamplingConfig.grow_buffer_from must be >= 0 (0: one fixed buffer)")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "tokens",
        "prompt_lengths",
        "completion_lengths",
        "completion_mask",
        "logprobs",
        "page_ids",
        "top_logprobs",
        "draft_start",
        "draft_logprobs",
    ],
    meta_fields=["prompt_width"],
)
@dataclasses.dataclass(frozen=True)
class Rollout:
    """What a rollout returns; every [B, S] array is aligned with `tokens`. A pytree whose
    leaves are the arrays; prompt_width (static) is the prompt buffer the rollout was
    sampled from: every completion starts before it (0: unknown)."""

    tokens: jax.Array  # int32 [B, S]
    prompt_lengths: jax.Array  # int32 [B]
    completion_lengths: jax.Array  # int32 [B]
    completion_mask: jax.Array  # f32 [B, S], 1 on completion tokens
    logprobs: jax.Array  # f32 [B, S], log-prob of each completion token (0 elsewhere)
    page_ids: dict  # {sparse layer: int32 [B, S, K, P]}: pages read by the query at s
    top_logprobs: Any = None  # (values f32 [B, S, k], ids int32 [B, S, k]) or None
    # Speculative rollouts with the sparse_self drafter and record_pages: per position the
    # start of the draft block the drafter ran it in (-1: never), and log q of each
    # accepted draft token under the drafter (0 elsewhere): Transformer.forward's
    # draft_start replays that function, and twin_draft_max_abs checks it.
    draft_start: Any = None  # int32 [B, S] or None
    draft_logprobs: Any = None  # f32 [B, S] or None
    prompt_width: int = 0

    @property
    def lengths(self):
        return self.prompt_lengths + self.completion_lengths

    def replace(self, **fields) -> "Rollout":
        return dataclasses.replace(self, **fields)

    def sparse_query(self):
        """bool [B, S]: the positions whose query ran as a sparse decode step."""
        pos = jnp.arange(self.tokens.shape[1])[None]
        return (pos >= self.prompt_lengths[:, None]) & (pos < self.lengths[:, None] - 1)

    def pages(self):
        """The decode record in the form Transformer.forward(pages=...) takes, or None."""
        if not self.page_ids:
            return None
        sq = self.sparse_query()
        prefix = self.prompt_width or None
        return {layer: PageRecord(ids, sq, prefix) for layer, ids in self.page_ids.items()}


def truncate_logits(logits_BxV, top_k: int, top_p: float):
    """Sets logits outside the top-k and then outside the top-p nucleus to -inf."""
    if top_k:
        kth = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth, -jnp.inf, logits_BxV)
    if top_p < 1.0:
        sorted_desc = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p  # the first token is always kept
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < cutoff, -jnp.inf, logits_BxV)
    return logits_BxV


def scaled_logits(logits_BxV, cfg: SamplingConfig):
    """The logits a token is drawn from: temperature and truncation (greedy: unchanged)."""
    if cfg.temperature == 0.0:
        return logits_BxV
    return truncate_logits(logits_BxV / cfg.temperature, cfg.top_k, cfg.top_p)


def sampling_logprobs(logits_BxV, cfg: SamplingConfig):
    """Log-probs [B, V] of the distribution a token is drawn from (see the module doc)."""
    return jax.nn.log_softmax(scaled_logits(logits_BxV, cfg), axis=-1)


def sample_token(logits_BxV, key, cfg: SamplingConfig):
    """(token_B, logprob_B of that token under the sampling distribution)."""
    scaled = scaled_logits(logits_BxV, cfg)
    if cfg.temperature == 0.0:
        tok = jnp.argmax(logits_BxV, axis=-1)
    else:
        tok = jax.random.categorical(key, scaled, axis=-1)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return tok.astype(jnp.int32), jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def top_logprobs(logits_xV, cfg: SamplingConfig):
    """The cfg.top_logprobs largest entries of log_softmax(logits / temperature) over the
    last axis, (values f32, ids int32); greedy (temperature 0) reports temperature-1
    log-probs, like `logprobs`."""
    t = cfg.temperature if cfg.temperature > 0 else 1.0
    vals, ids = jax.lax.top_k(jax.nn.log_softmax(logits_xV / t, axis=-1), cfg.top_logprobs)
    return vals, ids.astype(jnp.int32)


def sample_token_rows(logits_BxV, keys_B, cfg: SamplingConfig):
    """sample_token with one key per row: a row's draw does not depend on the others."""
    if cfg.temperature == 0.0:
        return sample_token(logits_BxV, None, cfg)
    logp = sampling_logprobs(logits_BxV, cfg)  # categorical is shift-invariant per row
    tok = jax.vmap(jax.random.categorical)(keys_B, logp).astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def buffer_length(prompt_len: int, max_new_tokens: int, page_size: int) -> int:
    total = prompt_len + max_new_tokens
    return -(-total // page_size) * page_size


def buffer_schedule(
    prompt_len: int, max_new_tokens: int, page_size: int, grow_from: int = 0
) -> list[int]:
    """The KV-cache lengths the decode loop runs through, shortest first.

    A decode step's dense layers (and the page scoring of sparse ones) read the whole cache
    buffer, masked, whatever the position. grow_from = 0: one buffer of prompt +
    max_new_tokens (one decode compile, no copy). grow_from = N > 0: buffers of prompt + N,
    prompt + 2N, ... tokens, then the full one; the loop moves to the next buffer (a copy of
    the cache) when the next step could write past the current one, so a step costs
    O(position) up to a factor 2. Costs one decode compile per buffer and, at each growth,
    the old and the new cache at once (peak 1.5x the final cache at the last growth).
    """
    full = buffer_length(prompt_len, max_new_tokens, page_size)
    sizes, n = [], grow_from
    while 0 < n < max_new_tokens:
        size = buffer_length(prompt_len, n, page_size)
        if size < full and size not in sizes:
            sizes.append(size)
        n *= 2
    return sizes + [full]


class JittedCall:
    """A sampler's call: `_bind` normalises the arguments, `_jitted` (set by the sampler's
    __init__) runs them."""

    def __call__(self, *args, **kwargs):
        args, kwargs = self._bind(*args, **kwargs)
        return self._jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """jax's Lowered of the call with these arguments: `.compile()` compiles it ahead of
        time (the call then reuses the executable)."""
        args, kwargs = self._bind(*args, **kwargs)
        return self._jitted.lower(*args, **kwargs)


class Sampler(JittedCall):
    """Samples completions from a Transformer. Build once per model graph; call with any
    weights of that graph:

    sampler(state, prompts_BxL, prompt_lengths_B, key, cfg, spec, lora, lora_scale,
    forced_BxS, prune, head, chunks) (`_bind`): a Rollout with B * samples_per_prompt rows
    (a prompt's samples contiguous)."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._jitted = jax.jit(
            self._sample, static_argnames=("cfg", "spec", "lora_scale", "prune", "chunks")
        )

    def _bind(
        self,
        state,
        prompts_BxL,
        prompt_lengths_B,
        key,
        cfg: SamplingConfig,
        spec: AttentionSpec = AttentionSpec(),
        lora=None,
        lora_scale: float = 1.0,
        forced_BxS=None,
        prune: pruning.PruneConfig | None = None,
        head=None,
        chunks: int = 1,
    ):
        """The jitted function's (args, kwargs) of a call: a Rollout with B *
        samples_per_prompt rows (a prompt's samples contiguous).

        Row r's samples depend only on (key, r): each row draws from its own stream
        fold_in(fold_in(key, r), step), whatever its batch neighbours are.

        forced_BxS: optional tokens to replay instead of sampling (a Rollout's `tokens`,
        one row per prompt, samples_per_prompt 1): every decode step runs as when sampling
        (the same page selection, recorded) but feeds the forced token, and `logprobs`
        holds its log-prob under this policy's sampling distribution. Rows end at the
        forced EOS or at max_new_tokens.

        prune (with `head`, model/quality_head.py params): online pruning of the M' =
        samples_per_prompt rows per prompt at prune.positions (sampling/pruning.py);
        returns (Rollout with B * prune.rows_per_prompt rows, PruneRecord).

        chunks: the prompts in this many equal groups, rolled out one after the other in
        the same program (lax.map): the KV cache, the carried record and the decode
        temporaries are those of one group; the outputs are the same rows in the same
        order (row r's stream stays fold_in(key, r); tests/test_memory_plan.py checks the
        tokens and log-probs bit for bit). Not with pruning, whose label draws span the
        batch.
        """
        lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
        if prompts_BxL.shape[0] != lengths.shape[0]:
            raise ValueError("prompts and prompt_lengths disagree on the batch size")
        if chunks < 1 or lengths.shape[0] % chunks:
            raise ValueError(
                f"chunks={chunks} must be >= 1 and divide the {lengths.shape[0]} prompts"
            )
        if prune is not None and chunks > 1:
            raise ValueError("pruning draws its label rows over the whole batch: chunks=1 only")
        if forced_BxS is not None and (
            cfg.samples_per_prompt != 1 or forced_BxS.shape[0] != lengths.shape[0]
        ):
            raise ValueError("forced tokens need one row per prompt and samples_per_prompt=1")
        if prune is not None:
            if forced_BxS is not None or head is None:
                raise ValueError("pruning needs a quality head and no forced tokens")
            prune.check(cfg.samples_per_prompt)
            if prune.positions[-1] >= cfg.max_new_tokens:
                raise ValueError("PruneConfig.positions must be < max_new_tokens")
        args = (
            state,
            jnp.asarray(prompts_BxL, jnp.int32),
            lengths,
            key,
            lora,
            None if forced_BxS is None else jnp.asarray(forced_BxS, jnp.int32),
            head,
        )
        return args, dict(cfg=cfg, spec=spec, lora_scale=lora_scale, prune=prune, chunks=chunks)

    def _sample(
        self,
        state,
        prompts_BxL,
        prompt_len_B,
        key,
        lora,
        forced_BxS=None,
        head=None,
        *,
        cfg,
        spec,
        lora_scale,
        prune=None,
        chunks=1,
    ):
        model = nnx.merge(self.graphdef, state)
        if model.merge_lora(lora, lora_scale):  # theta + phi once, not at every decode step
            lora = None
        rows = functools.partial(
            self._sample_rows, model, key, lora, head, cfg=cfg, spec=spec, lora_scale=lora_scale
        )
        if chunks == 1:
            return rows(prompts_BxL, prompt_len_B, forced_BxS, prune=prune)
        # Groups of prompts in sequence; row r of the batch keeps its stream (offset + i).
        split = lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:])
        per_chunk = prompts_BxL.shape[0] // chunks * cfg.samples_per_prompt
        offsets = jnp.arange(chunks, dtype=jnp.int32) * per_chunk
        xs = (split(prompts_BxL), split(prompt_len_B), offsets)
        if forced_BxS is not None:
            xs += (split(forced_BxS),)

        def one(x):
            prompts, lengths = sharding.constrain_batch(x[:2])  # a group over every device
            return rows(prompts, lengths, x[3] if len(x) > 3 else None, x[2])

        out = jax.lax.map(one, xs)
        return sharding.constrain_batch(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out))

    def _sample_rows(
        self,
        model,
        key,
        lora,
        head,
        prompts_BxL,
        prompt_len_B,
        forced_BxS=None,
        row_offset=None,
        *,
        cfg,
        spec,
        lora_scale,
        prune=None,
    ):
        """The rollout of one group of prompts; its rows are rows row_offset + [0, B) of
        the call's batch (their PRNG streams)."""
        n = cfg.samples_per_prompt
        b0, l = prompts_BxL.shape
        sizes = buffer_schedule(l, cfg.max_new_tokens, spec.page_size, cfg.grow_buffer_from)
        s = sizes[-1]  # the token and record buffers are full size from the start
        run = dict(spec=spec, lora=lora, lora_scale=lora_scale)
        if prune is not None:
            run["hidden_at"] = prune.layer

        # On a mesh: caches batch over data x fsdp, KV heads over tensor (parallel/sharding.py).
        caches = sharding.constrain_cache(model.init_cache(b0, sizes[0], spec))
        logits, caches = model.prefill(prompts_BxL, prompt_len_B, caches, **run_prefill(run))
        if n > 1:  # one prefill serves the n samples of each prompt
            rep = lambda x: jnp.repeat(x, n, axis=0)
            logits, caches = rep(logits), sharding.constrain_cache(jax.tree.map(rep, caches))
            prompts_BxL, prompt_len_B = rep(prompts_BxL), rep(prompt_len_B)
        b = b0 * n
        source = jnp.arange(b, dtype=jnp.int32)
        if row_offset is not None:
            source = source + row_offset

        tokens = jnp.full((b, s), cfg.pad_id, jnp.int32).at[:, :l].set(prompts_BxL)
        tokens = jnp.where(jnp.arange(s)[None] < prompt_len_B[:, None], tokens, cfg.pad_id)
        sparse_layers = transformer.sparse_layers(model.cfg, spec)
        kv, p = model.cfg.num_kv_heads, spec.sparse.max_pages if spec.sparse else 0
        k_top = cfg.top_logprobs
        # Everything a row carries, leading axis B: pruning gathers the rows of all of it.
        rs = dict(
            tokens=tokens,
            logprobs=jnp.zeros((b, s), jnp.float32),
            done=jnp.zeros((b,), bool),
            ncomp=jnp.zeros((b,), jnp.int32),
            prompt_len=prompt_len_B,
            key=jax.vmap(jax.random.fold_in, (None, 0))(key, source),
            page_ids={i: jnp.full((b, s, kv, p), -1, jnp.int32) for i in sparse_layers},
            caches=caches,
        )
        if k_top:
            rs["top"] = (jnp.zeros((b, s, k_top), jnp.float32), jnp.zeros((b, s, k_top), jnp.int32))
        if prune is not None:
            c, d = len(prune.positions), model.cfg.d_model
            rs.update(
                source=source,
                feat=jnp.zeros((b, d), jnp.float32),
                feats=jnp.zeros((b, c, d), jnp.float32),
                scores=jnp.zeros((b, c), jnp.float32),
                scored=jnp.zeros((b, c), bool),
                is_label=jnp.zeros((b,), bool),
                weight=jnp.ones((b,), jnp.float32),
            )

        def emit(rs, logits_BxV, step, write_pos_B):
            """Samples one token per row and writes it (and its log-prob) at write_pos_B."""
            rows = jnp.arange(logits_BxV.shape[0])
            done = rs["done"]
            if forced_BxS is None:
                keys = jax.vmap(jax.random.fold_in, (0, None))(rs["key"], step)
                tok, lp = sample_token_rows(logits_BxV, keys, cfg)
            else:  # replay: the forced token, scored by this policy
                tok = forced_BxS[rows, jnp.minimum(write_pos_B, forced_BxS.shape[1] - 1)]
                lp = jnp.take_along_axis(sampling_logprobs(logits_BxV, cfg), tok[:, None], -1)
                lp = lp[:, 0]
            tok = jnp.where(done, cfg.pad_id, tok)
            lp = jnp.where(done, 0.0, lp)
            rs = dict(rs)
            rs["tokens"] = rs["tokens"].at[rows, write_pos_B].set(tok)
            rs["logprobs"] = rs["logprobs"].at[rows, write_pos_B].set(lp)
            if k_top:
                vals, ids = top_logprobs(logits_BxV, cfg)
                top = rs["top"]
                rs["top"] = (
                    top[0].at[rows, write_pos_B].set(vals),
                    top[1].at[rows, write_pos_B].set(ids),
                )
            rs["ncomp"] = rs["ncomp"] + (~done).astype(jnp.int32)
            rs["done"] = done | is_stop(tok, cfg)
            return rs

        rs = emit(rs, logits, jnp.int32(0), prompt_len_B)

        def cond(state, last_step):
            step, rs = state
            return (step < cfg.max_new_tokens) & (step <= last_step) & ~jnp.all(rs["done"])

        def body(state):
            step, rs = state
            rows = jnp.arange(rs["done"].shape[0])
            pos_B = rs["prompt_len"] + step - 1  # position of the token fed in this step
            out = model.decode(rs["tokens"][rows, pos_B], pos_B, rs["caches"], **run)
            logits, caches, ids = out[:3]
            rs = dict(rs, caches=caches)
            rs["page_ids"] = {i: v.at[rows, pos_B].set(ids[i]) for i, v in rs["page_ids"].items()}
            if prune is not None:  # the head's features: the last fed completion token's
                fed = (step - 1 < rs["ncomp"])[:, None]
                rs["feat"] = jnp.where(fed, out[3].astype(jnp.float32), rs["feat"])
            rs = emit(rs, logits, step, pos_B + 1)
            return step + 1, rs

        def prune_at(state, c):
            """Checkpoint c: score, keep, draw label rows, gather the batch (pruning.py)."""
            step, rs = state
            groups = (n,) + prune.sizes
            carried = c * prune.label_rows
            probs = quality_head.quality_probs(head, rs["feat"])
            group_row = jnp.tile(jnp.arange(groups[c] + carried) < groups[c], b0)
            rs = dict(rs)
            rs["feats"] = rs["feats"].at[:, c].set(rs["feat"])
            rs["scores"] = rs["scores"].at[:, c].set(probs)
            rs["scored"] = rs["scored"].at[:, c].set(group_row)
            rows, new_label, w = pruning.plan_rows(
                probs,
                rs["done"],
                b0,
                groups[c],
                carried,
                prune.sizes[c],
                prune,
                jax.random.fold_in(key, 2**31 - 1 - c),  # no row stream uses it
            )
            dropped = jnp.sum(rs["ncomp"]) - jnp.sum(rs["ncomp"][rows])
            rs = jax.tree.map(lambda x: x[rows], rs)
            rs["caches"] = sharding.constrain_cache(rs["caches"])
            rs["is_label"] = rs["is_label"] | new_label
            rs["weight"] = jnp.where(new_label, w, rs["weight"])
            counters.append(dropped)
            return step, rs

        # The decode loop in segments: each ends where the cache grows into the next buffer
        # or at a pruning checkpoint (which gathers the batch into fewer rows).
        events = [(size - l, 1, i) for i, size in enumerate(sizes)]
        if prune is not None:
            events += [(pos, 0, c) for c, pos in enumerate(prune.positions)]
        counters = []
        state = (jnp.int32(1), rs)
        for last, kind, i in sorted(events):
            # Step `step` writes the cache at position <= l + step - 1, which must be < size.
            state = jax.lax.while_loop(lambda st, last=last: cond(st, last), body, state)
            if kind == 0:
                state = prune_at(state, i)
            elif i + 1 < len(sizes):  # move the cache into the next buffer
                step, rs = state
                group_pages = spec.sparse.group_pages if spec.sparse else 0
                caches = [
                    kv_cache.grow_layer_cache(c, sizes[i + 1], spec.page_size, group_pages)
                    for c in rs["caches"]
                ]
                state = (step, dict(rs, caches=sharding.constrain_cache(caches)))
        rs = state[1]
        pos = jnp.arange(s)[None]
        plen, ncomp = rs["prompt_len"], rs["ncomp"]
        mask = (pos >= plen[:, None]) & (pos < (plen + ncomp)[:, None])
        rollout = Rollout(
            tokens=rs["tokens"],
            prompt_lengths=plen,
            completion_lengths=ncomp,
            completion_mask=mask.astype(jnp.float32),
            logprobs=rs["logprobs"],
            page_ids=rs["page_ids"],
            top_logprobs=rs.get("top"),
            prompt_width=l,
        )
        if prune is None:
            return rollout
        record = PruneRecord(
            source_rows=rs["source"],
            is_label=rs["is_label"],
            weight=rs["weight"],
            feats=rs["feats"],
            scores=rs["scores"],
            scored=rs["scored"],
            tokens_generated=jnp.sum(ncomp) + sum(counters),
        )
        return rollout, record


def run_prefill(run: dict) -> dict:
    """The decode keyword arguments that prefill takes too."""
    return {k: v for k, v in run.items() if k != "hidden_at"}


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "source_rows",
        "is_label",
        "weight",
        "feats",
        "scores",
        "scored",
        "tokens_generated",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class PruneRecord:
    """What a pruned rollout adds, per final row (aligned with the Rollout's rows) and per
    checkpoint c."""

    source_rows: jax.Array  # int32 [B]: the row's index in the unpruned M'-row batch
    is_label: jax.Array  # bool [B]: a label row (would-be-pruned, run on for the head)
    weight: jax.Array  # f32 [B]: rows of the pruned population it stands for (1: kept)
    feats: jax.Array  # f32 [B, C, D]: the head's features at each checkpoint
    scores: jax.Array  # f32 [B, C]: the head's P(reward = 1) when the row was scored
    scored: jax.Array  # bool [B, C]: the row was a group row scored at checkpoint c
    tokens_generated: jax.Array  # int32 []: completion tokens decoded, pruned rows' too


def is_stop(tok: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Where `tok` ends its row: eos_id or one of stop_ids."""
    stop = tok == cfg.eos_id
    for i in cfg.stop_ids:
        stop = stop | (tok == i)
    return stop


def completion_view(rollout: Rollout, pad_id: int):
    """Completions left-aligned: int32 [B, max_new] (pad after each completion's end)."""
    tokens = sharding.to_host(rollout.tokens)  # all-gathers rows held by other hosts
    starts = sharding.to_host(rollout.prompt_lengths)
    ncomp = sharding.to_host(rollout.completion_lengths)
    width = int(ncomp.max()) if len(ncomp) else 0
    out = np.full((tokens.shape[0], max(width, 1)), pad_id, np.int32)
    for i, (st, c) in enumerate(zip(starts, ncomp)):
        out[i, :c] = tokens[i, st : st + c]
    return out
