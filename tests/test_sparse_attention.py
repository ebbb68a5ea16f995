"""Block-sparse decode attention: rollouts are reproducible teacher-forced, selection is
what the method says, and sparse is really sparse.

(a) every policy, GQA ratios 4/2/1, ragged prompts, completions over many pages,
    temperature sampling, a budget schedule: the sampler's per-step distributions
    equal the teacher-forced sparse forward (model.forward(tokens, spec,
    pages=rollout.pages())) within 1e-4 in log-prob;
(b) a budget that covers every page equals dense attention;
(c) select_pages on hand-built caches equals a numpy implementation of the method;
(d) small budgets differ from dense (no silent fallback), local and dense_layers layers
    stay dense, SparseSpec validation;
(e) a decode cache that grows through several buffers (SamplingConfig.grow_buffer_from)
    gives the fixed-buffer rollout, dense and sparse.
Two-level selection (SparseSpec.group_pages) runs through (a), (d) and (e) here; its
selection and summaries are checked against numpy in test_two_level_selection.py.
Tiny shapes (page_size 4 or 8) keep it fast; every rollout asks for top_logprobs=vocab,
i.e. the whole log-softmax of each decode step.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import out_and_grads, random_params

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention import dense, selection, sparse
from dsparse_jax.attention.selection import NO_PAGE
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo, SparseSpec
from dsparse_jax.model import attention_dispatch as api
from dsparse_jax.model import config as C
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig, buffer_schedule

LP_TOL = 1e-4
VOCAB, EOS, PAD = 32, 1, 0
MAX_NEW = 28
# Row 0's first decode step already skips pages (5 pages of 4 > budget 4).
LENGTHS = np.array([17, 3, 6])
PROMPTS = np.random.default_rng(0).integers(2, VOCAB, (3, 17))
PROMPTS = np.where(np.arange(17) < LENGTHS[:, None], PROMPTS, PAD)
SAMPLING = SamplingConfig(MAX_NEW, EOS, PAD, temperature=0.9, top_logprobs=VOCAB)


def model_cfg(kv_heads):
    # Layers: 0 local, 1 global, 2 local, 3 global; window 8 < sequence length 45.
    return C.tiny(vocab_size=VOCAB).replace(
        d_model=32,
        head_dim=8,
        mlp_dim=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=kv_heads,
        sliding_window=8,
    )


@functools.lru_cache(maxsize=None)
def model(kv_heads):
    graphdef, state = random_params(model_cfg(kv_heads), seed=kv_heads)
    forward = jax.jit(
        lambda st, tokens, spec, pages: nnx.merge(graphdef, st).forward(tokens, spec, pages=pages),
        static_argnums=2,
    )
    return graphdef, state, Sampler(graphdef), forward


@functools.lru_cache(maxsize=None)
def sparse_rollout(kv_heads, spec, seed=0):
    """The rollout, the full log-softmax(logits / T) of each of its steps ([B, S, V], at
    the position of the sampled token), and the same from the teacher-forced sparse
    forward with the rollout's pages and from a dense forward. The dense one reuses the
    sparse forward's compile: a record whose queries are all flagged non-sparse (as prompt
    queries are) lets every query see every key; test_budget_covering_all_pages_equals_dense
    checks the plain dense forward."""
    _, state, sampler, forward = model(kv_heads)
    for seed in range(seed, seed + 20):  # a key where some completion spans >= 5 pages
        r = sampler(state, jnp.asarray(PROMPTS), LENGTHS, jax.random.key(seed), SAMPLING, spec)
        if int(r.completion_lengths.max()) >= min(5 * spec.page_size, MAX_NEW):
            break
    t = SAMPLING.temperature
    tf_sparse = jax.nn.log_softmax(forward(state, r.tokens, spec, r.pages()) / t, -1)
    all_dense = {
        i: selection.PageRecord(rec.page_ids, jnp.zeros_like(rec.sparse_query))
        for i, rec in r.pages().items()
    }
    tf_dense = jax.nn.log_softmax(forward(state, r.tokens, spec, all_dense) / t, -1)
    r = jax.device_get(r)
    return r, step_distributions(r), shift(tf_sparse), shift(tf_dense)


def step_distributions(r):
    """[B, S, V] log-softmax of each decode step at its sampled token's position, from a
    rollout run with top_logprobs=vocab (the whole distribution)."""
    vals, ids = r.top_logprobs
    full = np.full(vals.shape[:2] + (VOCAB,), np.nan)
    np.put_along_axis(full, np.asarray(ids), np.asarray(vals), -1)
    return full


def shift(logp_BxSxV):
    """Teacher-forced log-probs at s - 1 predict token s: align them with the tokens."""
    return np.pad(np.asarray(logp_BxSxV)[:, :-1], ((0, 0), (1, 0), (0, 0)))


def completion_mask(r):
    return np.asarray(r.completion_mask) == 1


def budget_np(sparse: SparseSpec, ctx: int) -> int:
    for bound, pages in sparse.budget_schedule:
        if ctx <= bound:
            return pages
    return sparse.budget_schedule[-1][1] if sparse.budget_schedule else sparse.budget


SPARSE_CASES = {
    # name: (num_kv_heads, spec, sparse layers). Layers 0, 2 are local (never sparse).
    "centroid_kv1": (
        1,
        AttentionSpec(page_size=4, sparse=SparseSpec("centroid", budget=4, dense_layers=1)),
        {1, 3},
    ),
    # A Sparrow-style budget schedule (3, 4, then 6 pages as the context grows), other
    # reserved counts, and dense_layers=2: global layer 1 stays dense.
    "quest_schedule_kv2": (
        2,
        AttentionSpec(
            page_size=4,
            sparse=SparseSpec(
                "quest",
                budget=3,
                budget_schedule=((12, 3), (24, 4), (10_000, 6)),
                sink_pages=2,
                recent_pages=1,
                dense_layers=2,
            ),
        ),
        {3},
    ),
    # Two-level selection: 2 candidate groups of 2 pages besides the 3 reserved ones, out
    # of up to 6 groups: the candidates do not cover the context.
    "centroid_two_level_kv2": (
        2,
        AttentionSpec(
            page_size=4,
            sparse=SparseSpec(
                "centroid", budget=5, dense_layers=1, group_pages=2, candidate_groups=4
            ),
        ),
        {1, 3},
    ),
    "streaming_kv4": (
        4,
        AttentionSpec(page_size=8, sparse=SparseSpec("streaming", budget=3, dense_layers=1)),
        {1, 3},
    ),
}


# ----------------------------------------------------------------------------- (a), (d)
@pytest.mark.slow
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_rollout_matches_teacher_forced_sparse_forward(case):
    kv, spec, sparse_layers = SPARSE_CASES[case]
    r, got, tf_sparse, tf_dense = sparse_rollout(kv, spec)
    m = completion_mask(r)
    assert r.completion_lengths.max() >= min(5 * spec.page_size, MAX_NEW)  # many pages
    # Every decode step's distribution (not only the sampled token) is the teacher-forced
    # sparse one, within LP_TOL; the sampled tokens' log-probs too.
    np.testing.assert_allclose(got[m], tf_sparse[m], atol=LP_TOL, rtol=0)
    tok_lp = np.take_along_axis(tf_sparse, r.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(r.logprobs[m], tok_lp[m], atol=LP_TOL, rtol=0)
    # (d) The budget is small: sparse differs from dense (both the actor and the
    # teacher-forced recompute), so neither silently fell back to dense attention.
    assert np.abs(got[m] - tf_dense[m]).max() > 1e-2
    assert np.abs(tf_sparse[m] - tf_dense[m]).max() > 1e-2
    # Only global layers past dense_layers are sparse (local layers and layers 0.. stay dense).
    assert set(r.page_ids) == sparse_layers


@pytest.mark.slow  # shares the rollouts (and compiles) of the test above
@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_page_record_structure(case):
    """Per recorded step and KV head: min(budget(context), existing pages) distinct pages,
    the sink and recent pages among them, NO_PAGE padding after; prompt positions
    unrecorded; some steps really skip pages; per-head choices (GQA) can differ."""
    kv, spec, _ = SPARSE_CASES[case]
    sp, ps = spec.sparse, spec.page_size
    r, _, _, _ = sparse_rollout(kv, spec)
    skipped = heads_differ = 0
    for layer, ids_all in r.page_ids.items():
        assert ids_all.shape == r.tokens.shape + (kv, sp.max_pages)
        for b in range(len(LENGTHS)):
            p, end = LENGTHS[b], int(r.lengths[b]) - 1
            assert np.all(ids_all[b, :p] == NO_PAGE)  # prompt (dense prefill): not recorded
            for pos in range(p, end):
                cur = pos // ps
                n_read = min(budget_np(sp, pos + 1), cur + 1)
                skipped += n_read < cur + 1
                for h in range(kv):
                    ids = ids_all[b, pos, h]
                    assert np.all(ids[n_read:] == NO_PAGE), (layer, b, pos, h, ids)
                    sel = ids[:n_read]
                    assert len(set(sel)) == n_read and sel.min() >= 0 and sel.max() <= cur
                    reserved = {
                        j for j in range(cur + 1) if j < sp.sink_pages or j > cur - sp.recent_pages
                    }
                    assert reserved <= set(sel), (layer, b, pos, h, sel)
                    if sp.policy == "streaming":  # sink + the most recent pages
                        assert set(sel) == reserved | set(
                            range(cur + 1 - (n_read - sp.sink_pages), cur + 1)
                        )
                heads_differ += kv > 1 and any(
                    set(ids_all[b, pos, 0]) != set(ids_all[b, pos, h])
                    for h in range(kv)
                    for pos in range(p, end)
                )
    assert skipped > 0
    if kv > 1 and sp.policy != "streaming":
        assert heads_differ > 0  # selection is per KV head


@pytest.mark.slow
def test_forced_replay_reproduces_the_rollout():
    """Replaying a sparse rollout's tokens through the decode loop (forced_BxS) gives back
    its tokens, completion lengths and recorded pages exactly and its log-probs (f32,
    1e-5); replaying it under another budget keeps the tokens but selects other pages."""
    kv, spec, _ = SPARSE_CASES["quest_schedule_kv2"]
    _, state, sampler, _ = model(kv)
    r, _, _, _ = sparse_rollout(kv, spec)
    cfg = dataclasses.replace(SAMPLING, top_logprobs=0)
    replay = jax.device_get(
        sampler(
            state, jnp.asarray(PROMPTS), LENGTHS, jax.random.key(9), cfg, spec, forced_BxS=r.tokens
        )
    )
    np.testing.assert_array_equal(replay.tokens, r.tokens)
    np.testing.assert_array_equal(replay.completion_lengths, r.completion_lengths)
    for layer, ids in r.page_ids.items():
        np.testing.assert_array_equal(replay.page_ids[layer], ids)
    np.testing.assert_allclose(replay.logprobs, r.logprobs, atol=1e-5, rtol=0)
    other = dataclasses.replace(
        spec, sparse=SparseSpec("quest", budget=6, sink_pages=1, recent_pages=1, dense_layers=2)
    )
    moved = jax.device_get(
        sampler(
            state, jnp.asarray(PROMPTS), LENGTHS, jax.random.key(9), cfg, other, forced_BxS=r.tokens
        )
    )
    np.testing.assert_array_equal(moved.tokens, r.tokens)
    assert any(np.any(moved.page_ids[i] != r.page_ids[i]) for i in r.page_ids)
    assert np.abs(moved.logprobs - r.logprobs).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["dense", "centroid_kv1", "quest_schedule_kv2", "centroid_two_level_kv2"]
)
def test_growing_cache_buffer_changes_nothing(case):
    """A rollout whose decode cache grows through 4 buffers (sampler.buffer_schedule) is the
    fixed-buffer rollout: same tokens and page records, step distributions within 1e-5, and
    still equal to the teacher-forced (sparse) forward within LP_TOL."""
    kv, spec = (1, AttentionSpec(page_size=4)) if case == "dense" else SPARSE_CASES[case][:2]
    _, state, sampler, forward = model(kv)
    grown = dataclasses.replace(SAMPLING, grow_buffer_from=4)
    assert len(buffer_schedule(PROMPTS.shape[1], MAX_NEW, spec.page_size, 4)) == 4
    key = jax.random.key(3)
    fixed = jax.device_get(sampler(state, jnp.asarray(PROMPTS), LENGTHS, key, SAMPLING, spec))
    r = jax.device_get(sampler(state, jnp.asarray(PROMPTS), LENGTHS, key, grown, spec))
    m = completion_mask(r)
    assert r.completion_lengths.max() > 19  # the last rows' steps ran in the last buffers
    np.testing.assert_array_equal(r.tokens, fixed.tokens)
    np.testing.assert_array_equal(r.completion_lengths, fixed.completion_lengths)
    assert set(r.page_ids) == set(fixed.page_ids)
    for layer in r.page_ids:
        np.testing.assert_array_equal(r.page_ids[layer], fixed.page_ids[layer])
    got = step_distributions(r)
    np.testing.assert_allclose(got[m], step_distributions(fixed)[m], atol=1e-5, rtol=0)
    tf = shift(
        jax.nn.log_softmax(forward(state, r.tokens, spec, r.pages()) / SAMPLING.temperature, -1)
    )
    np.testing.assert_allclose(got[m], tf[m], atol=LP_TOL, rtol=0)


@pytest.mark.slow
def test_budget_covering_all_pages_equals_dense():
    """(b) budget >= number of pages: every existing page is read, and each step's
    distribution equals the dense forward's (the sparse path adds no error)."""
    spec = AttentionSpec(page_size=4, sparse=SparseSpec("quest", budget=12, dense_layers=0))
    r, got, tf_sparse, _ = sparse_rollout(2, spec)
    m = completion_mask(r)
    assert r.tokens.shape[1] == 48  # 12 pages of 4: the budget covers them all
    _, state, _, forward = model(2)
    tf_dense = jax.nn.log_softmax(
        forward(state, jnp.asarray(r.tokens), AttentionSpec(), None) / SAMPLING.temperature, -1
    )
    tf_dense = np.pad(np.asarray(tf_dense)[:, :-1], ((0, 0), (1, 0), (0, 0)))
    np.testing.assert_allclose(got[m], tf_dense[m], atol=LP_TOL, rtol=0)
    np.testing.assert_allclose(tf_sparse[m], tf_dense[m], atol=LP_TOL, rtol=0)
    for ids_all in r.page_ids.values():
        for b in range(len(LENGTHS)):
            for pos in range(LENGTHS[b], int(r.lengths[b]) - 1):
                for h in range(2):
                    assert set(ids_all[b, pos, h]) - {NO_PAGE} == set(range(pos // 4 + 1))


# ----------------------------------------------------------------------------- (c)
SEL_B, SEL_K, SEL_G, SEL_H, SEL_PS, SEL_LEN, SEL_T = 5, 2, 2, 4, 4, 48, 30
SEL_LENGTHS = np.array([30, 7, 25, 18, 2])
# Decode writes after the prefill (final positions lengths + 13): rows 0, 1 and 3 end
# with whole pages written by decode that are no longer recent, and pages that mix
# prefill and decode keys; row 4 has 4 pages, fewer than every budget.
SEL_STEPS = 14
SEL_CASES = {
    "centroid": SparseSpec("centroid", budget=5, dense_layers=0),
    "quest": SparseSpec("quest", budget=5, dense_layers=0),
    "streaming": SparseSpec("streaming", budget=4, dense_layers=0),
    "centroid_sink2_recent1": SparseSpec(
        "centroid", budget=4, sink_pages=2, recent_pages=1, dense_layers=0
    ),
    "quest_schedule": SparseSpec(
        "quest", budget=3, budget_schedule=((16, 3), (64, 6)), dense_layers=0
    ),
}
SEL_LAYER = LayerInfo(index=3, window=None, softcap=None, scale=1.0)


def sel_data():
    rng = np.random.default_rng(0)
    # Keys mostly positive (mean 0.8): a page's true min/max then rarely bracket 0, so a
    # summary polluted by stale zeros (no reset of a fresh page) changes the selection.
    k_prompt = 0.8 + 0.7 * rng.normal(size=(SEL_B, SEL_T, SEL_K, SEL_H))  # junk past lengths
    k_steps = 0.8 + 0.7 * rng.normal(size=(SEL_STEPS, SEL_B, SEL_K, SEL_H))
    q = rng.normal(size=(SEL_B, SEL_K, SEL_G, SEL_H))
    return k_prompt, k_steps, q


@functools.lru_cache(maxsize=None)
def jax_selection():
    """All SEL_CASES in one jit: write_prefill + SEL_STEPS write_decode, then select_pages
    at the last written position."""
    k_prompt, k_steps, q = (jnp.asarray(x, jnp.float32) for x in sel_data())

    def run(k_prompt, k_steps, q, lengths):
        out = {}
        for name, sparse_spec in SEL_CASES.items():
            spec = AttentionSpec(page_size=SEL_PS, sparse=sparse_spec)
            assert spec.is_sparse_layer(SEL_LAYER)
            c = kv_cache.init_layer_cache(
                SEL_B, SEL_K, SEL_LEN, SEL_H, jnp.float32, SEL_LAYER, spec
            )
            c = kv_cache.write_prefill(
                c, k_prompt, jnp.zeros_like(k_prompt), lengths, SEL_LAYER, spec
            )
            c = jax.lax.fori_loop(
                0,
                SEL_STEPS,
                lambda s, c: kv_cache.write_decode(
                    c, k_steps[s], jnp.zeros_like(k_steps[s]), lengths + s, SEL_LAYER, spec
                ),
                c,
            )
            pos = lengths + SEL_STEPS - 1
            out[name] = selection.select_pages(sparse_spec, c, q, pos, SEL_PS, SEL_LEN // SEL_PS)
        return out

    return jax.device_get(jax.jit(run)(k_prompt, k_steps, q, jnp.asarray(SEL_LENGTHS)))


def np_select(sparse: SparseSpec, keys_SxKxH, q_KxGxH, pos, ps):
    """The method, per KV head: score pages (centroid: group-mean query . centroid;
    quest: sum_i max(q_i min_i, q_i max_i); streaming: recency), keep sink + recent pages,
    fill the budget with the best-scoring others. Returns a set per KV head."""
    cur = pos // ps
    n_read = min(budget_np(sparse, pos + 1), cur + 1)
    reserved = {j for j in range(cur + 1) if j < sparse.sink_pages or j > cur - sparse.recent_pages}
    out = []
    for h in range(keys_SxKxH.shape[1]):
        qm = q_KxGxH[h].mean(0)
        scores = {}
        for j in set(range(cur + 1)) - reserved:
            page = keys_SxKxH[j * ps : min((j + 1) * ps, pos + 1), h]
            if sparse.policy == "centroid":
                scores[j] = qm @ page.mean(0)
            elif sparse.policy == "quest":
                scores[j] = np.maximum(qm * page.min(0), qm * page.max(0)).sum()
            else:
                scores[j] = j
        best = sorted(scores, key=lambda j: -scores[j])[: n_read - len(reserved)]
        out.append(reserved | set(best))
    return out, n_read


@pytest.mark.parametrize("case", list(SEL_CASES))
def test_select_pages_matches_numpy(case):
    sparse = SEL_CASES[case]
    ids = jax_selection()[case]
    k_prompt, k_steps, q = sel_data()
    assert ids.shape == (SEL_B, SEL_K, sparse.max_pages) and ids.dtype == np.int32
    n_partial = 0
    for b in range(SEL_B):
        p = SEL_LENGTHS[b]
        keys = np.concatenate([k_prompt[b, :p], k_steps[:, b]])  # the true keys, junk excluded
        pos = p + SEL_STEPS - 1
        want, n_read = np_select(sparse, keys, q[b], pos, SEL_PS)
        n_partial += n_read < pos // SEL_PS + 1
        for h in range(SEL_K):
            got = ids[b, h]
            assert set(got[:n_read]) == want[h], (b, h, got, want[h])
            assert np.all(got[n_read:] == NO_PAGE)  # fewer pages than slots: NO_PAGE padding
    assert n_partial >= 3  # most rows really choose among pages
    # Row 4 has 4 pages: with a larger budget, all of them plus NO_PAGE padding.
    if budget_np(sparse, SEL_LENGTHS[4] + SEL_STEPS) > 4:
        assert set(ids[4, 0]) == set(ids[4, 1]) == {0, 1, 2, 3, NO_PAGE}


def test_group_mean_query_matters():
    """The numpy reference is sensitive to the group-mean query: scoring with one query
    head instead changes some selection (so the comparison above can catch that bug)."""
    k_prompt, k_steps, q = sel_data()
    sparse = SEL_CASES["centroid"]
    changed = 0
    for b in range(SEL_B):
        p = SEL_LENGTHS[b]
        keys = np.concatenate([k_prompt[b, :p], k_steps[:, b]])
        pos = p + SEL_STEPS - 1
        mean_sel, _ = np_select(sparse, keys, q[b], pos, SEL_PS)
        head_sel, _ = np_select(sparse, keys, q[b][:, :1], pos, SEL_PS)
        changed += mean_sel != head_sel
    assert changed > 0


def test_budget_for_schedule():
    sp = SparseSpec("centroid", budget=3, budget_schedule=((16, 3), (64, 6), (128, 9)))
    ctx = np.array([1, 16, 17, 64, 65, 128, 129, 10_000])
    got = np.asarray(jax.jit(lambda c: selection.budget_for(sp, c))(jnp.asarray(ctx)))
    np.testing.assert_array_equal(got, [budget_np(sp, c) for c in ctx])
    np.testing.assert_array_equal(got, [3, 3, 6, 6, 9, 9, 9, 9])
    assert sp.max_pages == 9
    assert SparseSpec(budget=7).max_pages == 7


# ----------------------------------------------------------------------------- (d)
def test_local_and_dense_layers_ignore_pages_and_have_no_summaries():
    """api.attend_sequence applies a page record only to the spec's sparse layers, and only
    those layers' caches carry page summaries."""
    spec = AttentionSpec(page_size=4, sparse=SparseSpec("centroid", budget=3, dense_layers=2))
    local = LayerInfo(index=4, window=5, softcap=None, scale=0.5)
    early_global = LayerInfo(index=1, window=None, softcap=None, scale=0.5)
    sparse_global = LayerInfo(index=2, window=None, softcap=None, scale=0.5)
    assert [spec.is_sparse_layer(x) for x in (local, early_global, sparse_global)] == [
        False,
        False,
        True,
    ]
    assert not spec.dense().is_sparse_layer(sparse_global)
    rng = np.random.default_rng(0)
    t = 16
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, n, 8)), jnp.float32) for n in (4, 2, 2))
    # A record that reads only page 0 at every query position.
    ids = np.full((1, t, 2, 3), NO_PAGE, np.int32)
    ids[..., 0] = 0
    pages = selection.PageRecord(jnp.asarray(ids), jnp.ones((1, t), bool))

    ok = np.zeros((1, 2, t, t), bool)  # only page 0 (keys 0..3) visible
    ok[..., :4] = True

    @jax.jit
    def run(q, k, v):
        out = {
            name: (
                api.attend_sequence(q, k, v, layer, spec, pages),
                dense.sequence_attention(q, k, v, layer),
            )
            for name, layer in [
                ("local", local),
                ("early", early_global),
                ("sparse", sparse_global),
            ]
        }
        return out, dense.sequence_attention(q, k, v, sparse_global, jnp.asarray(ok))

    out, page0_only = jax.device_get(run(q, k, v))
    for name in ("local", "early"):
        np.testing.assert_array_equal(out[name][0], out[name][1])
    assert np.abs(out["sparse"][0] - out["sparse"][1]).max() > 1e-2  # the record applies
    np.testing.assert_allclose(out["sparse"][0], page0_only, atol=1e-6)
    for layer, has in [(local, False), (early_global, False), (sparse_global, True)]:
        c = kv_cache.init_layer_cache(2, 2, 16, 8, jnp.float32, layer, spec)
        assert ("ksum" in c) == has and set(c) >= {"k", "v"}


