"""Speculative rollouts are exact samples of the dense policy.

- Greedy: token for token the plain greedy sampler's output, for every drafter, with
  ragged prompts and an EOS that lands inside accepted drafts; log-probs equal the
  plain sampler's and the dense teacher-forced ones (1e-4).
- Distribution: at temperature 1, with and without top-k / top-p, the sequences of 3
  tokens over a 5-token vocabulary follow the dense policy's exact probabilities
  (chi-square over all 125 sequences, cells expecting < 5 pooled, at p = 1e-4), for every
  drafter and history mode (latest, counts-q chain, tree); planted bugs (the rejected token
  left in the residual, a rejected tree sibling left in it, a tree node that sees a
  non-ancestor, q reported without its truncation, every draft accepted) fail the same
  test.
- Tree verify: each node's logits equal a dense forward of its path (1e-4); the cache
  after the accepted path is moved equals a dense prefill (1e-5).
- Cache: after rejections the KV cache and the page summaries equal a dense prefill of
  the accepted tokens (1e-5).
- The learned draft head: its loss falls on a fixed batch; its prefill + decode logits
  equal its teacher-forced ones; after a verify its cache and its input feature g equal
  the teacher-forced ones over the true policy features (1e-5); trained on the policy's
  greedy rows, its first drafts are accepted > 90% of the time.

One small all-global model (3 layers, 2 KV heads, layers 1-2 sparse on 4-token pages).
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_utils import random_params

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.model import config as C
from dsparse_jax.model import draft_head
from dsparse_jax.model import lora as lora_lib
from dsparse_jax.sampling import rejection
from dsparse_jax.sampling import speculative as SP
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig, sampling_logprobs
from dsparse_jax.train import draft_head as draft_head_train

_ACCEPT = rejection.accept  # the real one, for the planted-bug wrappers

LP_TOL = 1e-4
VOCAB, EOS, PAD = 32, 1, 0
CFG = C.mini(vocab_size=VOCAB).replace(
    d_model=32, head_dim=8, mlp_dim=64, num_layers=3, num_heads=4, num_kv_heads=2
)
DENSE = AttentionSpec(page_size=4)
SPARSE = AttentionSpec(
    page_size=4, sparse=SparseSpec(budget=3, sink_pages=1, recent_pages=1, dense_layers=1)
)
LENGTHS = np.array([7, 3, 5])
PROMPTS = np.random.default_rng(0).integers(2, VOCAB, (3, 7))
PROMPTS = np.where(np.arange(7) < LENGTHS[:, None], PROMPTS, PAD)
MAX_NEW = 24


@pytest.fixture(scope="module")
def model():
    graphdef, state = random_params(CFG, seed=1, embed_std=3.0)
    phi = lora_lib.init_lora(CFG, lora_lib.LoRAConfig(rank=2), jax.random.key(5))
    rng = np.random.default_rng(6)
    phi = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.3, x.dtype), phi)
    return graphdef, state, phi


# Test ids of the drafters: the history drafter's modes (rl.history_draft) are their own.
HISTORY_IDS = {"history": "latest", "history_counts": "counts", "history_tree": "tree"}
ALL_DRAFTS = ["sparse_self", *HISTORY_IDS, "draft_head"]


def _speculative_cfg(draft, draft_tokens=3, **kw):
    if draft in HISTORY_IDS:
        kw.update(draft="history", history_draft=HISTORY_IDS[draft])
    else:
        kw.update(draft=draft)
    return SP.SpeculativeConfig(draft_tokens=draft_tokens, **kw)


def _teacher_logprobs(graphdef, state, tokens_BxS, cfg):
    """Dense teacher-forced log-prob of each token (entry s: log p(token s)) under cfg."""
    from flax import nnx

    logits = nnx.merge(graphdef, state).forward(jnp.asarray(tokens_BxS), DENSE)[:, :-1]
    logp = jax.vmap(lambda x: sampling_logprobs(x, cfg), in_axes=1, out_axes=1)(logits)
    lp = jnp.take_along_axis(logp, jnp.asarray(tokens_BxS)[:, 1:, None], -1)[..., 0]
    return np.pad(np.asarray(lp), ((0, 0), (1, 0)))


def _eos_inside(graphdef, state):
    """An EOS id that ends some greedy rows early: the token plain greedy decoding emits
    mid-completion in row 0."""
    cfg = SamplingConfig(MAX_NEW, VOCAB + 1, PAD, temperature=0.0)  # no EOS
    r = Sampler(graphdef)(state, PROMPTS, LENGTHS, jax.random.key(0), cfg, DENSE)
    return int(np.asarray(r.tokens)[0, LENGTHS[0] + MAX_NEW // 3])


def _train_head(graphdef, state, tokens, mask, steps=60, layers=None):
    """A draft head trained on the policy's own rows (soft CE against its distribution)."""
    layers = layers or draft_head.default_layers(CFG.num_layers)
    hg, hs = draft_head.create(CFG, draft_head.DraftHeadConfig(layers), jax.random.key(3))
    tx = draft_head_train.make_tx(3e-3, 1.0)
    hs, _, m = draft_head_train.draft_head_update(
        hs,
        tx.init(hs),
        {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask)},
        state,
        graphdef=graphdef,
        head_graphdef=hg,
        layers=layers,
        tx=tx,
        steps=steps,
    )
    return (hg, hs), {k: float(v) for k, v in m.items()}


