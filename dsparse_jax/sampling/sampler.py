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
from dsparse_jax.model import transformer
from dsparse_jax.parallel import sharding


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


class Sampler:
    """Samples completions from a Transformer. Build once per model graph; call with any
    weights of that graph."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._jitted = jax.jit(self._sample, static_argnames=("cfg", "spec", "lora_scale"))

    def __call__(
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
    ):
        """Returns a Rollout with B * samples_per_prompt rows (a prompt's samples contiguous).

        forced_BxS: optional tokens to replay instead of sampling (a Rollout's `tokens`,
        one row per prompt, samples_per_prompt 1): every decode step runs as when sampling
        (the same page selection, recorded) but feeds the forced token, and `logprobs`
        holds its log-prob under this policy's sampling distribution. Rows end at the
        forced EOS or at max_new_tokens.
        """
        lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
        if prompts_BxL.shape[0] != lengths.shape[0]:
            raise ValueError("prompts and prompt_lengths disagree on the batch size")
        if forced_BxS is not None and (
            cfg.samples_per_prompt != 1 or forced_BxS.shape[0] != lengths.shape[0]
        ):
            raise ValueError("forced tokens need one row per prompt and samples_per_prompt=1")
        return self._jitted(
            state,
            jnp.asarray(prompts_BxL, jnp.int32),
            lengths,
            key,
            lora,
            None if forced_BxS is None else jnp.asarray(forced_BxS, jnp.int32),
            cfg=cfg,
            spec=spec,
            lora_scale=lora_scale,
        )

    def _sample(
        self, state, prompts_BxL, prompt_len_B, key, lora, forced_BxS=None, *, cfg, spec, lora_scale
    ):
        model = nnx.merge(self.graphdef, state)
        if model.merge_lora(lora, lora_scale):  # theta + phi once, not at every decode step
            lora = None
        n = cfg.samples_per_prompt
        b0, l = prompts_BxL.shape
        sizes = buffer_schedule(l, cfg.max_new_tokens, spec.page_size, cfg.grow_buffer_from)
        s = sizes[-1]  # the token and record buffers are full size from the start
        run = dict(spec=spec, lora=lora, lora_scale=lora_scale)

        # On a mesh: caches batch over data x fsdp, KV heads over tensor (parallel/sharding.py).
        caches = sharding.constrain_cache(model.init_cache(b0, sizes[0], spec))
        logits, caches = model.prefill(prompts_BxL, prompt_len_B, caches, **run)
        if n > 1:  # one prefill serves the n samples of each prompt
            rep = lambda x: jnp.repeat(x, n, axis=0)
            logits, caches = rep(logits), sharding.constrain_cache(jax.tree.map(rep, caches))
            prompts_BxL, prompt_len_B = rep(prompts_BxL), rep(prompt_len_B)
        b = b0 * n
        rows = jnp.arange(b)

        tokens = jnp.full((b, s), cfg.pad_id, jnp.int32).at[:, :l].set(prompts_BxL)
        tokens = jnp.where(jnp.arange(s)[None] < prompt_len_B[:, None], tokens, cfg.pad_id)
        logprobs = jnp.zeros((b, s), jnp.float32)
        sparse_layers = transformer.sparse_layers(model.cfg, spec)
        kv, p = model.cfg.num_kv_heads, spec.sparse.max_pages if spec.sparse else 0
        page_ids = {i: jnp.full((b, s, kv, p), -1, jnp.int32) for i in sparse_layers}
        k_top = cfg.top_logprobs
        top = (
            (jnp.zeros((b, s, k_top), jnp.float32), jnp.zeros((b, s, k_top), jnp.int32))
            if k_top
            else None
        )

        def emit(carry, logits_BxV, key, write_pos_B):
            """Samples one token per row and writes it (and its log-prob) at write_pos_B."""
            tokens, logprobs, done, ncomp, top = carry
            if forced_BxS is None:
                tok, lp = sample_token(logits_BxV, key, cfg)
            else:  # replay: the forced token, scored by this policy
                tok = forced_BxS[rows, jnp.minimum(write_pos_B, forced_BxS.shape[1] - 1)]
                lp = jnp.take_along_axis(sampling_logprobs(logits_BxV, cfg), tok[:, None], -1)
                lp = lp[:, 0]
            tok = jnp.where(done, cfg.pad_id, tok)
            lp = jnp.where(done, 0.0, lp)
            tokens = tokens.at[rows, write_pos_B].set(tok)
            logprobs = logprobs.at[rows, write_pos_B].set(lp)
            if top is not None:
                vals, ids = top_logprobs(logits_BxV, cfg)
                top = (
                    top[0].at[rows, write_pos_B].set(vals),
                    top[1].at[rows, write_pos_B].set(ids),
                )
            ncomp = ncomp + (~done).astype(jnp.int32)
            done = done | (tok == cfg.eos_id)
            return tokens, logprobs, done, ncomp, top

        key, sub = jax.random.split(key)
        done = jnp.zeros((b,), bool)
        ncomp = jnp.zeros((b,), jnp.int32)
        out = emit((tokens, logprobs, done, ncomp, top), logits, sub, prompt_len_B)

        def cond(state, last_step):
            step, _, _, (_, _, done, _, _), _ = state
            return (step < cfg.max_new_tokens) & (step <= last_step) & ~jnp.all(done)

        def body(state):
            step, key, caches, out, page_ids = state
            pos_B = prompt_len_B + step - 1  # position of the token fed in this step
            logits, caches, ids = model.decode(out[0][rows, pos_B], pos_B, caches, **run)
            page_ids = {i: page_ids[i].at[rows, pos_B].set(ids[i]) for i in page_ids}
            key, sub = jax.random.split(key)
            out = emit(out, logits, sub, pos_B + 1)
            return step + 1, key, caches, out, page_ids

        state = (jnp.int32(1), key, caches, out, page_ids)
        for i, size in enumerate(sizes):
            if i:  # move the cache into the next buffer (all rows' positions fit the last one)
                step, key, caches, out, page_ids = state
                caches = sharding.constrain_cache(
                    [kv_cache.grow_layer_cache(c, size, spec.page_size) for c in caches]
                )
                state = (step, key, caches, out, page_ids)
            # Step `step` writes the cache at position <= l + step - 1, which must be < size.
            state = jax.lax.while_loop(lambda st, last=size - l: cond(st, last), body, state)
        _, _, _, out, page_ids = state
        tokens, logprobs, _, ncomp, top = out
        pos = jnp.arange(s)[None]
        mask = (pos >= prompt_len_B[:, None]) & (pos < (prompt_len_B + ncomp)[:, None])
        return Rollout(
            tokens=tokens,
            prompt_lengths=prompt_len_B,
            completion_lengths=ncomp,
            completion_mask=mask.astype(jnp.float32),
            logprobs=logprobs,
            page_ids=page_ids,
            top_logprobs=top,
            prompt_width=l,
        )


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