def _twin_inputs(seed, t=80, page=8, budget=4, prefix=24):
    """q/k/v and a record that keeps the record's contract: row b's prompt ends at
    prompt_b <= prefix, its queries in [prompt_b, end_b - 1) are sparse and read the
    current page, a random set of earlier pages and NO_PAGE slots; the rest of the row
    (the tail, end_b - 1 on) holds random junk page ids."""
    rng = np.random.default_rng(seed)
    b, n, kv, h, num_pages = 3, 4, 2, 8, t // page
    prompt, end = np.array([prefix, 5, 13]), np.array([t, 61, 40])
    ids = rng.integers(-1, num_pages, (b, t, kv, budget))  # the tail's junk
    for row in range(b):
        for i in range(prompt[row], end[row] - 1):
            cur = i // page
            for k in range(kv):
                others = rng.permutation(cur)[: rng.integers(0, budget)]
                chosen = np.concatenate([[cur], others])
                ids[row, i, k] = np.pad(chosen, (0, budget - len(chosen)), constant_values=-1)
    pos = np.arange(t)[None]
    sq = (pos >= prompt[:, None]) & (pos < end[:, None] - 1)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, m, h)), jnp.float32) for m in (n, kv, kv))
    used = jnp.asarray(pos < end[:, None] - 1, jnp.float32)  # queries whose output is used
    return q, k, v, jnp.asarray(ids, jnp.int32), jnp.asarray(sq), used


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_twin_attention_equals_full_mask_path(softcap):
    """sparse.sequence_attention with the prompt buffer as dense_prefix (queries past it as
    vmapped decode steps over their pages, no [T, T] mask) equals the full masked path
    (dense_prefix=None: allowed_key_mask over the whole sequence) on every used query, in
    outputs and in the gradients of q, k and v (f32, 1e-5)."""
    q, k, v, ids, sq, used = _twin_inputs(0)
    layer = LayerInfo(index=1, window=None, softcap=softcap, scale=0.4)
    full = selection.PageRecord(ids, sq, None)
    split = selection.PageRecord(ids, sq, 24)

    w = used[:, :, None, None]
    twin = lambda record: lambda q, k, v: sparse.sequence_attention(q, k, v, layer, record, 8)
    a, g_split = out_and_grads(twin(split), q, k, v, w)
    b, g_full = out_and_grads(twin(full), q, k, v, w)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    dense_out = jax.jit(lambda q, k, v: dense.sequence_attention(q, k, v, layer) * w)(q, k, v)
    assert np.abs(np.asarray(a - dense_out)).max() > 1e-2  # the pages do restrict
    for x, y in zip(g_split, g_full):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)