@pytest.fixture(scope="module")
def trained_head(model):
    """The head trained on plain greedy rollouts of `model` (no EOS: full-length rows)."""
    graphdef, state, _ = model
    cfg = SamplingConfig(MAX_NEW, VOCAB + 1, PAD, temperature=0.0, samples_per_prompt=2)
    r = Sampler(graphdef)(state, PROMPTS, LENGTHS, jax.random.key(0), cfg, DENSE)
    return _train_head(graphdef, state, r.tokens, r.completion_mask)


def test_draft_head_loss_falls_on_a_fixed_batch(trained_head):
    _, m = trained_head
    assert m["loss_after"] < 0.5 * m["loss"], m  # 60 Adam steps on one batch
    assert m["kl_after"] < 0.05 and m["top1_agree_after"] > 0.95, m
    assert m["top1_agree"] < 0.5  # the untrained head disagreed


@pytest.mark.parametrize("draft", ALL_DRAFTS)
def test_greedy_equals_plain_greedy(model, trained_head, draft):
    graphdef, state, phi = model
    eos = _eos_inside(graphdef, state)
    cfg = SamplingConfig(MAX_NEW, eos, PAD, temperature=0.0, samples_per_prompt=2, top_logprobs=2)
    plain = Sampler(graphdef)(state, PROMPTS, LENGTHS, jax.random.key(0), cfg, DENSE)
    ncomp = np.asarray(plain.completion_lengths)
    assert (ncomp < MAX_NEW).any() and (ncomp == MAX_NEW).any()  # EOS ends some rows early

    history = None
    if draft in HISTORY_IDS:  # the bank holds one earlier (here: the same) rollout per prompt
        rows = np.asarray(plain.tokens)[::2]
        lengths = np.asarray(plain.lengths)[::2]
        history = SP.History(jnp.asarray(rows[:, None]), jnp.asarray(lengths[:, None]))
    spec = SPARSE if draft == "sparse_self" else DENSE
    # The history run names the stop token in stop_ids instead of eos_id (a checkpoint's
    # several stop tokens): the speculative loop ends rows at either.
    spec_cfg = cfg
    if draft in HISTORY_IDS:
        spec_cfg = dataclasses.replace(cfg, eos_id=VOCAB + 1, stop_ids=(eos,))
    r, stats = SP.SpeculativeSampler(graphdef)(
        state,
        PROMPTS,
        LENGTHS,
        jax.random.key(0),
        spec_cfg,
        _speculative_cfg(draft),
        spec,
        phi,
        history=history,
        head=trained_head[0] if draft == "draft_head" else None,
    )
    np.testing.assert_array_equal(np.asarray(r.tokens), np.asarray(plain.tokens))
    np.testing.assert_array_equal(np.asarray(r.completion_lengths), ncomp)
    np.testing.assert_array_equal(np.asarray(r.completion_mask), np.asarray(plain.completion_mask))
    np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(plain.logprobs), atol=LP_TOL)
    mask = np.asarray(r.completion_mask) > 0
    for got, want in zip(r.top_logprobs, plain.top_logprobs):  # past the end: unspecified
        np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=LP_TOL)
    teacher = _teacher_logprobs(graphdef, state, r.tokens, cfg)
    np.testing.assert_allclose(np.asarray(r.logprobs)[mask], teacher[mask], atol=LP_TOL)
    m = SP.acceptance_summary(stats, 3)
    assert float(m["spec_accept_length"]) > 1.0  # drafts were accepted
    if draft in HISTORY_IDS:  # the bank holds the answer: nearly every draft is accepted
        assert float(m["spec_accept_length"]) > 3.0
    if draft == "draft_head":  # it agrees with the policy's argmax on these rows (> 0.95)
        assert float(m["spec_accept_rate_1"]) > 0.9, m


