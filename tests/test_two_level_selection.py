"""Two-level page selection (SparseSpec.group_pages > 0).

(a) group summaries kept by prefill + decode writes, and rebuilt by refresh_summaries after
    a speculative step's rejected writes, equal numpy sums / minima / maxima of the true
    keys of each group of pages (f32, 1e-5);
(b) while the candidate groups cover every page, select_pages returns exactly the flat
    selection's ids (bitwise, same order);
(c) when they do not, the selected pages equal a numpy implementation of the two levels
    (group scores, reserved groups first, then the best pages among the candidates), and
    differ from the flat selection for some rows (the approximation is exercised);
(d) validation: group sizes, streaming, too few candidate groups; the cache grows its
    group summaries along the group axis.
The sampler's rollouts with two-level selection are checked against the teacher-forced
twin in test_sparse_attention.py (case centroid_two_level_kv2).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention import selection
from dsparse_jax.attention.selection import GROUP, NO_PAGE
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo, SparseSpec

B, K, G, H, PS, LEN, T, STEPS = 4, 2, 2, 4, 4, 64, 30, 20
LENGTHS = np.array([30, 7, 25, 2])  # final positions lengths + STEPS - 1: 49, 26, 44, 21
LAYER = LayerInfo(index=3, window=None, softcap=None, scale=1.0)
CASES = {  # name: (two-level spec, covers every page)
    "centroid_cover": (
        SparseSpec("centroid", 5, dense_layers=0, group_pages=2, candidate_groups=8),
        True,
    ),
    "quest_cover": (
        SparseSpec("quest", 5, dense_layers=0, group_pages=3, candidate_groups=6),
        True,
    ),
    "centroid": (
        SparseSpec("centroid", 5, dense_layers=0, group_pages=2, candidate_groups=4),
        False,
    ),
    "quest": (SparseSpec("quest", 6, dense_layers=0, group_pages=3, candidate_groups=4), False),
    "centroid_sink2_recent1": (
        SparseSpec(
            "centroid",
            6,
            sink_pages=2,
            recent_pages=1,
            dense_layers=0,
            group_pages=3,
            candidate_groups=3,
        ),
        False,
    ),
}


def data():
    rng = np.random.default_rng(0)
    # Keys mostly positive: a group min/max polluted by stale zeros changes the selection.
    k_prompt = 0.8 + 0.7 * rng.normal(size=(B, T, K, H))  # junk past the lengths
    k_steps = 0.8 + 0.7 * rng.normal(size=(STEPS, B, K, H))
    q = rng.normal(size=(B, K, G, H))
    junk = 5.0 + rng.normal(size=(B, 3, K, H))  # a speculative step's rejected writes
    return k_prompt, k_steps, q, junk


def true_keys(b):
    k_prompt, k_steps, _, _ = data()
    return np.concatenate([k_prompt[b, : LENGTHS[b]], k_steps[:, b]])  # [L, K, H]


@functools.lru_cache(maxsize=None)
def run_all():
    """Every case in one jit: prefill + STEPS decode writes, the summaries, the two-level
    and the flat selection at the last position, and the summaries after junk writes at the
    next 3 positions are refreshed away."""
    k_prompt, k_steps, q, junk = (jnp.asarray(x, jnp.float32) for x in data())

    def run(k_prompt, k_steps, q, junk, lengths):
        out = {}
        for name, (sp, _) in CASES.items():
            spec = AttentionSpec(page_size=PS, sparse=sp)
            c = kv_cache.init_layer_cache(B, K, LEN, H, jnp.float32, LAYER, spec)
            c = kv_cache.write_prefill(c, k_prompt, jnp.zeros_like(k_prompt), lengths, LAYER, spec)
            c = jax.lax.fori_loop(
                0,
                STEPS,
                lambda s, c: kv_cache.write_decode(
                    c, k_steps[s], jnp.zeros_like(k_steps[s]), lengths + s, LAYER, spec
                ),
                c,
            )
            end = lengths + STEPS  # keys at positions < end
            pos = end - 1
            flat = SparseSpec(
                sp.policy,
                sp.budget,
                sink_pages=sp.sink_pages,
                recent_pages=sp.recent_pages,
                dense_layers=0,
            )
            # Junk at [end, end + 3), summarised as decode would, then refreshed away.
            d = c
            for i in range(3):
                d = kv_cache.write_decode(d, junk[:, i], junk[:, i], end + i, LAYER, spec)
            d = kv_cache.refresh_summaries(d, end - 1, 4, end, LAYER, spec)
            out[name] = {
                "two_level": selection.select_pages(sp, c, q, pos, PS, LEN // PS),
                "flat": selection.select_pages(flat, c, q, pos, PS, LEN // PS),
                "summaries": {n: x for n, x in c.items() if n not in ("k", "v")},
                "refreshed": {n: x for n, x in d.items() if n not in ("k", "v")},
            }
        return out

    return jax.device_get(jax.jit(run)(k_prompt, k_steps, q, junk, jnp.asarray(LENGTHS)))


def np_summaries(policy, keys_LxKxH, span, num):
    """[K, num, H] per unit of `span` positions: key sums (centroid) or min/max."""
    out = {}
    units = [keys_LxKxH[u * span : (u + 1) * span] for u in range(num)]
    if policy == "centroid":
        out["ksum"] = np.stack([u.sum(0) if len(u) else np.zeros((K, H)) for u in units], 1)
    else:
        out["kmin"] = np.stack([u.min(0) if len(u) else np.zeros((K, H)) for u in units], 1)
        out["kmax"] = np.stack([u.max(0) if len(u) else np.zeros((K, H)) for u in units], 1)
    return out


def np_score(policy, qm, keys):
    if policy == "centroid":
        return qm @ keys.mean(0)
    return np.maximum(qm * keys.min(0), qm * keys.max(0)).sum()


def np_two_level(sp: SparseSpec, keys_LxKxH, q_KxGxH, pos):
    """The two levels in numpy, per KV head: score the existing groups (mean key, or the
    min/max bound), those holding reserved pages first; keep candidate_groups; fill the
    budget with the best non-reserved pages among their pages."""
    g, cur = sp.group_pages, pos // PS
    n_read = min(sp.budget, cur + 1)
    reserved = {j for j in range(cur + 1) if j < sp.sink_pages or j > cur - sp.recent_pages}
    out = []
    for h in range(K):
        qm = q_KxGxH[h].mean(0)
        gscore = {}
        for grp in range(cur // g + 1):
            pages = set(range(grp * g, min(grp * g + g, cur + 1)))
            keys = keys_LxKxH[grp * g * PS : min((grp + 1) * g * PS, pos + 1), h]
            gscore[grp] = np.inf if pages & reserved else np_score(sp.policy, qm, keys)
        cand = sorted(gscore, key=lambda grp: (-gscore[grp], grp))[: sp.candidate_groups]
        pages = {j for grp in cand for j in range(grp * g, min(grp * g + g, cur + 1))}
        assert reserved <= pages
        scores = {
            j: np_score(sp.policy, qm, keys_LxKxH[j * PS : min((j + 1) * PS, pos + 1), h])
            for j in pages - reserved
        }
        best = sorted(scores, key=lambda j: -scores[j])[: n_read - len(reserved)]
        out.append(reserved | set(best))
    return out, n_read


@pytest.mark.parametrize("case", list(CASES))
def test_group_summaries_match_numpy(case):
    """(a) after prefill + decode, and after junk writes refreshed away."""
    sp, _ = CASES[case]
    res = run_all()[case]
    for key in ("summaries", "refreshed"):
        got = res[key]
        assert set(got) == {
            n + s for n in np_summaries(sp.policy, true_keys(0), PS, 1) for s in ("", GROUP)
        }
        for b in range(B):
            keys = true_keys(b)
            for suffix, span, num in (
                ("", PS, LEN // PS),
                (
                    GROUP,
                    PS * sp.group_pages,
                    got[next(n for n in got if n.endswith(GROUP))].shape[2],
                ),
            ):
                for name, want in np_summaries(sp.policy, keys, span, num).items():
                    np.testing.assert_allclose(
                        got[name + suffix][b],
                        want,
                        atol=1e-5,
                        rtol=0,
                        err_msg=f"{key} {name}{suffix} row {b}",
                    )


@pytest.mark.parametrize("case", list(CASES))
def test_two_level_selection(case):
    """(b) covering candidates: the flat ids exactly; (c) otherwise numpy's two levels."""
    sp, covers = CASES[case]
    res = run_all()[case]
    ids, flat = res["two_level"], res["flat"]
    assert ids.shape == (B, K, sp.max_pages) and ids.dtype == np.int32
    if covers:
        np.testing.assert_array_equal(ids, flat)
        return
    _, _, q, _ = data()
    differs = 0
    for b in range(B):
        pos = LENGTHS[b] + STEPS - 1
        want, n_read = np_two_level(sp, true_keys(b), q[b], pos)
        for h in range(K):
            assert set(ids[b, h, :n_read]) == want[h], (b, h, ids[b, h], want[h])
            assert np.all(ids[b, h, n_read:] == NO_PAGE)
            differs += set(ids[b, h]) != set(flat[b, h])
    assert differs > 0  # the candidates leave pages out: not the flat selection