def test_allowed_key_mask_hand_example():
    """page_ids -> key mask: page ps*j..ps*j+ps-1 visible iff j recorded; NO_PAGE ignored;
    non-sparse queries see everything."""
    ids = np.full((1, 6, 1, 2), NO_PAGE, np.int32)
    ids[0, 4, 0] = [0, 2]
    ids[0, 5, 0] = [2, NO_PAGE]
    sq = np.array([[False, False, False, False, True, True]])
    m = np.asarray(jax.jit(lambda i, s: selection.allowed_key_mask(i, s, 6, 2))(ids, sq))
    assert m.shape == (1, 1, 6, 6)
    assert m[0, 0, :4].all()
    np.testing.assert_array_equal(m[0, 0, 4], [1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(m[0, 0, 5], [0, 0, 0, 0, 1, 1])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(budget=2), "budget"),  # < sink 1 + recent 2
        (dict(budget=4, sink_pages=2, recent_pages=3), "budget"),
        (dict(budget_schedule=((16, 4), (32, 2))), "budget"),
        (dict(recent_pages=0, budget=4), "recent_pages"),
        (dict(dense_layers=-1), "dense_layers"),
        (dict(budget_schedule=((32, 4), (16, 8))), "increasing"),
        (dict(policy="topk"), "policy"),
    ],
)
def test_sparse_spec_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SparseSpec(**kw)