def test_stop_id_ends_a_row_inside_a_verify(model):
    """A stop token of SamplingConfig.stop_ids emitted by a verify ends its row there, as
    EOS does: the sampled rollout is the one without stop tokens, each row cut after its
    first stop token (rows draw the same randomness whichever rows are done)."""
    graphdef, state, phi = model
    free = SamplingConfig(MAX_NEW, VOCAB + 1, PAD, temperature=1.0)  # no EOS
    bank = Sampler(graphdef)(state, PROMPTS, LENGTHS, jax.random.key(1), free, DENSE)
    history = SP.History(bank.tokens[:, None], bank.lengths[:, None])
    spec = SP.SpeculativeSampler(graphdef)

    def run(cfg):
        r, _ = spec(
            state,
            PROMPTS,
            LENGTHS,
            jax.random.key(0),
            cfg,
            _speculative_cfg("history"),
            DENSE,
            phi,
            history=history,
        )
        return jax.device_get(r)

    full = run(free)
    comps = [full.tokens[b, n : n + MAX_NEW] for b, n in enumerate(LENGTHS)]
    # Row 0's token at completion position 5: no row emits it first.
    stop = int(comps[0][5])
    assert all(c[0] != stop for c in comps)
    cut = run(dataclasses.replace(free, stop_ids=(stop,)))
    ended = 0
    for b, (n, c) in enumerate(zip(LENGTHS, comps)):
        hits = np.flatnonzero(c == stop)
        m = int(hits[0]) + 1 if len(hits) else MAX_NEW
        ended += m < MAX_NEW
        assert int(cut.completion_lengths[b]) == m, b
        np.testing.assert_array_equal(cut.tokens[b, : n + m], full.tokens[b, : n + m])
        assert np.all(cut.tokens[b, n + m :] == PAD)
    assert ended >= 1 and int(cut.completion_lengths[0]) <= 6


def test_draft_head_state_after_a_verify(model, trained_head):
    """The engine's head bookkeeping: after the prompt's prefill, g is the feature of the
    last prompt token; after a verify over cur..cur+3 that emitted n_new tokens (2 and 4
    here), g is the feature of position cur + n_new - 1 and the head's cache up to the new
    last token equals the teacher-forced head's over the true features (1e-5)."""
    from flax import nnx

    graphdef, state, _ = model
    (hg, hs), _ = trained_head
    head, policy = nnx.merge(hg, hs), nnx.merge(graphdef, state)
    ctx = dict(head=head, model=policy)
    tokens = jnp.asarray(np.random.default_rng(5).integers(2, VOCAB, (2, 12)))
    _, hiddens = policy.forward(tokens, hidden_at=head.layers)
    g_all = head.feature(hiddens)
    cur, lengths = 5, jnp.array([5, 5])
    caches = policy.init_cache(2, 16, DENSE)
    _, caches, prompt_h = policy.prefill(
        tokens[:, :cur], lengths, caches, DENSE, hidden_at=head.layers
    )
    head_st = SP._head_prefill(ctx, tokens[:, :cur], lengths, prompt_h, 16)
    np.testing.assert_allclose(np.asarray(head_st[1]), np.asarray(g_all[:, cur - 1]), atol=1e-5)
    pos = jnp.array([cur, cur])
    _, _, ver_h = policy.extend(tokens[:, cur : cur + 4], pos, caches, DENSE, hidden_at=head.layers)
    n_new = jnp.array([2, 4])
    cache, g = SP._head_observe(ctx, head_st, ver_h, tokens[:, cur : cur + 4], pos, n_new)
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(g_all[jnp.arange(2), cur + n_new - 1]), atol=1e-5
    )
    want = head.init_cache(2, 16)
    _, want = head(
        draft_head.shifted_features(g_all),
        policy.embed_tokens(tokens),
        "prefill",
        cache=want,
        lengths_B=jnp.array([12, 12]),
    )
    for row, n in enumerate([2, 4]):
        for name in ("k", "v"):
            np.testing.assert_allclose(
                np.asarray(cache[name][row, :, : cur + n]),
                np.asarray(want[name][row, :, : cur + n]),
                atol=1e-5,
            )


