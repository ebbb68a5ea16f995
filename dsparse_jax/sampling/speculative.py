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
from dsparse_jax.attention import dense
from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.model import draft_head, transformer
from dsparse_jax.parallel import sharding
from dsparse_jax.sampling import rejection
from dsparse_jax.sampling.sampler import (
    JittedCall,
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
    history_draft: str = "latest"  # history: a key of HISTORY_DRAFTS
    tree_width: int = 2  # history tree: nodes per depth (draft_tokens * tree_width nodes)
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
        if self.history_draft not in HISTORY_DRAFTS:
            raise ValueError(
                f"rl.history_draft: must be one of {tuple(HISTORY_DRAFTS)}, "
                f"got {self.history_draft!r}"
            )
        if self.history_draft != "latest" and self.draft != "history":
            raise ValueError("rl.history_draft: applies to rl.draft=history only")
        if self.tree_width < 1:
            raise ValueError("rl.tree_width must be >= 1")


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
    # A token tree instead of a chain (history tree): drafts are its nodes [B, N] (level
    # by level, `tree_width` per level), tree = (parent node index [B, N] (0: the row's
    # last token), valid [B, N]); num: its depth.
    tree: tuple | None = None


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


def _history_sources(ctx, x: DraftIn):
    """Every row's sources: its group's rows (itself included, their tokens so far) and its
    prompt's bank rows. (tokens [B, R, S], known lengths [B, R])."""
    hist, n = ctx["history"], ctx["cfg"].samples_per_prompt
    b, s = x.tokens.shape
    group = b // n
    src_BxRxS = jnp.repeat(x.tokens.reshape(group, n, s), n, axis=0)
    len_BxR = jnp.repeat(x.known.reshape(group, n), n, axis=0)
    if hist is not None:
        src_BxRxS = jnp.concatenate([src_BxRxS, jnp.repeat(hist.tokens, n, axis=0)], axis=1)
        len_BxR = jnp.concatenate([len_BxR, jnp.repeat(hist.lengths, n, axis=0)], axis=1)
    return src_BxRxS, len_BxR


def _match_lengths(x: DraftIn, src_BxRxS, m: int):
    """[B, R, S]: how many of each row's last m tokens (up to m) match the source tokens
    ending at each position."""
    b, s = x.tokens.shape
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
    return length


def _draft_history(ctx, x: DraftIn) -> DraftOut:
    """The history drafter, in its mode (`HISTORY_DRAFTS`, rl.history_draft)."""
    return HISTORY_DRAFTS[ctx["speculative_cfg"].history_draft].draft(ctx, x)


def _history_latest(ctx, x: DraftIn) -> DraftOut:
    """The longest suffix match of each row's last `ngram` tokens among its sources; the
    tokens after the match are the drafts (deterministic). Ties go to the match with the
    most tokens after it, then the latest."""
    k, m = ctx["speculative_cfg"].draft_tokens, ctx["speculative_cfg"].ngram
    b, s = x.tokens.shape
    src_BxRxS, len_BxR = _history_sources(ctx, x)
    length = _match_lengths(x, src_BxRxS, m)
    rows, pos = jnp.arange(b), jnp.arange(s)
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


def _continuations(ctx, x: DraftIn):
    """The continuations seen after each row's context, with their counts (SRT's per-prompt
    tree, implicit in the sources): every source position whose match with the row's last
    tokens is the longest found (>= 1 token) and which has tokens after it. Returns
    (tokens [B, C, k]: the k tokens after each (C = R * S positions), avail [B, C]: how many
    of them exist, weight [B, C]: 1 for a continuation, 0 otherwise)."""
    k, m = ctx["speculative_cfg"].draft_tokens, ctx["speculative_cfg"].ngram
    b, s = x.tokens.shape
    src_BxRxS, len_BxR = _history_sources(ctx, x)
    length = _match_lengths(x, src_BxRxS, m)
    avail = jnp.clip(len_BxR[..., None] - 1 - jnp.arange(s), 0, k)
    length = jnp.where(avail > 0, length, 0)
    longest_B = jnp.max(length, axis=(1, 2))
    weight = ((length == longest_B[:, None, None]) & (length > 0)).astype(jnp.float32)
    after = [
        jnp.pad(src_BxRxS[..., j + 1 :], ((0, 0), (0, 0), (0, j + 1)), constant_values=0)
        for j in range(k)
    ]
    tokens_BxCxK = jnp.stack(after, axis=-1).reshape(b, -1, k)
    return tokens_BxCxK, avail.reshape(b, -1), weight.reshape(b, -1)


def _count_levels(ctx, x: DraftIn, width: int, sample: bool):
    """Descends the continuation tree level by level, keeping `width` nodes per level:
    sample (width 1): a child drawn from q, the counts of the continuations through the
    drafts so far (truncated like p: top-k, top-p on the counts); otherwise the `width`
    children with the largest counts (most likely first). Returns (tokens [B, k, width],
    parent slot in the level above [B, k, width], valid [B, k, width], q [B, k, V] or None)."""
    cfg, k = ctx["cfg"], ctx["speculative_cfg"].draft_tokens
    cont_BxCxK, avail_BxC, w_BxC = _continuations(ctx, x)
    b, v = x.tokens.shape[0], ctx["model"].cfg.vocab_size
    rows = jnp.arange(b)[:, None]
    node_BxC = jnp.where(w_BxC > 0, 0, -1)  # the node each continuation follows (-1: none)
    keys = jax.random.split(x.key, k)
    counts_cfg = cfg if cfg.temperature == 0.0 else dataclasses.replace(cfg, temperature=1.0)
    toks, parents, valids, qs = [], [], [], []
    prev = 1
    for j in range(k):
        tok_BxC = cont_BxCxK[:, :, j]
        live_BxC = (node_BxC >= 0) & (avail_BxC > j)
        counts_BxPxV = jnp.zeros((b, prev, v), jnp.float32)
        counts_BxPxV = counts_BxPxV.at[rows, jnp.maximum(node_BxC, 0), tok_BxC].add(
            jnp.where(live_BxC, w_BxC, 0.0)
        )
        if sample:
            c_BxV = counts_BxPxV[:, 0]
            valid_BxW = (c_BxV.sum(-1) > 0)[:, None]
            # Counts as logits, truncated like p but not tempered: they are samples of the
            # policy at the rollout's temperature already.
            lg = jnp.where(c_BxV > 0, jnp.log(jnp.maximum(c_BxV, 1e-30)), -jnp.inf)
            lg = jnp.where(valid_BxW, lg, 0.0)
            tok_B, q = _draw(lg, keys[j], counts_cfg)
            tok_BxW = tok_B[:, None]
            if q is not None:
                qs.append(q)
            parent_BxW = jnp.zeros_like(tok_BxW)
        else:
            vals, idx = jax.lax.top_k(counts_BxPxV.reshape(b, prev * v), width)
            valid_BxW, parent_BxW, tok_BxW = vals > 0, idx // v, idx % v
        tok_BxW = tok_BxW.astype(jnp.int32)
        # Each continuation now follows the child it continues with, if one was kept.
        hit_BxCxW = (
            live_BxC[..., None]
            & valid_BxW[:, None]
            & (parent_BxW[:, None] == node_BxC[..., None])
            & (tok_BxW[:, None] == tok_BxC[..., None])
        )
        node_BxC = jnp.where(hit_BxCxW.any(-1), jnp.argmax(hit_BxCxW, axis=-1), -1)
        toks.append(tok_BxW)
        parents.append(parent_BxW)
        valids.append(valid_BxW)
        prev = tok_BxW.shape[1]
    q = jnp.stack(qs, axis=1) if qs else None
    return jnp.stack(toks, 1), jnp.stack(parents, 1), jnp.stack(valids, 1), q


def _history_counts(ctx, x: DraftIn) -> DraftOut:
    """A chain drawn from the continuation counts: draft j ~ q_j, the frequencies of the
    tokens that followed the context and drafts 1..j-1 in the sources (SRT's probabilistic
    draft); accepted with min(1, p / q)."""
    tok, _, valid, q = _count_levels(ctx, x, 1, sample=True)
    num = jnp.sum(valid[..., 0].astype(jnp.int32), axis=1)
    return DraftOut(tok[..., 0], q, num, x.caches, {})


def _history_tree(ctx, x: DraftIn) -> DraftOut:
    """A token tree: at every depth the `tree_width` continuations with the largest counts
    (siblings most likely first), each a deterministic draft, verified in one forward
    (`dense.Tree`) and accepted by `rejection.accept_tree`."""
    width = ctx["speculative_cfg"].tree_width
    tok, parent, valid, _ = _count_levels(ctx, x, width, sample=False)
    b, k = tok.shape[:2]
    # Node 1 + j * width + i: level j (depth j + 1); parents as node indices (0: root).
    level_start = jnp.concatenate([jnp.zeros(1, jnp.int32), 1 + jnp.arange(k - 1) * width])
    parent = parent + level_start[None, :, None]
    tree = (parent.reshape(b, -1).astype(jnp.int32), valid.reshape(b, -1))
    return DraftOut(tok.reshape(b, -1), None, jnp.sum(valid[..., 0], 1), x.caches, {}, tree=tree)


def tree_ancestors(parent_BxT, levels: int):
    """bool [B, T, T]: node u is an ancestor of node t, or t itself (parent_BxT[:, 0] = 0:
    the root)."""
    t = parent_BxT.shape[1]
    eye = jnp.eye(t, dtype=bool)[None]
    anc = jnp.broadcast_to(eye, parent_BxT.shape + (t,))
    for _ in range(levels):
        anc = eye | jnp.take_along_axis(anc, parent_BxT[..., None], axis=1)
    return anc


@dataclasses.dataclass(frozen=True)
class HistoryDraft:
    draft: Callable  # (ctx, DraftIn) -> DraftOut
    description: str


HISTORY_DRAFTS = {
    "latest": HistoryDraft(_history_latest, "the tokens after the latest longest match"),
    "counts": HistoryDraft(_history_counts, "a chain drawn from the continuation counts (q)"),
    "tree": HistoryDraft(_history_tree, "the likeliest continuations as a tree, one verify"),
}


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


# ------------------------------------------------------------------------------- verify
class _VerifyCtx(NamedTuple):
    model: object
    spec: AttentionSpec  # the cache's
    features: tuple | None  # policy layers the draft head reads (hidden outputs)
    cfg: SamplingConfig
    tree_width: int
    width: int  # the buffer's positions


class Verified(NamedTuple):
    """One verify's outcome, along the accepted path (a chain: the drafts themselves)."""

    logits: jax.Array  # f32 [B, k + 1, V]: the verifier's, after the last token and drafts
    logp: jax.Array  # f32 [B, k + 1, V]: the distributions sampled from (-inf outside)
    caches: list
    accepted: jax.Array  # int32 [B]: drafts accepted
    next: jax.Array  # int32 [B]: the replacement or bonus token
    drafts: jax.Array  # int32 [B, k]: the path's drafts (valid below accepted + 1)
    reached: jax.Array  # bool [B, k]: a draft at depth j + 1 was tested
    ok: jax.Array  # bool [B, k]: one was accepted there
    hidden: tuple | None  # the features' outputs [B, k + 1, D] (draft head)


def _verify_logp(logits_BxTxV, cfg: SamplingConfig):
    if cfg.temperature == 0.0:
        return jax.nn.log_softmax(logits_BxTxV, -1)
    return jax.vmap(lambda x: sampling_logprobs(x, cfg), in_axes=1, out_axes=1)(logits_BxTxV)


def _verify_chain(vc: _VerifyCtx, out: DraftOut, x_cur_Bx1, cur_B, limit_B, key) -> Verified:
    """One dense extend over [x_cur, d_1..d_k]; `rejection.accept`."""
    k = out.drafts.shape[1]
    num = jnp.clip(jnp.minimum(out.num, limit_B), 0, k)
    verify_in = jnp.concatenate([x_cur_Bx1, out.drafts], axis=1)
    ver = vc.model.extend(verify_in, cur_B, out.caches, vc.spec, hidden_at=vc.features)
    logp = _verify_logp(ver[0], vc.cfg)
    a, nxt, ok = rejection.accept(logp, out.drafts, out.probs, num, key, vc.cfg.temperature == 0)
    offs = jnp.arange(k)[None]
    reached = (offs < num[:, None]) & (offs <= a[:, None])
    hidden = ver[2] if vc.features is not None else None
    return Verified(ver[0], logp, ver[1], a, nxt, out.drafts, reached, ok, hidden)


def _verify_tree(vc: _VerifyCtx, out: DraftOut, x_cur_Bx1, cur_B, limit_B, key) -> Verified:
    """One dense extend over the tree [x_cur, nodes] (`dense.Tree`: each node at its depth,
    seeing its ancestors); `rejection.accept_tree`; the accepted path's keys and values
    moved to their positions (`kv_cache.move_path`)."""
    parent, valid = out.tree
    b, n = out.drafts.shape
    width = vc.tree_width
    depth_N = 1 + jnp.arange(n) // width
    slot_ok = cur_B[:, None] + 1 + jnp.arange(n)[None] < vc.width  # dropped past the buffer
    valid = valid & (depth_N[None] <= limit_B[:, None]) & slot_ok
    tokens = jnp.concatenate([x_cur_Bx1, out.drafts], axis=1)
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), parent], axis=1)
    valid = jnp.concatenate([jnp.ones((b, 1), bool), valid], axis=1)
    depth = jnp.broadcast_to(jnp.concatenate([jnp.zeros(1, jnp.int32), depth_N]), (b, n + 1))
    tree = dense.Tree(depth, tree_ancestors(parent, n // width))
    logits, caches = vc.model.extend(tokens, cur_B, out.caches, vc.spec, tree=tree)
    logp = _verify_logp(logits, vc.cfg)
    greedy = vc.cfg.temperature == 0
    a, path, nxt, reached, ok = rejection.accept_tree(
        logp, tokens, parent, valid, width, key, greedy
    )
    caches = [kv_cache.move_path(c, cur_B, path, a + 1) for c in caches]
    rows = jnp.arange(b)[:, None]
    drafts = tokens[rows, path[:, 1:]]
    return Verified(logits[rows, path], logp[rows, path], caches, a, nxt, drafts, reached, ok, None)


# ------------------------------------------------------------------------------- engine
class SpeculativeSampler(JittedCall):
    """Speculative rollouts of the dense policy theta. Build once per model graph:

    sampler(state, prompts_BxL, prompt_lengths_B, key, cfg, speculative_cfg, draft_spec,
    lora, lora_scale, history, return_cache, head) (`_bind`): (Rollout of B *
    samples_per_prompt rows, SpeculativeStats[, the final KV cache when return_cache])."""

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
        vctx = _VerifyCtx(model, cache_spec, features, cfg, speculative_cfg.tree_width, s)

        def body(st):
            key, caches, tokens, logprobs, top, ncomp, done, page_ids, draft_rec, stats, head_st = (
                st
            )
            key, k_draft, k_acc = jax.random.split(key, 3)
            cur = prompt_len_B + ncomp - 1  # each row's last token
            out = drafter.draft(ctx, DraftIn(tokens, cur, cur + 1, caches, k_draft, head_st))
            # Drafts a row may still emit: at most max_new_tokens - ncomp - 1.
            limit = jnp.where(done, 0, cfg.max_new_tokens - ncomp - 1)
            x_cur = tokens[rows, cur][:, None]
            verify = _verify_chain if out.tree is None else _verify_tree
            ver = verify(vctx, out, x_cur, cur, limit, k_acc)
            logits, logp, caches, a, nxt = ver.logits, ver.logp, ver.caches, ver.accepted, ver.next
            drafts_pad = jnp.concatenate([ver.drafts, ver.drafts[:, :1]], axis=1)
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
            stats = SpeculativeStats(
                stats.verify_calls + live_row,
                stats.emitted + n_new,
                stats.reached + ver.reached.sum(0),
                stats.accepted + (ver.reached & ver.ok).sum(0),
                stats.iterations + 1,
            )
            if drafter.learned_head:  # tokens at cur..cur+k: x_cur, then the emitted ones
                fed_tokens = jnp.concatenate([x_cur, new[:, :k]], axis=1)
                head_st = _head_observe(ctx, out.head, ver.hidden, fed_tokens, cur, n_new)
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