def test_attention_spec_and_cache_validation():
    with pytest.raises(ValueError, match="impl"):
        AttentionSpec(impl="cuda")
    with pytest.raises(ValueError, match="page_size"):
        AttentionSpec(page_size=0)
    with pytest.raises(ValueError, match="multiple of the page size"):
        kv_cache.init_layer_cache(1, 1, 30, 8, jnp.float32, SEL_LAYER, AttentionSpec(page_size=4))
    SparseSpec(budget=3)  # == sink + recent: allowed


def test_grow_layer_cache_keeps_contents_and_zero_pads():
    spec = AttentionSpec(page_size=4, sparse=SparseSpec("quest", budget=3))
    rng = np.random.default_rng(0)
    c = {
        name: jnp.asarray(rng.normal(size=x.shape), jnp.float32)
        for name, x in kv_cache.init_layer_cache(2, 1, 8, 3, jnp.float32, SEL_LAYER, spec).items()
    }
    assert set(c) == {"k", "v", "kmin", "kmax"}
    g = kv_cache.grow_layer_cache(c, 20, 4)
    for name, x in c.items():
        n = 20 if name in ("k", "v") else 5
        assert g[name].shape == x.shape[:2] + (n,) + x.shape[3:]
        np.testing.assert_array_equal(g[name][:, :, : x.shape[2]], x)
        assert np.all(np.asarray(g[name][:, :, x.shape[2] :]) == 0)
    with pytest.raises(ValueError, match="multiple of the page size"):
        kv_cache.grow_layer_cache(c, 22, 4)
    with pytest.raises(ValueError, match="shrink"):
        kv_cache.grow_layer_cache(c, 4, 4)