def test_draft_head_modes_agree(model, trained_head):
    """The head's cache built by prefill and then decode steps gives the teacher-forced
    head's logits at every position (the policy features shifted by one), within 1e-5."""
    from flax import nnx

    graphdef, state, _ = model
    (hg, hs), _ = trained_head
    head, policy = nnx.merge(hg, hs), nnx.merge(graphdef, state)
    tokens = jnp.asarray(np.random.default_rng(4).integers(2, VOCAB, (2, 12)))
    logits, hiddens = policy.forward(tokens, hidden_at=head.layers)
    want = draft_head.teacher_forced_logits(
        head, hiddens, policy.embed_tokens(tokens), policy.unembedding()
    )
    g = head.feature(hiddens)
    cache = head.init_cache(2, 16)
    lengths = jnp.array([5, 5])
    _, cache = head(
        draft_head.shifted_features(g)[:, :5],
        policy.embed_tokens(tokens[:, :5]),
        "prefill",
        cache=cache,
        lengths_B=lengths,
    )
    for t in range(5, 12):
        h, cache = head(
            g[:, t - 1 : t],
            policy.embed_tokens(tokens[:, t : t + 1]),
            "decode",
            cache=cache,
            pos_B=jnp.array([t, t]),
        )
        got = head.logits(h[:, 0], policy.unembedding())
        np.testing.assert_allclose(np.asarray(got), np.asarray(want[:, t]), atol=1e-5)


def test_cache_and_summaries_after_rejections_equal_plain(model):
    """Temperature 1 with a mismatched draft (random phi): many rejections. The cache's
    keys, values and page summaries at the accepted positions equal a dense prefill of the
    final tokens (the cache plain decoding builds), within 1e-5."""
    graphdef, state, phi = model
    cfg = SamplingConfig(MAX_NEW, EOS, PAD, temperature=1.0, samples_per_prompt=2)
    r, stats, caches = SP.SpeculativeSampler(graphdef)(
        state,
        PROMPTS,
        LENGTHS,
        jax.random.key(3),
        cfg,
        _speculative_cfg("sparse_self"),
        SPARSE,
        phi,
        return_cache=True,
    )
    m = SP.acceptance_summary(stats, 3)
    assert float(m["spec_accept_rate_1"]) < 0.95  # rejections happened
    from flax import nnx

    fed = np.asarray(r.lengths) - 1  # every token but the last went through the model
    ref = nnx.merge(graphdef, state).init_cache(len(fed), r.tokens.shape[1], SPARSE)
    _, ref = nnx.merge(graphdef, state).prefill(r.tokens, jnp.asarray(fed), ref, SPARSE)
    _assert_cache_equal(caches, ref, fed)


def _assert_cache_equal(caches, ref, length_B):
    """Keys and values at positions < length_B, and every page summary, within 1e-5."""
    s = ref[0]["k"].shape[2]
    pos_ok = np.arange(s)[None, None, :, None] < np.asarray(length_B)[:, None, None, None]
    for got, want in zip(caches, ref):
        for name in ("k", "v"):
            np.testing.assert_allclose(
                np.where(pos_ok, got[name], 0), np.where(pos_ok, want[name], 0), atol=1e-5
            )
        if "ksum" in want:
            np.testing.assert_allclose(np.asarray(got["ksum"]), np.asarray(want["ksum"]), atol=1e-5)


