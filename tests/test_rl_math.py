"""RL math: advantages, PPO loss, KL estimators, TIS/MIS, filters, mismatch metrics.

Expected values are hand-computed (see comments) or computed with numpy. To stay fast,
each test runs its cases inside one jitted function (one compile instead of many
op-by-op dispatches) and compares host numpy copies of the results.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.rl import advantages, corrections, filtering, losses, mismatch

LOG = math.log
f32 = np.float32


def run(fn, *args):
    """jit fn, run it on args, return the results as numpy."""
    return jax.device_get(jax.jit(fn)(*args))


# ---------------------------------------------------------------- advantages
def test_grpo_advantages_hand_values():
    r = np.array([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0], f32)
    # The f32 mean of (1.1, 1.1, 1.1) is off by ~1e-7 (XLA CPU), which std scaling with
    # eps=1e-6 would turn into ~-0.1 instead of 0.
    r_eq = np.array([1.1, 1.1, 1.1, 0.3, 0.1, 0.7], f32)
    g = advantages.grpo_advantages
    out = run(
        lambda r, r_eq: dict(
            grpo=g(r, 4),
            pop=g(r, 4, ddof=0, eps=0.0),
            dr=g(r, 4, scale_by_std=False),
            g1=g(r, 1),
            eq=g(r_eq, 3),
            eq_dr=g(r_eq, 3, scale_by_std=False),
        ),
        r,
        r_eq,
    )
    # Group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> +-0.5 * sqrt(3).
    a = 0.5 * math.sqrt(3.0)
    np.testing.assert_allclose(out["grpo"], [a, -a, a, -a, 0, 0, 0, 0], rtol=1e-5)
    np.testing.assert_allclose(out["pop"], [1, -1, 1, -1, 0, 0, 0, 0], rtol=1e-6)  # std 0.5
    np.testing.assert_allclose(out["dr"], [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0], rtol=1e-6)
    # All-equal groups give exact zeros; group_size 1 gives zeros (no NaN).
    assert np.all(out["grpo"][4:] == 0.0) and np.all(out["pop"][4:] == 0.0)
    np.testing.assert_array_equal(out["g1"], np.zeros(8))
    for k in ("eq", "eq_dr"):
        np.testing.assert_array_equal(out[k][:3], np.zeros(3))
        assert np.all(out[k][3:] != 0.0)
    with pytest.raises(ValueError):
        g(r, 3)


# ---------------------------------------------------------------- policy loss
CLIP = dict(clip_low=0.2, clip_high=0.28)


def _ppo_case():
    """Two sequences (A=+1, A=-2) with known ratios, one masked garbage token each,
    and a third, fully masked sequence."""
    ratios = np.array([[0.5, 1.0, 1.5, 1.0], [0.5, 1.2, 4.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    old = np.array([[-1.0, -2.0, -0.5, -3.0], [-2.0, -1.0, -4.0, -1.0], [-1.0] * 4])
    logp = old + np.log(ratios)
    logp[0, 3] = 50.0  # masked garbage
    logp[1, 3] = -1e9
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], f32)
    adv = np.array([1.0, -2.0, 5.0], f32)
    return logp.astype(f32), old.astype(f32), adv, mask


def test_policy_loss_clip_hand_values():
    logp, old, adv, mask = _ppo_case()
    pl = lambda **kw: losses.policy_loss(logp, old, adv, mask, **CLIP, **kw)
    (num, den, met), (num_d, _, met_d), (num_s, den_s, _) = run(
        lambda: (pl(), pl(dual_clip=3.0), pl(agg="seq-mean-token-mean"))
    )
    # clip_low 0.2, clip_high 0.28 -> ratio clipped to [0.8, 1.28].
    # A=+1: ratio .5 -> max(-.5, -.8) = -.5; 1 -> -1; 1.5 -> max(-1.5, -1.28) = -1.28 (clip, high)
    # A=-2: ratio .5 -> max(1, 1.6) = 1.6 (clip, low); 1.2 -> 2.4; 4 -> max(8, 2.56) = 8
    np.testing.assert_allclose(num, -0.5 - 1 - 1.28 + 1.6 + 2.4 + 8.0, rtol=1e-5)
    assert den == 6.0
    assert met["clip_frac_sum"] == 2.0 and met["num_tokens"] == 6.0
    assert met["clip_frac_low_sum"] == 1.0 and met["clip_frac_high_sum"] == 1.0
    assert met["dual_clip_frac_sum"] == 0.0
    np.testing.assert_allclose(met["ratio_sum"], 0.5 + 1 + 1.5 + 0.5 + 1.2 + 4.0, rtol=1e-5)
    np.testing.assert_allclose([met["ratio_max"], met["ratio_min"]], [4.0, 0.5], rtol=1e-5)
    np.testing.assert_allclose(
        met["ppo_kl_sum"], -np.log([0.5, 1.5, 0.5, 1.2, 4.0]).sum(), rtol=1e-5
    )
    np.testing.assert_allclose(losses.combine_metrics([met])["clip_frac"], 2.0 / 6.0, rtol=1e-6)
    # Dual clip c=3: A=-2, ratio 4 -> min(8, 2 * 3) = 6.
    np.testing.assert_allclose(num_d, 9.22 - 2.0, rtol=1e-5)
    assert met_d["dual_clip_frac_sum"] == 1.0
    # seq-mean-token-mean: (-2.78 / 3 + 12 / 3) over the 2 non-empty sequences.
    np.testing.assert_allclose(num_s, -2.78 / 3 + 4.0, rtol=1e-5)
    assert den_s == 2.0
    with pytest.raises(ValueError):
        pl(dual_clip=0.9)
    with pytest.raises(ValueError):
        pl(agg="sum")


def test_policy_loss_gradients_and_weights():
    logp, old, adv, mask = _ppo_case()
    w = np.array([[2.0, 1.0, 0.5, 9.0], [1.0, 0.5, 0.25, 9.0], [9.0] * 4], f32)

    def fn(lp, w):
        f = lambda lp_, w_, dual: losses.policy_loss(
            lp_, old, adv, mask, dual_clip=dual, token_weights_BxT=w_, **CLIP
        )[0]
        return (
            jax.grad(f)(lp, None, None),
            jax.grad(f)(lp, None, 3.0),
            f(lp, w, None),
            jax.grad(f, argnums=1)(lp, w, None),
        )

    g, g_d, num_w, g_w = run(fn, logp, w)
    # d/dlogp of -A * ratio is -A * ratio where unclipped, 0 where clipped or masked.
    np.testing.assert_allclose(g, [[-0.5, -1.0, 0, 0], [0, 2.4, 8.0, 0], [0, 0, 0, 0]], rtol=1e-5)
    np.testing.assert_allclose(g_d, [[-0.5, -1.0, 0, 0], [0, 2.4, 0, 0], [0, 0, 0, 0]], rtol=1e-5)
    # Token weights multiply the per-token loss and receive no gradient.
    np.testing.assert_allclose(num_w, -1.0 - 1.0 - 0.64 + 1.6 + 1.2 + 2.0, rtol=1e-5)
    np.testing.assert_array_equal(g_w, np.zeros((3, 4)))


def test_minibatch_sums_equal_full_batch():
    rng = np.random.default_rng(0)
    B, T = 6, 7
    logp = rng.normal(-1.0, 0.5, (B, T)).astype(f32)
    old = (logp + rng.normal(0, 0.3, (B, T))).astype(f32)
    adv = rng.normal(size=B).astype(f32)
    lengths = np.array([7, 6, 5, 0, 1, 2])  # the halves hold 18 and 3 tokens
    mask = (np.arange(T)[None] < lengths[:, None]).astype(f32)
    halves = (slice(0, 3), slice(3, 6))

    def fn(logp, old, adv, mask):
        out = {}
        for agg in ("token-mean", "seq-mean-token-mean"):

            def num_den_grad(s):
                f = lambda lp: losses.policy_loss(
                    lp, old[s], adv[s], mask[s], dual_clip=3.0, agg=agg, **CLIP
                )
                return f(logp[s])[:2], jax.grad(lambda lp: f(lp)[0])(logp[s])

            out[agg] = [num_den_grad(s) for s in (slice(None),) + halves]
        out["metrics"] = [
            losses.policy_loss(logp[s], old[s], adv[s], mask[s], **CLIP)[2]
            for s in (slice(None),) + halves
        ]
        return out

    out = run(fn, logp, old, adv, mask)
    for agg in ("token-mean", "seq-mean-token-mean"):
        ((n_full, d_full), g_full), *parts = out[agg]
        np.testing.assert_allclose(
            sum(p[0][0] for p in parts) / sum(p[0][1] for p in parts), n_full / d_full, rtol=1e-6
        )
        # The mean of the minibatch losses would be wrong here (different denominators).
        assert abs(np.mean([p[0][0] / p[0][1] for p in parts]) - n_full / d_full) > 1e-2
        # Gradient: accumulate grads of the numerators, divide by the total denominator.
        np.testing.assert_allclose(
            np.concatenate([p[1] for p in parts]), g_full, rtol=1e-5, atol=1e-7
        )
    # Metrics combine exactly too.
    full = losses.combine_metrics(out["metrics"][:1])
    comb = losses.combine_metrics(out["metrics"][1:])
    assert set(full) == {
        "clip_frac",
        "clip_frac_low",
        "clip_frac_high",
        "dual_clip_frac",
        "ratio",
        "ppo_kl",
        "ratio_max",
        "ratio_min",
        "num_tokens",
    }
    for k in full:
        np.testing.assert_allclose(comb[k], full[k], rtol=1e-6)


# ---------------------------------------------------------------- KL
def test_kl_estimators_and_clamps():
    logp = np.array([-1.0, -2.0, -30.0, 0.0], f32)
    ref = np.array([-1.5, -1.0, 0.0, -25.0], f32)
    kl = losses.kl_estimate

    def fn(logp, ref):
        return dict(
            k1=kl(logp, ref, "k1"),
            k2=kl(logp, ref, "k2"),
            k3=kl(logp, ref, "k3"),
            k3_noklclamp=kl(logp, ref, "k3", kl_clamp=None),
            k3_raw=kl(logp, ref, "k3", log_ratio_clamp=None, kl_clamp=None),
            k3_tight=kl(logp, ref, "k3", log_ratio_clamp=0.25, kl_clamp=None),
            grads=jax.grad(lambda a, b: kl(a, b, "k3").sum(), argnums=(0, 1))(logp, ref),
        )

    out = run(fn, logp, ref)
    # r = ref - logp = [-0.5, 1, 30, -25]
    np.testing.assert_allclose(out["k1"], [0.5, -1, -30, 25], rtol=1e-6)
    np.testing.assert_allclose(out["k2"], [0.125, 0.5, 450, 312.5], rtol=1e-6)
    # k3: r clamped to [-0.5, 1, 20, -20]; exp(r) - r - 1 = [exp(-.5) - .5, e - 2,
    # exp(20) - 21, 19 + exp(-20)], then clamped to +-10.
    np.testing.assert_allclose(out["k3"], [math.exp(-0.5) - 0.5, math.e - 2, 10.0, 10.0], rtol=1e-5)
    np.testing.assert_allclose(
        out["k3_noklclamp"], [math.exp(-0.5) - 0.5, math.e - 2, math.exp(20) - 21, 19.0], rtol=1e-5
    )
    np.testing.assert_allclose(out["k3_raw"][3], math.exp(-25) + 24, rtol=1e-6)
    np.testing.assert_allclose(
        out["k3_tight"],
        [
            math.exp(-0.25) - 0.75,
            math.exp(0.25) - 1.25,
            math.exp(0.25) - 1.25,
            math.exp(-0.25) - 0.75,
        ],
        rtol=1e-5,
    )
    # Gradient w.r.t. logp: d/dlogp (exp(r) - r - 1) = 1 - exp(r) unclamped, 0 when clamped;
    # the reference gets no gradient.
    g_lp, g_ref = out["grads"]
    np.testing.assert_allclose(g_lp, [1 - math.exp(-0.5), 1 - math.e, 0, 0], rtol=1e-5)
    np.testing.assert_array_equal(g_ref, np.zeros(4))
    with pytest.raises(ValueError):
        kl(logp, ref, "k4")


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_exact_kl_against_numpy():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(2, 3, 11)).astype(f32)
    b = (rng.normal(size=(2, 3, 11)) * 2).astype(f32)
    a_inf = a.copy()
    a_inf[..., :3] = -np.inf  # zero-probability entries of `a`
    out = run(
        lambda a, b, a_inf: dict(
            ab=losses.exact_kl(a, b),
            aa=losses.exact_kl(a, a),
            rev=losses.reverse_kl(a, b),
            fwd=losses.forward_kl(a, b),
            inf=losses.exact_kl(a_inf, b),
            g_inf=jax.grad(lambda x: losses.exact_kl(x, b).sum())(a_inf),
        ),
        a,
        b,
        a_inf,
    )
    pa, pb = _np_softmax(a.astype(np.float64)), _np_softmax(b.astype(np.float64))
    kl_ab = np.sum(pa * (np.log(pa) - np.log(pb)), -1)
    kl_ba = np.sum(pb * (np.log(pb) - np.log(pa)), -1)
    np.testing.assert_allclose(out["ab"], kl_ab, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["rev"], kl_ab, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["fwd"], kl_ba, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["aa"], np.zeros((2, 3)), atol=1e-6)
    pa_inf = _np_softmax(a_inf.astype(np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(pa_inf > 0, pa_inf * (np.log(pa_inf) - np.log(pb)), 0.0)
    np.testing.assert_allclose(out["inf"], terms.sum(-1), rtol=1e-4)
    assert np.all(np.isfinite(out["g_inf"]))


# ---------------------------------------------------------------- TIS / MIS
def test_tis_weights():
    # rho = exp(old - mu): row 0 [1, 0.5, 3, 1.5] with the last token masked;
    # row 1: rho = exp(200) overflows f32 unless handled in log space.
    old = np.array([[0.0, 0.0, 0.0, 0.0], [200.0, 0.0, 0.0, 0.0]], f32)
    mu = np.array([[0.0, LOG(2.0), -LOG(3.0), -LOG(1.5)], [0.0, 0.0, 0.0, 0.0]], f32)
    mask = np.array([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]], f32)
    tis = lambda o: corrections.tis_weights(o, mu, mask, 2.0)
    (w, met), g = run(lambda o: (tis(o), jax.grad(lambda o_: tis(o_)[0].sum())(o)), old)
    np.testing.assert_allclose(w, [[1.0, 0.5, 2.0, 0.0], [2.0, 0, 0, 0]], rtol=1e-6)
    np.testing.assert_allclose(met["tis_clip_frac"], 2 / 4, rtol=1e-6)
    np.testing.assert_allclose(met["tis_weight_mean"], 5.5 / 4, rtol=1e-6)
    np.testing.assert_array_equal(g, np.zeros((2, 4)))


def test_mis_mask_token_and_sequence():
    # Token level: keep iff rho in [0.5, 2]; row 0's last token is masked garbage (rho 100).
    # Sequence level (geometric mean over counted tokens): row 0 (1.9*1.9*0.6)^(1/3) = 1.29
    # keep (counting the 100 would drop it); row 1 3^(2/3) = 2.08 drop; row 2 0.1^(1/3) = 0.46
    # drop; row 3 (1 * .4 * 3 * 1.9)^(1/4) = 1.23 keep.
    log_rho = np.log(
        np.array(
            [
                [1.9, 1.9, 0.6, 100.0],
                [3.0, 3.0, 1.0, 1.0],
                [0.1, 1.0, 1.0, 1.0],
                [1.0, 0.4, 3.0, 1.9],
            ],
            f32,
        )
    )
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]], f32)
    zeros = np.zeros((4, 4), f32)
    (keep_t, met_t), (keep_s, met_s) = run(
        lambda lr: (
            corrections.mis_mask(lr, zeros, mask, 0.5, 2.0, level="token"),
            corrections.mis_mask(lr, zeros, mask, 0.5, 2.0, level="sequence"),
        ),
        log_rho,
    )
    np.testing.assert_array_equal(keep_t, [[1, 1, 1, 0], [0, 0, 1, 0], [0, 1, 1, 0], [1, 0, 0, 1]])
    np.testing.assert_allclose(met_t["mis_masked_frac"], 5 / 13, rtol=1e-6)
    np.testing.assert_array_equal(keep_s, [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_allclose(met_s["mis_masked_frac"], 6 / 13, rtol=1e-6)
    with pytest.raises(ValueError):
        corrections.mis_mask(log_rho, zeros, mask, 0.5, 2.0, level="batch")


# ---------------------------------------------------------------- filtering
def test_top_n_keeps_highest_and_breaks_ties_randomly():
    r = np.array([[0.0, 3.0, 1.0, 2.0, -1.0], [1.0, 0.0, 1.0, 0.5, 1.0]], f32)
    r_many = np.tile(r[1], (600, 1))  # 600 prompts with the same three-way tie
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    top = filtering.top_n_by_reward
    out = run(
        lambda r, r_many, keys: dict(
            per_key=jax.vmap(lambda k: top(r, 2, k))(keys),
            again=top(r, 2, keys[0]),
            n4=top(r, 4, keys[0]),
            many=top(r_many, 2, keys[0]),
        ),
        r,
        r_many,
        keys,
    )
    per_key = out["per_key"]  # [8 keys, P, n]
    assert np.all(per_key[:, 0] == [1, 3])  # highest first, decreasing reward
    np.testing.assert_array_equal(out["again"], per_key[0])  # deterministic per key
    np.testing.assert_array_equal(out["n4"][0], [1, 3, 2, 0])
    assert np.all(np.isin(per_key[:, 1], [0, 2, 4]))
    assert len({tuple(sorted(p)) for p in per_key[:, 1].tolist()}) > 1  # differs across keys
    # Over 600 tied groups each pair of the three tied samples is kept ~1/3 of the time.
    pairs = [tuple(sorted(p)) for p in out["many"].tolist()]
    for pair in [(0, 2), (0, 4), (2, 4)]:
        assert 0.25 < pairs.count(pair) / 600 < 0.42, (pair, pairs.count(pair))
    with pytest.raises(ValueError):
        top(r, 6, keys[0])


def test_filter_then_advantages_on_kept():
    M, n = 4, 2
    rewards_PxM = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]], f32)
    batch = {"rewards": rewards_PxM.reshape(-1), "tokens": np.arange(8 * 3).reshape(8, 3)}

    def fn(rewards_PxM, batch, key):
        idx = filtering.top_n_by_reward(rewards_PxM, n, key)
        kept = filtering.gather_kept(batch, idx, M)
        adv = advantages.grpo_advantages(kept["rewards"], n, ddof=0, eps=0.0)
        return filtering.flat_kept_indices(idx, M), kept, adv

    rows, kept, adv = run(fn, rewards_PxM, batch, jax.random.PRNGKey(3))
    assert sorted(rows[:2].tolist()) == [1, 3]
    assert sorted(rows[2:].tolist()) == [4, 5]  # groups stay contiguous
    np.testing.assert_array_equal(kept["tokens"], batch["tokens"][rows])
    np.testing.assert_array_equal(kept["rewards"], batch["rewards"][rows])
    # Advantages over the kept n only: {3, 2} -> +1 / -1, {5, 5} -> 0.
    kr = kept["rewards"]
    np.testing.assert_allclose(adv, np.select([kr == 3.0, kr == 2.0], [1.0, -1.0], 0.0))
    with pytest.raises(ValueError):
        filtering.gather_kept(np.zeros(7), np.zeros((2, 2), np.int32), M)


def test_acceptance_rate_select():
    # Deterministic part: log-ratio 1 >= log C passes with prob 1, -200 with prob exp(-200) = 0.
    P, M, T = 2, 3, 4
    lr = np.full((P * M, T), -200.0, f32)
    for b, k in enumerate([2, 4, 1, 0, 3, 3]):  # tokens passing per trajectory
        lr[b, :k] = 1.0
    mask = np.ones((P * M, T), f32)
    mask[5, 3] = 0.0  # traj 5: 3 passing of 3 counted -> 1.0
    # Statistical part: prob = min(1, ratio / C): ratio 3, C 2 -> 1; ratio .5, C 2 -> .25.
    T2 = 4000
    lr2 = np.concatenate([np.full((1, T2), LOG(3.0)), np.full((1, T2), LOG(0.5))]).astype(f32)
    (idx, frac), frac2 = run(
        lambda lr, lr2, key: (
            filtering.acceptance_rate_select(
                lr - 1.0, jnp.full(lr.shape, -1.0), mask, 2.0, 2, M, key
            ),
            filtering.acceptance_fraction(lr2, jnp.zeros(lr2.shape), jnp.ones(lr2.shape), 2.0, key),
        ),
        lr,
        lr2,
        jax.random.PRNGKey(0),
    )
    np.testing.assert_allclose(frac, [0.5, 1.0, 0.25, 0.0, 0.75, 1.0], rtol=1e-6)
    np.testing.assert_array_equal(idx, [[1, 0], [2, 1]])
    assert frac2[0] == 1.0
    assert abs(frac2[1] - 0.25) < 0.03  # std 0.007


# ---------------------------------------------------------------- mismatch metrics
def test_token_acceptance_and_kl_against_numpy():
    rng = np.random.default_rng(2)
    p = rng.normal(size=(2, 3, 7)).astype(f32)
    q = (p + rng.normal(size=(2, 3, 7))).astype(f32)
    acc, acc_pp, kl = run(
        lambda p, q: (
            mismatch.token_acceptance(p, q),
            mismatch.token_acceptance(p, p),
            mismatch.token_kl(p, q),
        ),
        p,
        q,
    )
    pp, pq = _np_softmax(p.astype(np.float64)), _np_softmax(q.astype(np.float64))
    np.testing.assert_allclose(acc, np.minimum(pp, pq).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(acc, 1 - 0.5 * np.abs(pp - pq).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(acc_pp, np.ones((2, 3)), rtol=1e-6)
    np.testing.assert_allclose(kl, np.sum(pp * np.log(pp / pq), -1), rtol=1e-4, atol=1e-6)


def test_masked_percentile_and_position_bins_against_numpy():
    rng = np.random.default_rng(3)
    x = rng.uniform(size=(4, 9)).astype(f32)
    m = rng.uniform(size=(4, 9)) < 0.6
    qs = [0.0, 5.0, 37.5, 50.0, 100.0]
    B, T, prompt = 3, 40, 5
    alpha = rng.uniform(0.5, 1.0, size=(B, T)).astype(f32)
    lengths = np.array([34, 12, 30])
    t = np.arange(T)[None]
    positions = np.broadcast_to(t - prompt, (B, T)).astype(np.int32)
    mask = ((t >= prompt) & (t < prompt + lengths[:, None])).astype(f32)
    pb = lambda bw, k: mismatch.position_bins(alpha, mask, positions, bw, k)
    out = run(
        lambda x, m: dict(
            pct=[mismatch.masked_percentile(x, m, q) for q in qs],
            empty=mismatch.masked_percentile(x, jnp.zeros_like(m), 5.0),
            median=mismatch.masked_percentile(x, jnp.ones_like(m), 50.0),
            b5=pb(8, 5),  # positions 0..33; bin 4 = [32, 40) holds 2 tokens
            b4=pb(8, 4),  # positions >= 32 dropped
            wide=pb(16, 4),  # bin 3 = [48, 64) empty
        ),
        x,
        m,
    )
    for q, v in zip(qs, out["pct"]):
        np.testing.assert_allclose(v, np.percentile(x[m], q), rtol=1e-5)  # method='linear'
    assert np.isnan(out["empty"])
    np.testing.assert_allclose(out["median"], np.median(x), rtol=1e-5)

    for name, bw in (("b5", 8), ("wide", 16)):
        res = out[name]
        for k in range(len(res["count"])):
            sel = (mask > 0) & (positions // bw == k)
            assert res["count"][k] == sel.sum()
            if sel.any():
                np.testing.assert_allclose(res["mean"][k], alpha[sel].mean(), rtol=1e-5)
                np.testing.assert_allclose(
                    res["percentile"][k], np.percentile(alpha[sel], 5.0), rtol=1e-5
                )
    assert out["b5"]["count"][4] == 2
    assert out["b4"]["count"].sum() == mask.sum() - 2
    np.testing.assert_allclose(out["b4"]["percentile"], out["b5"]["percentile"][:4])
    assert out["wide"]["count"][3] == 0
    assert np.isnan(out["wide"]["percentile"][3]) and np.isnan(out["wide"]["mean"][3])


def test_log_ratio_stats():
    a = np.array([[-1.0, -2.0, -3.0], [-1.0, 7.0, 0.0], [0.0, 0.0, 0.0]], f32)
    b = np.array([[-1.5, -1.0, -3.0], [-4.0, 0.0, 0.0], [9.0, 9.0, 9.0]], f32)
    mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], f32)
    # d over masked tokens: [0.5, -1, 0] and [3]; garbage (7 - 0, -9) excluded.
    s = run(mismatch.log_ratio_stats, a, b, mask)
    np.testing.assert_allclose(s["mean"], 2.5 / 4, rtol=1e-6)
    np.testing.assert_allclose(s["mean_abs"], 4.5 / 4, rtol=1e-6)
    np.testing.assert_allclose(s["max_abs"], 3.0, rtol=1e-6)
    np.testing.assert_allclose(s["seq_mean"], (-0.5 + 3.0) / 2, rtol=1e-6)
    np.testing.assert_allclose(s["seq_token_mean"], (-0.5 / 3 + 3.0) / 2, rtol=1e-6)


def test_masked_helpers_ignore_garbage():
    x = np.array([[1.0, np.nan, 3.0], [np.inf, -np.inf, 2.0]], f32)
    mask = np.array([[1, 0, 1], [0, 0, 1]], f32)
    (s, n), mean, empty = run(
        lambda x, m: (
            losses.masked_sum_count(x, m),
            losses.masked_mean(x, m),
            losses.masked_mean(x, jnp.zeros_like(m)),
        ),
        x,
        mask,
    )
    assert (s, n) == (6.0, 3.0) and mean == 2.0 and empty == 0.0
