"""Lossless speculative rollouts: a drafter proposes, the dense policy verifies.

One jitted `lax.while_loop`; each iteration, for every live row whose last token x_c sits
at position c (its K/V not yet in the cache):

  draft    up to k tokens d_1..d_k (`DRAFTERS`: `sparse_self`, `history` or `draft_head`);
  verify   one dense `Transformer.extend` over [x_c, d_1..d_k] at positions c..c+k: writes
           their K/V and returns the verifier's distributions p_0..p_k;
  accept   `rejection.accept` keeps a prefix d_1..d_a and draws one more token (the
           replacement at the first rejection, or the bonus), so a row advances by a + 1;
  clean    the K/V written at c+a+1..c+k belong to rejected tokens: nothing reads them
           (attention is causal and the next verify overwrites them before attending),
           and the page summaries of the pages around c..c+k are recomputed from the
           accepted keys only (`cache.refresh_summaries`).

Every emitted token is an exact sample of the dense policy's (temperature, top-k, top-p
truncated) distribution, and `logprobs` are the dense policy's, from the verify's logits:
the output is a `Rollout` exactly like `Sampler`'s for the dense policy. A row ends at an
EOS inside the accepted tokens or at max_new_tokens; drafts are clamped to the tokens a
row may still emit (num_drafts <= remaining - 1), which also keeps every accepted write
inside the buffer (positions past it are dropped).

Drafters (a table, `DRAFTERS`):
  sparse_self  the same theta with block-sparse attention and the LoRA adapter phi (the
               DistillSparse actor; MagicDec / TriForce style self-speculation). It has no
               cache of its own: step j feeds its token at c + j through the sparse(+phi)
               model reading the verifier's cache, i.e. the dense theta K/V of every
               verified position (< c) on the pages it selects, plus its own provisional
               K/V at c..c+j, written into the same cache and overwritten by the verify.
               Cheap: no second cache, no draft prefill, and each draft step reads only
               budget pages per sparse layer.
  history      model-free (SRT, suffix decoding): the longest suffix match of the row's
               last `ngram` tokens in earlier completions of the same prompt (from earlier
               RL steps, `HistoryBank`), in its siblings of the current group (their tokens
               so far) and in its own context proposes the tokens that followed it. A
               deterministic draft (no q). All on device, inside the loop.
  draft_head   a learned head (model/draft_head.py; EAGLE-3 / NeMo-RL) on the policy's
               features at an early, a middle and the last layer: its own parameters and
               KV cache (filled at prefill from the prompt's features; after each verify
               its entries at c..c+k are rewritten from the policy's true features), k
               autoregressive steps, sampled from its truncated q. Trained online during
               RL (train/draft_head.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.model import draft_head, transformer
from dsparse_jax.parallel import sharding
from dsparse_jax.sampling import rejection
from dsparse_jax.sampling.sampler import (
    Rollout,
    SamplingConfig,
    buffer_length,
    is_stop,
    sample_token,
    sampling_logprobs,
    scaled_logits,
    top_logprobs,
)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    draft: str = "sparse_self"  # a key of DRAFTERS
    draft_tokens: int = 4  # k: tokens drafted per verify
    ngram: int = 4  # history: the longest suffix matched
    # sparse_self: one more draft step per iteration so that every decoded position has a
    # page record (Rollout.page_ids), and each position's draft-block start and each
    # accepted draft's log q (Rollout.draft_start / draft_logprobs): what the phi update's
    # teacher-forced twin of the drafter replays (Transformer.forward(draft_start=...)).
    record_pages: bool = False

    def __post_init__(self):
        if self.draft not in DRAFTERS:
            raise ValueError(f"rl.draft: must be one of {tuple(DRAFTERS)}, got {self.draft!r}")
        if self.draft_tokens < 1:
            raise ValueError("rl.draft_tokens must be >= 1")
        if self.ngram < 1:
            raise ValueError("rl.history_ngram must be >= 1")


class History(NamedTuple):
    """Earlier completions of each prompt of the batch (the history drafter's bank rows):
    tokens int32 [P, H, S] (prompt + completion, the rollout's layout and width) and their
    lengths int32 [P, H] (0: an empty slot)."""

    tokens: jax.Array
    lengths: jax.Array


class SpeculativeStats(NamedTuple):
    """Per-rollout counters (device arrays)."""

    verify_calls: jax.Array  # int32 [B]: verify iterations in which the row was live
    emitted: jax.Array  # int32 [B]: tokens emitted by those iterations (completion - 1)
    reached: jax.Array  # int32 [k]: drafts that were tested (all earlier ones accepted)
    accepted: jax.Array  # int32 [k]: of those, accepted
    iterations: jax.Array  # int32 []: loop iterations (the slowest row's verify calls)


# ----------------------------------------------------------------------------- drafters
class DraftIn(NamedTuple):
    """What a drafter sees at one iteration."""

    tokens: jax.Array  # int32 [B, S], the rows so far
    cur: jax.Array  # int32 [B], position of each row's last token (not yet in the cache)
    known: jax.Array  # int32 [B], tokens known per row (= cur + 1)
    caches: list
    key: jax.Array
    head: tuple | None = None  # draft_head: (its KV cache, g [B, D] at position cur)


class DraftOut(NamedTuple):
    drafts: jax.Array  # int32 [B, k]
    probs: jax.Array | None  # f32 [B, k, V] (truncated q), None: deterministic / greedy
    num: jax.Array  # int32 [B]: how many leading drafts are real (<= k)
    caches: list
    pages: dict  # {sparse layer: int32 [B, k', K, P]}: pages read at positions cur + j
    head: tuple | None = None  # draft_head: its cache after the draft steps


def draft_probs(logits_BxV, cfg: SamplingConfig):
    """q: the drafter's distribution, truncated like the verifier's p (a draft token is
    drawn from it)."""
    return jax.nn.softmax(scaled_logits(logits_BxV, cfg), axis=-1)


def _draw(logits_BxV, key, cfg: SamplingConfig):
    """A draft token from the drafter's logits and its truncated distribution q (greedy:
    the argmax, no q)."""
    if cfg.temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32), None
    d_B = jax.random.categorical(key, scaled_logits(logits_BxV, cfg), axis=-1)
    return d_B.astype(jnp.int32), draft_probs(logits_BxV, cfg)


def _draft_sparse_self(ctx, x: DraftIn) -> DraftOut:
    """k (+1 with record_pages) autoregressive steps of the sparse(+phi) model over the
    verifier's cache, sampling from its own truncated distribution q."""
    model, spec, cfg, sc = ctx["draft_model"], ctx["draft_spec"], ctx["cfg"], ctx["speculative_cfg"]
    k, s = sc.draft_tokens, x.tokens.shape[1]
    steps = k + 1 if sc.record_pages else k
    rows = jnp.arange(x.tokens.shape[0])
    sparse = transformer.sparse_layers(model.cfg, spec)

    def step(carry, j):
        tok_B, caches, key = carry
        pos_B = jnp.minimum(x.cur + j, s - 1)
        logits, caches, ids = model.decode(tok_B, pos_B, caches, spec, **ctx["draft_run"])
        key, sub = jax.random.split(key)
        d_B, q = _draw(logits, sub, cfg)
        return (d_B, caches, key), (d_B, q, {i: ids[i] for i in sparse})

    x_c = x.tokens[rows, x.cur]
    (_, caches, _), (d, q, ids) = jax.lax.scan(step, (x_c, x.caches, x.key), jnp.arange(steps))
    drafts = d[:k].T
    probs = None if q is None else q[:k].transpose(1, 0, 2)
    pages = {i: v.transpose(1, 0, 2, 3) for i, v in ids.items()}
    return DraftOut(drafts, probs, jnp.full_like(x.cur, k), caches, pages)


def _draft_head(ctx, x: DraftIn) -> DraftOut:
    """k autoregressive steps of the learned draft head (model/draft_head.py) on its own
    cache: step 0 feeds (g of position cur - 1's policy features, x_cur), step j > 0 the
    head's own output and its draft d_j. Samples from its truncated distribution q."""
    head, model, cfg = ctx["head"], ctx["model"], ctx["cfg"]
    k, s = ctx["speculative_cfg"].draft_tokens, x.tokens.shape[1]
    cache, g_BxD = x.head
    embed = model.unembedding()

    def step(carry, j):
        tok_B, g_B, cache, key = carry
        pos_B = jnp.minimum(x.cur + j, s - 1)
        h, cache = head(
            g_B[:, None], model.embed_tokens(tok_B[:, None]), "decode", cache=cache, pos_B=pos_B
        )
        key, sub = jax.random.split(key)
        d_B, q = _draw(head.logits(h[:, 0], embed), sub, cfg)
        return (d_B, h[:, 0], cache, key), (d_B, q)

    x_c = x.tokens[jnp.arange(x.tokens.shape[0]), x.cur]
    (_, _, cache, _), (d, q) = jax.lax.scan(step, (x_c, g_BxD, cache, x.key), jnp.arange(k))
    probs = None if q is None else q.transpose(1, 0, 2)
    return DraftOut(d.T, probs, jnp.full_like(x.cur, k), x.caches, {}, (cache, g_BxD))


def _head_prefill(ctx, prompts_BxL, prompt_len_B, hiddens, s: int):
    """The head's cache over the prompt (teacher-forced, the policy's features at every
    prompt position) and g of the first generated position (prompt_len)."""
    head, model = ctx["head"], ctx["model"]
    g_BxLxD = head.feature(hiddens)
    cache = sharding.constrain_cache([head.init_cache(prompts_BxL.shape[0], s)])[0]
    _, cache = head(
        draft_head.shifted_features(g_BxLxD),
        model.embed_tokens(prompts_BxL),
        "prefill",
        cache=cache,
        lengths_B=prompt_len_B,
    )
    rows = jnp.arange(prompts_BxL.shape[0])
    return cache, g_BxLxD[rows, prompt_len_B - 1]


def _head_observe(ctx, head_state, hiddens, tokens_BxT, cur_B, n_new_B):
    """After a verify over positions cur..cur+k: the head's cache entries at those positions
    rewritten from the policy's true features (its draft steps wrote its own outputs
    there; entries past the accepted tokens are overwritten before they are read), and g
    of the row's new last token (position cur + n_new) from the policy's features at
    cur + n_new - 1."""
    head, model = ctx["head"], ctx["model"]
    cache, g_BxD = head_state
    feats = head.feature(hiddens)  # [B, k + 1, D]: the features of positions cur..cur+k
    g_in = jnp.concatenate([g_BxD[:, None], feats[:, :-1]], axis=1)
    _, cache = head(g_in, model.embed_tokens(tokens_BxT), "extend", cache=cache, pos_B=cur_B)
    rows = jnp.arange(cur_B.shape[0])
    return cache, feats[rows, jnp.maximum(n_new_B - 1, 0)]


def _draft_history(ctx, x: DraftIn) -> DraftOut:
    """The longest suffix match of each row's last `ngram` tokens among its group's rows
    (itself included) and its prompt's bank rows; the tokens after the match are the
    drafts. Ties go to the match with the most tokens after it, then the latest."""
    sc, hist, n = ctx["speculative_cfg"], ctx["history"], ctx["cfg"].samples_per_prompt
    k, m = sc.draft_tokens, sc.ngram
    b, s = x.tokens.shape
    group = b // n
    src_BxRxS = jnp.repeat(x.tokens.reshape(group, n, s), n, axis=0)
    len_BxR = jnp.repeat(x.known.reshape(group, n), n, axis=0)
    if hist is not None:
        src_BxRxS = jnp.concatenate([src_BxRxS, jnp.repeat(hist.tokens, n, axis=0)], axis=1)
        len_BxR = jnp.concatenate([len_BxR, jnp.repeat(hist.lengths, n, axis=0)], axis=1)
    rows = jnp.arange(b)
    query_BxM = x.tokens[rows[:, None], jnp.maximum(x.cur[:, None] - jnp.arange(m), 0)]
    pos = jnp.arange(s)
    run = jnp.ones(src_BxRxS.shape, jnp.int32)  # still matching after i tokens
    length = jnp.zeros(src_BxRxS.shape, jnp.int32)  # match length ending at each position
    for i in range(m):  # src[e - i] == query[i]
        shifted = jnp.pad(src_BxRxS, ((0, 0), (0, 0), (i, 0)), constant_values=-1)[..., :s]
        ok = (shifted == query_BxM[:, None, i : i + 1]) & (pos >= i) & (x.cur[:, None, None] >= i)
        run = run * ok
        length = length + run
    cont = jnp.clip(len_BxR[..., None] - 1 - pos, 0, k)  # tokens after the match, <= k
    # The longest match; among those, the most tokens to propose; then the latest.
    score = jnp.where((cont > 0) & (length > 0), (length * (k + 1) + cont) * (s + 1) + pos, -1)
    best = jnp.argmax(score.reshape(b, -1), axis=-1)
    r, e = best // s, best % s
    found = score.reshape(b, -1)[rows, best] >= 0
    take = jnp.minimum(e[:, None] + 1 + jnp.arange(k), s - 1)
    drafts = src_BxRxS[rows[:, None], r[:, None], take]
    num = jnp.where(found, cont.reshape(b, -1)[rows, best], 0)
    return DraftOut(drafts.astype(jnp.int32), None, num.astype(jnp.int32), x.caches, {})


@dataclasses.dataclass(frozen=True)
class Drafter:
    draft: Callable  # (ctx, DraftIn) -> DraftOut
    uses_phi: bool  # applies the LoRA adapter phi (the DistillSparse actor)
    sparse: bool  # decodes with block-sparse attention (its cache keeps page summaries)
    description: str
    learned_head: bool = False  # reads the policy's features; carries the head's own cache


DRAFTERS = {
    "sparse_self": Drafter(
        _draft_sparse_self, True, True, "the sparse + LoRA actor (theta + phi) drafts"
    ),
    "history": Drafter(
        _draft_history, False, False, "suffix match in earlier rollouts of the prompt"
    ),
    "draft_head": Drafter(
        _draft_head,
        False,
        False,
        "a learned head on the policy's features (EAGLE-3 / NeMo-RL), trained online",
        learned_head=True,
    ),
}


# ------------------------------------------------------------------------------- engine
class SpeculativeSampler:
    """Speculative rollouts of the dense policy theta. Build once per model graph."""

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._jitted = jax.jit(
            self._sample,
            static_argnames=(
                "cfg",
                "speculative_cfg",
                "draft_spec",
                "lora_scale",
                "return_cache",
                "head_graphdef",
            ),
        )

    def __call__(self, *args, **kwargs):
        """sampler(state, prompts_BxL, prompt_lengths_B, key, cfg, speculative_cfg, draft_spec,
        lora, lora_scale, history, return_cache, head) (`_bind`): (Rollout of B *
        samples_per_prompt rows, SpeculativeStats[, the final KV cache when return_cache])."""
        args, kwargs = self._bind(*args, **kwargs)
        return self._jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """jax's Lowered of the call with these arguments: `.compile()` compiles it ahead of
        time (the call then reuses the executable)."""
        args, kwargs = self._bind(*args, **kwargs)
        return self._jitted.lower(*args, **kwargs)

    def _bind(
        self,
        state,
        prompts_BxL,
        prompt_lengths_B,
        key,
        cfg: SamplingConfig,
        speculative_cfg: SpeculativeConfig,
        draft_spec: AttentionSpec = AttentionSpec(),
        lora=None,
        lora_scale: float = 1.0,
        history: History | None = None,
        return_cache: bool = False,
        head=None,
    ):
        """The jitted function's (args, kwargs) of a call: (Rollout of B *
        samples_per_prompt rows, SpeculativeStats[, the final KV cache when return_cache]).
        draft_spec: the sparse drafter's attention (its page_size is the
        cache's); lora: phi, for sparse_self; history: bank rows of the batch's prompts
        [P, H, S], for history (optional); head: (graphdef, state) of the learned draft
        head (model/draft_head.py), for draft_head."""
        if DRAFTERS[speculative_cfg.draft].learned_head and head is None:
            raise ValueError("the draft_head drafter needs head=(graphdef, state)")
        head_graphdef, head_state = head if head is not None else (None, None)
        if cfg.grow_buffer_from:
            raise ValueError("speculative rollouts use one cache buffer: grow_buffer_from=0")
        lengths = jnp.asarray(prompt_lengths_B, jnp.int32)
        if prompts_BxL.shape[0] != lengths.shape[0]:
            raise ValueError("prompts and prompt_lengths disagree on the batch size")
        s = buffer_length(prompts_BxL.shape[1], cfg.max_new_tokens, draft_spec.page_size)
        if history is not None and history.tokens.shape[::2] != (lengths.shape[0], s):
            raise ValueError(f"history tokens must be [P={lengths.shape[0]}, H, S={s}]")
        args = (state, jnp.asarray(prompts_BxL, jnp.int32), lengths, key, lora, history, head_state)
        return args, dict(
            cfg=cfg,
            speculative_cfg=speculative_cfg,
            draft_spec=draft_spec,
            lora_scale=lora_scale,
            return_cache=return_cache,
            head_graphdef=head_graphdef,
        )

    def _sample(
        self,
        state,
        prompts_BxL,
        prompt_len_B,
        key,
        lora,
        history,
        head_state,
        *,
        cfg,
        speculative_cfg,
        draft_spec,
        lora_scale,
        return_cache=False,
        head_graphdef=None,
    ):
        drafter = DRAFTERS[speculative_cfg.draft]
        model = nnx.merge(self.graphdef, state)
        ctx = dict(cfg=cfg, speculative_cfg=speculative_cfg, history=history, model=model)
        features = None  # the policy layers the draft head reads
        if drafter.learned_head:
            ctx["head"] = nnx.merge(head_graphdef, head_state)
            features = ctx["head"].layers
        if drafter.uses_phi or drafter.sparse:
            # Its own copy of the state's variables: merge_lora writes into them in place.
            draft_model = nnx.merge(self.graphdef, jax.tree.map(lambda x: x, state))
            merged = draft_model.merge_lora(lora, lora_scale) if drafter.uses_phi else True
            ctx.update(
                draft_model=draft_model,
                draft_spec=draft_spec,
                draft_run=dict(lora=None if merged else lora, lora_scale=lora_scale),
            )
        # The cache carries page summaries where the drafter selects pages; the verifier
        # (extend) is dense and never reads them.
        cache_spec = draft_spec if drafter.sparse else AttentionSpec(page_size=draft_spec.page_size)
        n, k = cfg.samples_per_prompt, speculative_cfg.draft_tokens
        b0, l = prompts_BxL.shape
        s = buffer_length(l, cfg.max_new_tokens, cache_spec.page_size)
        caches = sharding.constrain_cache(model.init_cache(b0, s, cache_spec))
        out = model.prefill(prompts_BxL, prompt_len_B, caches, cache_spec, hidden_at=features)
        logits, caches = out[:2]
        head_st = None  # draft_head: (its cache, g of each row's last token)
        if drafter.learned_head:
            head_st = _head_prefill(ctx, prompts_BxL, prompt_len_B, out[2], s)
        if n > 1:  # one prefill serves the n samples of each prompt
            rep = lambda x: jnp.repeat(x, n, axis=0)
            logits, caches = rep(logits), sharding.constrain_cache(jax.tree.map(rep, caches))
            prompts_BxL, prompt_len_B = rep(prompts_BxL), rep(prompt_len_B)
            head_st = jax.tree.map(rep, head_st)
        b = b0 * n
        rows = jnp.arange(b)
        greedy = cfg.temperature == 0.0

        tokens = jnp.full((b, s), cfg.pad_id, jnp.int32).at[:, :l].set(prompts_BxL)
        tokens = jnp.where(jnp.arange(s)[None] < prompt_len_B[:, None], tokens, cfg.pad_id)
        key, sub = jax.random.split(key)
        tok, lp = sample_token(logits, sub, cfg)
        tokens = tokens.at[rows, prompt_len_B].set(tok)
        logprobs = jnp.zeros((b, s), jnp.float32).at[rows, prompt_len_B].set(lp)
        top = None
        if cfg.top_logprobs:
            top = tuple(
                jnp.zeros((b, s) + x.shape[1:], x.dtype).at[rows, prompt_len_B].set(x)
                for x in top_logprobs(logits, cfg)
            )
        sparse = transformer.sparse_layers(model.cfg, cache_spec) if drafter.sparse else []
        kv, p = model.cfg.num_kv_heads, cache_spec.sparse.max_pages if sparse else 0
        page_ids, draft_rec = {}, {}
        if speculative_cfg.record_pages:
            page_ids = {i: jnp.full((b, s, kv, p), -1, jnp.int32) for i in sparse}
            draft_rec = {
                "start": jnp.full((b, s), -1, jnp.int32),
                "logq": jnp.zeros((b, s), jnp.float32),
            }
        ncomp = jnp.ones((b,), jnp.int32)
        done = is_stop(tok, cfg) | (cfg.max_new_tokens <= 1)
        stats = SpeculativeStats(
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((b,), jnp.int32),
            jnp.zeros((k,), jnp.int32),
            jnp.zeros((k,), jnp.int32),
            jnp.int32(0),
        )
        offs = jnp.arange(k + 1)[None]  # [1, k + 1]

        def body(st):
            key, caches, tokens, logprobs, top, ncomp, done, page_ids, draft_rec, stats, head_st = (
                st
            )
            key, k_draft, k_acc = jax.random.split(key, 3)
            cur = prompt_len_B + ncomp - 1  # each row's last token
            out = drafter.draft(ctx, DraftIn(tokens, cur, cur + 1, caches, k_draft, head_st))
            remaining = cfg.max_new_tokens - ncomp
            num = jnp.where(done, 0, jnp.clip(jnp.minimum(out.num, remaining - 1), 0, k))
            x_cur = tokens[rows, cur][:, None]
            verify_in = jnp.concatenate([x_cur, out.drafts], axis=1)
            ver = model.extend(verify_in, cur, out.caches, cache_spec, hidden_at=features)
            logits, caches = ver[:2]
            logp = (
                jax.nn.log_softmax(logits, -1)
                if greedy
                else jax.vmap(lambda x: sampling_logprobs(x, cfg), in_axes=1, out_axes=1)(logits)
            )
            a, nxt, ok = rejection.accept(logp, out.drafts, out.probs, num, k_acc, greedy)
            drafts_pad = jnp.concatenate([out.drafts, out.drafts[:, :1]], axis=1)
            new = jnp.where(offs < a[:, None], drafts_pad, nxt[:, None])  # valid at j <= a
            is_eos = is_stop(new, cfg) & (offs <= a[:, None])
            n_new = jnp.where(is_eos.any(1), jnp.argmax(is_eos, axis=1) + 1, a + 1)
            n_new = jnp.where(done, 0, n_new)
            live = offs < n_new[:, None]
            write = jnp.where(live, cur[:, None] + 1 + offs, s)  # s: dropped
            tokens = tokens.at[rows[:, None], write].set(new, mode="drop")
            lp_new = jnp.take_along_axis(logp, new[..., None], -1)[..., 0]
            logprobs = logprobs.at[rows[:, None], write].set(lp_new, mode="drop")
            if top is not None:
                vals, ids = top_logprobs(logits, cfg)
                top = (
                    top[0].at[rows[:, None], write].set(vals, mode="drop"),
                    top[1].at[rows[:, None], write].set(ids, mode="drop"),
                )
            fed = jnp.where(live, cur[:, None] + offs, s)  # positions fed to the drafter
            page_ids = {
                i: ids.at[rows[:, None], fed[:, : out.pages[i].shape[1]]].set(
                    out.pages[i], mode="drop"
                )
                for i, ids in page_ids.items()
            }
            if draft_rec:  # each fed position's block start; log q of each accepted draft
                start = jnp.broadcast_to(cur[:, None], fed.shape)
                draft_rec = dict(
                    draft_rec,
                    start=draft_rec["start"].at[rows[:, None], fed].set(start, mode="drop"),
                )
                if out.probs is not None:
                    q = jnp.take_along_axis(out.probs, out.drafts[..., None], -1)[..., 0]
                    took = (offs[:, :k] < a[:, None]) & live[:, :k]
                    at = jnp.where(took, cur[:, None] + 1 + offs[:, :k], s)
                    draft_rec["logq"] = (
                        draft_rec["logq"].at[rows[:, None], at].set(jnp.log(q), mode="drop")
                    )
            if drafter.sparse:  # rejected entries leave the page summaries
                caches = [
                    kv_cache.refresh_summaries(
                        c, cur, k + 1, cur + n_new, transformer.layer_info(model.cfg, i), cache_spec
                    )
                    for i, c in enumerate(caches)
                ]
            live_row = ~done
            reached = (offs[:, :k] < num[:, None]) & (offs[:, :k] <= a[:, None])
            stats = SpeculativeStats(
                stats.verify_calls + live_row,
                stats.emitted + n_new,
                stats.reached + reached.sum(0),
                stats.accepted + (reached & ok).sum(0),
                stats.iterations + 1,
            )
            if drafter.learned_head:  # tokens at cur..cur+k: x_cur, then the emitted ones
                fed_tokens = jnp.concatenate([x_cur, new[:, :k]], axis=1)
                head_st = _head_observe(ctx, out.head, ver[2], fed_tokens, cur, n_new)
            ncomp = ncomp + n_new
            done = done | is_eos.any(1) | (ncomp >= cfg.max_new_tokens)
            return (
                key,
                caches,
                tokens,
                logprobs,
                top,
                ncomp,
                done,
                page_ids,
                draft_rec,
                stats,
                head_st,
            )

        st = (key, caches, tokens, logprobs, top, ncomp, done, page_ids, draft_rec, stats, head_st)
        st = jax.lax.while_loop(lambda st: ~jnp.all(st[6]), body, st)
        _, caches, tokens, logprobs, top, ncomp, _, page_ids, draft_rec, stats, _ = st
        pos = jnp.arange(s)[None]
        mask = (pos >= prompt_len_B[:, None]) & (pos < (prompt_len_B + ncomp)[:, None])
        rollout = Rollout(
            tokens=tokens,
            prompt_lengths=prompt_len_B,
            completion_lengths=ncomp,
            completion_mask=mask.astype(jnp.float32),
            logprobs=logprobs,
            page_ids=page_ids,
            top_logprobs=top,
            draft_start=draft_rec.get("start"),
            draft_logprobs=draft_rec.get("logq"),
            prompt_width=l,
        )
        return (rollout, stats, caches) if return_cache else (rollout, stats)


@functools.partial(jax.jit, static_argnames=("k",))
def acceptance_summary(stats: SpeculativeStats, k: int) -> dict:
    """Scalar metrics of one speculative rollout: tokens per verify (acceptance length,
    the bonus / replacement token included), acceptance rate per draft position."""
    calls = jnp.maximum(stats.verify_calls.sum(), 1)
    out = {
        "spec_accept_length": stats.emitted.sum() / calls,
        "spec_verify_calls": stats.verify_calls.sum(),
        "spec_iterations": stats.iterations,
    }
    rate = stats.accepted / jnp.maximum(stats.reached, 1)
    for j in range(k):
        out[f"spec_accept_rate_{j + 1}"] = rate[j]
    return out