def test_tree_verify_equals_dense_forward_and_prefill(model):
    """One extend over a token tree (width 2, depth 3, sparse cache): every node's logits
    equal a dense forward of the prompt and the node's path (1e-4); after the accepted
    path's keys and values are moved to their positions and the summaries refreshed, the
    cache's keys, values and page summaries equal a dense prefill of the prompt and the
    path (1e-5). A node that saw a non-ancestor, or a path left at its tree slots, fails."""
    from flax import nnx

    from dsparse_jax.attention import cache as kv_cache
    from dsparse_jax.attention import dense
    from dsparse_jax.model import transformer

    graphdef, state, _ = model
    m = nnx.merge(graphdef, state)
    b, s = len(LENGTHS), 16
    cur = jnp.asarray(LENGTHS)  # the root (the row's last token) sits at the prompt's end
    parent = np.array([0, 0, 0, 1, 2, 3, 3])  # nodes 1, 2 | 3, 4 | 5, 6 by depth
    depth = np.array([0, 1, 1, 2, 2, 3, 3])
    tokens = np.random.default_rng(4).integers(2, VOCAB, (b, 7))
    parent_BxT = jnp.broadcast_to(jnp.asarray(parent, jnp.int32), (b, 7))
    tree = dense.Tree(
        jnp.broadcast_to(jnp.asarray(depth), (b, 7)), SP.tree_ancestors(parent_BxT, 3)
    )
    caches = m.init_cache(b, s, SPARSE)
    _, caches = m.prefill(jnp.asarray(PROMPTS), cur, caches, SPARSE)
    logits, caches = m.extend(jnp.asarray(tokens), cur, caches, SPARSE, tree=tree)

    def path_of(t):
        path = [t]
        while path[-1]:
            path.append(parent[path[-1]])
        return path[::-1]

    def with_path(path):  # prompt + the path's tokens, right-padded to s
        rows = np.zeros((b, s), np.int64)
        for i, n in enumerate(LENGTHS):
            rows[i, :n] = PROMPTS[i, :n]
            rows[i, n : n + len(path)] = tokens[i, path]
        return jnp.asarray(rows)

    for t in range(7):
        full = m.forward(with_path(path_of(t)), DENSE)
        want = np.asarray(full)[np.arange(b), LENGTHS + depth[t]]
        np.testing.assert_allclose(np.asarray(logits[:, t]), want, atol=1e-4, err_msg=f"node {t}")

    path = path_of(4)  # [0, 2, 4]: two drafts accepted
    path_BxD = jnp.asarray(np.broadcast_to(path + [4], (b, 4)), jnp.int32)
    moved = [kv_cache.move_path(c, cur, path_BxD, jnp.full((b,), 3)) for c in caches]
    moved = [
        kv_cache.refresh_summaries(c, cur, 7, cur + 3, transformer.layer_info(CFG, i), SPARSE)
        for i, c in enumerate(moved)
    ]
    ref = m.init_cache(b, s, SPARSE)
    _, ref = m.prefill(with_path(path), cur + 3, ref, SPARSE)
    _assert_cache_equal(moved, ref, LENGTHS + 3)


# --------------------------------------------------------------------------- distribution
DIST_VOCAB, DIST_NEW, DIST_N = 5, 3, 6000
# The DIST_N samples as DIST_GROUPS copies of the prompt x DIST_N / DIST_GROUPS samples:
# the history drafter matches each row against its whole group (O(group^2) work), so one
# group of 6000 would cost it seconds per step; the samples' distribution is the same.
DIST_GROUPS = 50
DIST_CFG = CFG.replace(vocab_size=DIST_VOCAB)
DIST_PROMPT = np.array([[1, 3, 2, 4, 0, 2, 1]])
Z_CRIT = 3.719  # one-sided normal quantile of p = 1e-4