def test_covering_candidates_break_ties_as_flat():
    """Hand-built centroids where pages 2, 3 and 4 tie for the last budget slot and group
    (4, 5) outranks group (2, 3): the flat top-k takes the lowest page, 2, and so must the
    two-level selection (candidates in page order, not in group-score order)."""
    means = np.array([0, 0, 1, 1, 1, 3, 0, 0, 0, 0, 0, 0], np.float32)  # 11 pages exist
    ksum = jnp.asarray(means * PS)[None, None, :, None]
    summaries = {"ksum": ksum, "ksum" + GROUP: ksum.reshape(1, 1, 6, 2, 1).sum(3)}
    q, pos = jnp.ones((1, 1, 1, 1)), jnp.array([10 * PS + 3])
    flat = SparseSpec("centroid", 5, dense_layers=0)
    two = SparseSpec("centroid", 5, dense_layers=0, group_pages=2, candidate_groups=8)
    got = {
        sp: np.asarray(selection.select_pages(sp, summaries, q, pos, PS, 12)) for sp in (flat, two)
    }
    assert set(got[flat][0, 0]) == {0, 9, 10, 5, 2}
    np.testing.assert_array_equal(got[two], got[flat])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(group_pages=1), "group_pages"),
        (dict(group_pages=-2), "group_pages"),
        (dict(policy="streaming", group_pages=4), "streaming"),
        (dict(budget=32, group_pages=8, candidate_groups=6), "candidate_groups"),  # needs 7
        (
            dict(budget=6, sink_pages=2, recent_pages=1, group_pages=3, candidate_groups=2),
            "candidate_groups",
        ),
    ],
)
def test_two_level_spec_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SparseSpec(**kw)


def test_grow_layer_cache_pads_groups():
    spec = AttentionSpec(
        page_size=4, sparse=SparseSpec("quest", 3, group_pages=3, candidate_groups=3)
    )
    c = kv_cache.init_layer_cache(2, 1, 8, 3, jnp.float32, LAYER, spec)
    assert c["kmin" + GROUP].shape == (2, 1, 1, 3)  # 2 pages, 1 group
    g = kv_cache.grow_layer_cache(c, 28, 4, group_pages=3)  # 7 pages, 3 groups
    assert g["kmin"].shape[2] == 7 and g["kmax" + GROUP].shape[2] == 3