# ----------------------------------------------------------------------------- (f)
@pytest.mark.parametrize("slices", [1, 2, 4])
def test_gather_rows_is_a_bitwise_row_gather(slices):
    """sparse._gather_rows (the K/V page gather of a decode step, FILL_OR_DROP mode) returns
    exactly the rows of the [B * K * pages, page_size * H] view it is given: numpy fancy
    indexing, bitwise, for ids anywhere in the cache (first and last row included), in one
    piece or in slices of the 6 page slots (4: uneven slices)."""
    b, kv, pages, ps, h, p = 3, 2, 9, 4, 5, 6
    rng = np.random.default_rng(3)
    x = rng.normal(size=(b, kv, pages * ps, h)).astype(np.float32)
    ids = rng.integers(0, pages, (b, kv, p)).astype(np.int32)
    ids[0, 0, 0], ids[-1, -1, -1] = 0, pages - 1
    rows = np.asarray(sparse._page_rows(jnp.asarray(ids), pages))
    got = np.asarray(jax.jit(sparse._gather_rows, static_argnums=(2, 3))(x, rows, ps, slices))
    want = x.reshape(b * kv * pages, ps * h)[rows].reshape(b, kv, p * ps, h)
    np.testing.assert_array_equal(got, want)


def test_sort_rows_is_a_stable_sort():
    """sparse._sort_rows (the rank sort of a decode step's page rows) equals numpy's stable
    argsort of the rows, with the ids carried along, bitwise: rows with ties (NO_PAGE and
    page 0 share row 0 of their head), already sorted, reversed, and random slots."""
    b, kv, pages, p = 4, 2, 40, 7
    rng = np.random.default_rng(5)
    ids = np.stack([rng.permutation(pages)[:p] for _ in range(b * kv)]).reshape(b, kv, p)
    # ties at row 0 (page 0 twice too: a repeat)
    ids[0, 0] = [0, NO_PAGE, 3, NO_PAGE, 0, 1, NO_PAGE]
    ids[1, 0], ids[1, 1] = np.arange(p), np.arange(p)[::-1]
    ids = ids.astype(np.int32)
    rows = np.asarray(sparse._page_rows(jnp.asarray(ids), pages))
    got_rows, got_ids = jax.device_get(jax.jit(sparse._sort_rows)(rows, ids))
    order = np.argsort(rows, axis=-1, kind="stable")
    np.testing.assert_array_equal(got_rows, np.take_along_axis(rows, order, -1))
    np.testing.assert_array_equal(got_ids, np.take_along_axis(ids, order, -1))
    assert list(got_ids[0, 0]) == [0, NO_PAGE, NO_PAGE, 0, NO_PAGE, 1, 3]  # slot order kept


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_sparse_decode_attention_matches_numpy(softcap):
    """One sparse decode step equals numpy attention over the keys of its selected pages
    at positions <= pos (NO_PAGE slots, a partial current page, GQA 2), f32, 1e-5."""
    b, kv, g, h, ps, pages = 3, 2, 2, 8, 4, 12
    rng = np.random.default_rng(4)
    q = rng.normal(size=(b, kv * g, h)).astype(np.float32)
    k, v = (rng.normal(size=(b, kv, pages * ps, h)).astype(np.float32) for _ in range(2))
    pos = np.array([45, 13, 30], np.int32)
    ids = np.full((b, kv, 5), NO_PAGE, np.int32)
    for r in range(b):
        for j in range(kv):
            cur = pos[r] // ps
            n = min(5, cur + 1) - j  # head 1 reads one page fewer: a NO_PAGE slot
            others = rng.permutation(cur)[: n - 1]
            ids[r, j, :n] = rng.permutation(np.concatenate([[cur], others]))
    layer = LayerInfo(index=1, window=None, softcap=softcap, scale=0.3)
    got = np.asarray(
        jax.jit(sparse.sparse_decode_attention, static_argnums=(5, 6))(q, k, v, pos, ids, layer, ps)
    )
    for r in range(b):
        for j in range(kv):
            keys = [t for pg in ids[r, j] if pg != NO_PAGE for t in range(pg * ps, pg * ps + ps)]
            keys = [t for t in keys if t <= pos[r]]
            s = q[r, j * g : (j + 1) * g] @ k[r, j, keys].T * 0.3
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max(-1, keepdims=True))
            want = (w / w.sum(-1, keepdims=True)) @ v[r, j, keys]
            np.testing.assert_allclose(got[r, j * g : (j + 1) * g], want, atol=1e-5, rtol=0)