def chi2_critical(df: int) -> float:
    """The chi-square value exceeded with probability 1e-4 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + Z_CRIT * np.sqrt(c)) ** 3


@pytest.fixture(scope="module")
def dist_model():
    graphdef, state = random_params(DIST_CFG, seed=2, embed_std=0.5)
    phi = lora_lib.init_lora(DIST_CFG, lora_lib.LoRAConfig(rank=2), jax.random.key(7))
    rng = np.random.default_rng(8)
    phi = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.5, x.dtype), phi)
    return graphdef, state, phi


@pytest.fixture(scope="module")
def sharp_model():
    """dist_model's shapes with larger embeddings: its next-token distributions depend
    more on the context, so a tree node that sees a sibling gets a visibly different p."""
    graphdef, state = random_params(DIST_CFG, seed=2, embed_std=2.0)
    return graphdef, state, None


def _exact_probs(graphdef, state, cfg):
    """p(sequence) of every 3-token completion under the dense policy (truncated)."""
    seqs = np.array(list(itertools.product(range(DIST_VOCAB), repeat=DIST_NEW)))
    tokens = np.concatenate([np.repeat(DIST_PROMPT, len(seqs), 0), seqs], axis=1)
    lp = _teacher_logprobs(graphdef, state, tokens, cfg)[:, -DIST_NEW:]
    return seqs, np.exp(lp.sum(1))


def _chi_square(graphdef, state, phi, draft, cfg, key=0):
    seqs, probs = _exact_probs(graphdef, state, cfg)
    scfg = dataclasses_replace(cfg, samples_per_prompt=DIST_N // DIST_GROUPS)
    prompts = np.repeat(DIST_PROMPT, DIST_GROUPS, axis=0)
    history = None
    if draft in HISTORY_IDS:  # bank rows: fixed token sequences
        width = DIST_PROMPT.shape[1] + 5  # the rollout's buffer: 7 + 3 rounded up to pages
        rows = np.random.default_rng(9).integers(0, DIST_VOCAB, (1, 4, width))
        rows[:, :, : DIST_PROMPT.shape[1]] = DIST_PROMPT
        rows = np.repeat(rows, DIST_GROUPS, axis=0)  # the same bank for every copy
        history = SP.History(jnp.asarray(rows), jnp.full(rows.shape[:2], width, jnp.int32))
    spec = SPARSE if draft == "sparse_self" else DENSE
    head = None
    if draft == "draft_head":  # an untrained head: a q far from p
        layers = draft_head.default_layers(DIST_CFG.num_layers)
        head = draft_head.create(DIST_CFG, draft_head.DraftHeadConfig(layers), jax.random.key(4))
    r, stats = SP.SpeculativeSampler(graphdef)(
        state,
        prompts,
        np.full(DIST_GROUPS, DIST_PROMPT.shape[1]),
        jax.random.key(key),
        scfg,
        _speculative_cfg(draft, draft_tokens=2, ngram=2),
        spec,
        phi,
        history=history,
        head=head,
    )
    got = np.asarray(r.tokens)[:, DIST_PROMPT.shape[1] : DIST_PROMPT.shape[1] + DIST_NEW]
    index = {tuple(s): i for i, s in enumerate(seqs)}
    counts = np.bincount([index[tuple(g)] for g in got], minlength=len(seqs))
    expected = probs * DIST_N
    assert abs(probs.sum() - 1) < 1e-4
    big = expected >= 5  # pool the rare cells into one
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    stat = float(((obs - exp) ** 2 / np.maximum(exp, 1e-9)).sum())
    rate = float(SP.acceptance_summary(stats, 2)["spec_accept_rate_1"])
    print(f"{draft}: chi2 {stat:.1f} over {len(obs) - 1} dof, acceptance {rate:.3f}")
    return stat / chi2_critical(len(obs) - 1), rate, counts[~(probs > 0)].sum()


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


DIST_CASES = {
    "t1": SamplingConfig(DIST_NEW, 99, PAD, temperature=1.0),
    "trunc": SamplingConfig(DIST_NEW, 99, PAD, temperature=0.8, top_k=4, top_p=0.85),
}


@pytest.mark.slow
@pytest.mark.parametrize("draft", ALL_DRAFTS)
@pytest.mark.parametrize("case", list(DIST_CASES))
def test_distribution_matches_dense_policy(dist_model, draft, case):
    stat, rate, impossible = _chi_square(*dist_model, draft, DIST_CASES[case])
    assert impossible == 0  # never a token outside the truncation
    assert 0.05 < rate < 0.98, rate  # a real mix of acceptances and rejections
    assert stat < 1.0, stat  # the statistic over its p = 1e-4 critical value


@pytest.mark.slow
def test_tree_distribution_on_a_sharp_model(sharp_model):
    """The model the non-ancestor planted bug is caught on: the tree itself passes there."""
    stat, rate, impossible = _chi_square(*sharp_model, "history_tree", DIST_CASES["t1"])
    assert impossible == 0 and 0.05 < rate < 0.98 and stat < 1.0, (stat, rate)


def _accept_keeping_rejected(logp, drafts, probs, num, key, greedy):
    """Planted bug: a deterministic draft's rejected token stays in the residual."""
    a, _, ok = _ACCEPT(logp, drafts, probs, num, key, greedy)
    nxt = jax.random.categorical(jax.random.fold_in(key, 1), logp[jnp.arange(a.shape[0]), a])
    return a, nxt.astype(jnp.int32), ok


def _all_earlier_nodes(parent_BxT, levels):
    """Planted bug: each tree node sees every node before it (siblings and cousins too)."""
    t = parent_BxT.shape[1]
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), parent_BxT.shape + (t,))


def _accept_everything(logp, drafts, probs, num, key, greedy):
    """Planted bug: every draft accepted."""
    _, _, ok = _ACCEPT(logp, drafts, probs, num, key, greedy)
    nxt = jax.random.categorical(jax.random.fold_in(key, 1), logp[jnp.arange(num.shape[0]), num])
    return num, nxt.astype(jnp.int32), ok


@pytest.mark.slow
@pytest.mark.parametrize(
    "bug,draft,case",
    [
        ("rejected_in_residual", "history", "t1"),
        ("rejected_sibling_in_residual", "history_tree", "t1"),
        ("non_ancestor_visible", "history_tree", "t1"),
        ("q_untruncated", "history_counts", "trunc"),
        ("q_untruncated", "sparse_self", "trunc"),
        ("q_untruncated", "draft_head", "trunc"),
        ("accept_all", "sparse_self", "t1"),
    ],
)
def test_planted_bugs_fail_the_distribution_test(
    dist_model, sharp_model, monkeypatch, bug, draft, case
):
    if bug == "rejected_in_residual":
        monkeypatch.setattr(SP.rejection, "accept", _accept_keeping_rejected)
    elif bug == "rejected_sibling_in_residual":
        monkeypatch.setattr(SP.rejection, "without", lambda p, token: p)
    elif bug == "non_ancestor_visible":  # every earlier node visible, as in a chain
        monkeypatch.setattr(SP, "tree_ancestors", _all_earlier_nodes)
    elif bug == "q_untruncated":
        monkeypatch.setattr(SP, "draft_probs", lambda lg, c: jax.nn.softmax(lg / c.temperature))
    else:
        monkeypatch.setattr(SP.rejection, "accept", _accept_everything)
    on = sharp_model if bug == "non_ancestor_visible" else dist_model
    stat, _, impossible = _chi_square(*on, draft, DIST_CASES[case])
    assert stat > 1.0 or impossible > 0, stat


def test_draft_head_export_round_trips(trained_head, tmp_path):
    """launch/export.py writes the head (draft_head.export); load_exported reads it back
    bitwise in f32."""
    (hg, hs), _ = trained_head
    layers = draft_head.default_layers(CFG.num_layers)
    files = draft_head.export(str(tmp_path), hs, layers)
    assert sorted(files) == sorted([draft_head.EXPORT_WEIGHTS, draft_head.EXPORT_CONFIG])
    _, got = draft_head.load_exported(str(tmp_path), CFG)
    assert jax.tree.structure(got) == jax.tree.structure(hs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(hs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
