"""theta's objectives (rl/objectives.py) against their papers' formulas, written directly
in numpy (float64): every advantage estimator and every policy loss, values and gradients
(finite differences of the numpy objective), at and around the clip boundaries, the exact
microbatch num / den sums, and planted errors (a flipped sign, a shifted clip, a missing
stop-gradient) that the same comparisons reject. Also DAPO's overlong terms and dynamic
sampling's group picks.

One jitted call per test computes every jnp output (one compile each)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.rl import filtering, losses, objectives, shaping

f32 = np.float32


def run(fn, *args):
    return jax.device_get(jax.jit(fn)(*args))


# ----------------------------------------------------------- the papers' formulas, numpy
def np_aggregate(l_BxT, m_BxT, agg):
    """token-mean: sum of masked l / masked tokens; seq-mean-token-mean: the mean over
    sequences with tokens of each one's token-mean."""
    if agg == "token-mean":
        return np.sum(l_BxT * m_BxT) / np.sum(m_BxT)
    n_B = m_BxT.sum(1)
    has = n_B > 0
    return np.mean(np.sum(l_BxT * m_BxT, 1)[has] / n_B[has])


def np_ppo_clip(logp, old, adv, m, lo, hi, agg, dual=None, logp_sg=None):
    """PPO-clip (GRPO/DAPO token level): max(-A r, -A clip(r, 1-lo, 1+hi)) [min(., -A c)
    for A < 0 with dual clip c]."""
    r = np.exp(logp - old)
    a = adv[:, None]
    l = np.maximum(-a * r, -a * np.clip(r, 1 - lo, 1 + hi))
    if dual is not None:
        l = np.where(a < 0, np.minimum(l, -a * dual), l)
    return np_aggregate(l, m, agg)


def np_gspo(logp, old, adv, m, lo, hi, agg, logp_sg=None):
    """GSPO eq. (5)-(7): s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|), J = mean_i min(s_i A_i,
    clip(s_i, 1-lo, 1+hi) A_i); loss = -J, each sequence's term on its tokens."""
    n = m.sum(1)
    s = np.exp(np.sum((logp - old) * m, 1) / np.maximum(n, 1))
    l_i = -np.minimum(s * adv, np.clip(s, 1 - lo, 1 + hi) * adv)
    return np_aggregate(np.broadcast_to(l_i[:, None], m.shape), m, agg)


def np_cispo(logp, old, adv, m, lo, hi, agg, logp_sg):
    """CISPO (MiniMax-M1 eq. 4-5): J = 1/sum|o_i| sum_i sum_t sg(clip(r_it, 1-lo, 1+hi))
    A_i log pi(o_it); the weight is evaluated at logp_sg (held fixed: the stop-gradient)."""
    w = np.clip(np.exp(logp_sg - old), 1 - lo, 1 + hi)
    return np_aggregate(-w * adv[:, None] * logp, m, agg)


NP_LOSSES = {"ppo_clip": np_ppo_clip, "gspo": np_gspo, "cispo": np_cispo}


def np_value_and_grad(ref, logp, old, adv, m, **kw):
    """The numpy objective and its gradient in logp by central differences (float64)."""
    lp, o, a, mm = (np.asarray(x, np.float64) for x in (logp, old, adv, m))
    f = lambda x: ref(x, o, a, mm, logp_sg=lp, **kw)
    g, h = np.zeros_like(lp), 1e-6
    for b, t in zip(*np.nonzero(mm)):
        up, down = lp.copy(), lp.copy()
        up[b, t] += h
        down[b, t] -= h
        g[b, t] = (f(up) - f(down)) / (2 * h)
    return f(lp), g


def np_grpo(r_PxG, eps=1e-6):
    out = []
    for g in r_PxG:
        out.append(
            np.zeros_like(g) if g.max() == g.min() else (g - g.mean()) / (g.std(ddof=1) + eps)
        )
    return np.concatenate(out)


def np_dr_grpo(r_PxG):
    return np.concatenate([g - g.mean() for g in r_PxG])


def np_rloo(r_PxG):
    """r_i minus the mean of the other rewards of its group, by an explicit loop."""
    out = []
    for g in r_PxG:
        out.append([g[i] - np.mean(np.delete(g, i)) for i in range(len(g))])
    return np.concatenate(out)


NP_ADVANTAGES = {"grpo": np_grpo, "dr_grpo": np_dr_grpo, "rloo": np_rloo}


# ------------------------------------------------------------------------------ inputs
def loss_case(seed=0):
    """B = 8 sequences of up to T = 6 tokens: varied lengths (one of length 1, one empty),
    advantages of both signs, per-token log ratios spread over several clip ranges, and
    garbage at masked positions. Ratios sit at least 1e-3 from 0.8 / 1.2 / 1.28 (token),
    so finite differences do not straddle a PPO kink."""
    rng = np.random.default_rng(seed)
    B, T = 8, 6
    lengths = np.array([6, 5, 1, 3, 6, 0, 4, 2])
    m = (np.arange(T)[None] < lengths[:, None]).astype(f32)
    adv = np.array([1.3, -0.7, 0.9, -1.6, 0.4, 2.0, -0.2, 0.8], f32)
    old = rng.normal(-1.5, 0.6, (B, T)).astype(f32)
    scale = np.array([0.4, 0.35, 0.3, 0.5, 1e-4, 0.3, 2e-4, 0.25])[:, None]  # rows 4, 6: tiny
    shift = np.array([0.0, -0.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2])[:, None]  # sequence ratios
    log_r = rng.normal(0, 1, (B, T)) * scale + shift  # off 1 on both sides (A < 0 and > 0)
    r = np.exp(log_r)
    for bound in (0.8, 1.2, 1.28, 0.9, 1.15):  # keep token ratios off the PPO kinks
        near = np.abs(r - bound) < 1e-3
        r = np.where(near, bound + np.sign(r - bound + 1e-12) * 2e-3, r)
    logp = (old + np.log(r)).astype(f32)
    logp = np.where(m > 0, logp, np.where(np.arange(T)[None] % 2, 50.0, -1e9)).astype(f32)
    return logp, old, adv, m


# clip ranges per loss: the defaults of rl/objectives + a range the ratios cross (GSPO's
# paper range is too narrow for most random sequences: rows 4 and 6 fall inside it).
CLIPS = {
    "ppo_clip": [dict(lo=0.2, hi=0.28), dict(lo=0.2, hi=0.28, dual=3.0)],
    "gspo": [dict(lo=3e-4, hi=4e-4), dict(lo=0.1, hi=0.15)],
    "cispo": [dict(lo=1.0, hi=4.0), dict(lo=0.1, hi=0.15)],
}
AGGS = ("token-mean", "seq-mean-token-mean")


def jax_loss(name, clip, agg, planted=None):
    """fn(logp, old, adv, m) -> (num, den, grad of num/den, metrics) of table entry `name`."""
    fn = objectives.POLICY_LOSSES[name].fn
    kw = dict(clip_low=clip["lo"], clip_high=clip["hi"], dual_clip=clip.get("dual"), agg=agg)
    if planted == "clip":  # the upper clip shifted by 0.05
        kw["clip_high"] += 0.05
    if planted == "token_level":  # GSPO's ratio per token instead of per sequence
        fn = losses.policy_loss

    def out(logp, old, adv, m):
        if planted == "sign":
            adv = -adv
        if planted == "no_stop_gradient":  # CISPO's weight left differentiable
            lo, hi = kw["clip_low"], kw["clip_high"]
            loss = lambda lp: losses.aggregate(
                -jnp.clip(jnp.exp(lp - old), 1 - lo, 1 + hi)
                * adv[:, None]
                * jnp.where(m > 0, lp, 0),
                m,
                agg,
            )
        else:
            loss = lambda lp: fn(lp, old, adv, m, **kw)[:2]
        num, den = loss(logp)
        grad = jax.grad(lambda lp: (lambda nd: nd[0] / nd[1])(loss(lp)))(logp)
        return num, den, grad, fn(logp, old, adv, m, **kw)[2]

    return out


def assert_matches(got, ref_value, ref_grad):
    num, den, grad, _ = got
    np.testing.assert_allclose(num / den, ref_value, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=2e-3, atol=2e-5)


# ----------------------------------------------------------------------- policy losses
PLANTED = {
    "ppo_clip": ("sign", "clip"),
    "gspo": ("sign", "clip", "token_level"),
    "cispo": ("sign", "clip", "no_stop_gradient"),
}


def test_every_table_entry_is_tested():
    assert set(objectives.POLICY_LOSSES) == set(NP_LOSSES) == set(PLANTED) == set(CLIPS)
    assert set(objectives.ADVANTAGES) == set(NP_ADVANTAGES)


@pytest.mark.parametrize("name", sorted(objectives.POLICY_LOSSES))
def test_policy_loss_matches_its_paper(name):
    logp, old, adv, m = loss_case()
    cases = [(clip, agg, None) for clip in CLIPS[name] for agg in AGGS]
    cases += [(CLIPS[name][1], "token-mean", p) for p in PLANTED[name]]
    got = run(lambda *a: [jax_loss(name, c, agg, p)(*a) for c, agg, p in cases], logp, old, adv, m)
    for (clip, agg, planted), out in zip(cases, got):
        kw = {"lo": clip["lo"], "hi": clip["hi"], "agg": agg}
        if "dual" in clip:
            kw["dual"] = clip["dual"]
        ref = np_value_and_grad(NP_LOSSES[name], logp, old, adv, m, **kw)
        assert np.all(out[2][m == 0] == 0.0), "masked tokens get no gradient"
        if planted is None:
            assert_matches(out, *ref)
            met = out[3]
            if clip is CLIPS[name][1]:  # this range is crossed on both sides, not everywhere
                assert met["clip_frac_low_sum"] > 0 and met["clip_frac_high_sum"] > 0, met
                assert met["clip_frac_sum"] < met["num_tokens"], met
        else:  # the comparison catches the planted error
            with pytest.raises(AssertionError):
                assert_matches(out, *ref)


def test_clip_boundaries_exactly():
    """Token ratios exactly at 1 - lo and 1 + hi: the clipped and unclipped terms agree
    (the value is continuous); just past them the clipped side is constant."""
    lo, hi = 0.2, 0.28
    r = np.array([[1 - lo, 1 + hi, 1 - lo - 0.01, 1 + hi + 0.01]], np.float64)
    old = np.full((1, 4), -1.0, f32)
    logp = (old + np.log(r)).astype(f32)
    m = np.ones((1, 4), f32)
    for a in (1.0, -1.0):
        adv = np.array([a], f32)
        per_token = lambda fn, lp: [
            fn(
                lp[:, i : i + 1], old[:, i : i + 1], adv, m[:, i : i + 1], clip_low=lo, clip_high=hi
            )[0]
            for i in range(4)
        ]
        ppo, gspo, cispo = run(
            lambda lp: [
                per_token(f, lp) for f in (losses.policy_loss, losses.gspo_loss, losses.cispo_loss)
            ],
            logp,
        )
        r32 = np.exp(logp.astype(np.float64) - old)[0]
        want = np.maximum(-a * r32, -a * np.clip(r32, 1 - lo, 1 + hi))
        np.testing.assert_allclose(ppo, want, rtol=1e-6)
        np.testing.assert_allclose(gspo, want, rtol=1e-6)  # length 1: GSPO is PPO-clip
        w = np.clip(r32, 1 - lo, 1 + hi)
        np.testing.assert_allclose(cispo, -w * a * logp[0], rtol=1e-6)
        # past the boundary on the clipped side the PPO value is the bound's
        side = [2] if a < 0 else [3]
        np.testing.assert_allclose(
            np.asarray(ppo)[side], -a * np.clip(r32[side], 1 - lo, 1 + hi), rtol=1e-6
        )


def test_gspo_at_length_one_is_ppo_clip():
    rng = np.random.default_rng(3)
    B = 16
    old = rng.normal(-1.0, 0.5, (B, 1)).astype(f32)
    logp = (old + rng.normal(0, 0.5, (B, 1))).astype(f32)
    adv = rng.normal(size=B).astype(f32)
    m = (rng.random((B, 1)) < 0.8).astype(f32)
    w = rng.uniform(0.5, 1.5, (B, 1)).astype(f32)

    def both(lp):
        out = []
        for fn in (losses.policy_loss, losses.gspo_loss):
            for agg in AGGS:
                f = lambda x: fn(
                    x, old, adv, m, clip_low=0.2, clip_high=0.28, token_weights_BxT=w, agg=agg
                )
                num, den, met = f(lp)
                out.append((num, den, jax.grad(lambda x: f(x)[0])(lp), met))
        return out

    ppo_t, ppo_s, gspo_t, gspo_s = run(both, logp)
    assert 0.1 < ppo_t[3]["clip_frac_sum"] / ppo_t[3]["num_tokens"] < 0.9  # clips both ways
    for a, b in ((ppo_t, gspo_t), (ppo_s, gspo_s)):
        np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
        assert a[1] == b[1]
        np.testing.assert_allclose(a[2], b[2], rtol=1e-5, atol=1e-7)
        for k in a[3]:
            np.testing.assert_allclose(a[3][k], b[3][k], rtol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", sorted(objectives.POLICY_LOSSES))
def test_minibatch_num_den_sums_are_exact(name):
    """Any split of the rows: sum num / sum den is the full batch's loss, and the
    numerators' gradients over the total denominator the full gradient; the mean of the
    parts' losses is not (the test would notice if sums were means)."""
    logp, old, adv, m = loss_case(seed=1)
    w = np.random.default_rng(1).uniform(0.5, 2.0, m.shape).astype(f32)  # TIS-like weights
    parts = (slice(None), slice(0, 3), slice(3, 8))
    clip = CLIPS[name][1]
    fn = objectives.POLICY_LOSSES[name].fn

    def go(logp):
        out = {}
        for agg in AGGS:
            f = lambda lp, s: fn(
                lp,
                old[s],
                adv[s],
                m[s],
                clip_low=clip["lo"],
                clip_high=clip["hi"],
                dual_clip=clip.get("dual"),
                token_weights_BxT=w[s],
                agg=agg,
            )
            out[agg] = [(f(logp[s], s), jax.grad(lambda lp: f(lp, s)[0])(logp[s])) for s in parts]
        return out

    out = run(go, logp)
    for agg in AGGS:
        ((n_full, d_full, m_full), g_full), *rest = out[agg]
        num, den = sum(p[0][0] for p in rest), sum(p[0][1] for p in rest)
        np.testing.assert_allclose(num / den, n_full / d_full, rtol=1e-6)
        assert den == d_full
        assert abs(np.mean([p[0][0] / p[0][1] for p in rest]) - n_full / d_full) > 1e-4
        np.testing.assert_allclose(
            np.concatenate([p[1] for p in rest]), g_full, rtol=1e-5, atol=1e-7
        )
        comb = losses.combine_metrics([p[0][2] for p in rest])
        full = losses.combine_metrics([m_full])
        assert set(comb) == set(full)
        for k in full:
            np.testing.assert_allclose(comb[k], full[k], rtol=1e-5, err_msg=k)


def test_losses_refuse_dual_clip_and_bad_agg():
    logp, old, adv, m = loss_case()
    for fn in (losses.gspo_loss, losses.cispo_loss):
        with pytest.raises(ValueError):
            fn(logp, old, adv, m, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
        with pytest.raises(ValueError):
            fn(logp, old, adv, m, clip_low=0.2, clip_high=0.2, agg="sum")


# -------------------------------------------------------------------------- advantages
def test_advantages_match_their_formulas():
    rng = np.random.default_rng(4)
    cases = {
        "g4": rng.normal(size=(5, 4)).astype(f32),
        "binary": np.array([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1]], f32),
        "g2": rng.normal(size=(6, 2)).astype(f32),
    }
    cases["g4"][1] = 0.7  # a group of equal rewards
    got = run(
        lambda cs: {
            (k, name): e.fn(jnp.asarray(r).reshape(-1), r.shape[1])
            for k, r in cs.items()
            for name, e in objectives.ADVANTAGES.items()
        },
        cases,
    )
    for (k, name), adv in got.items():
        r = cases[k].astype(np.float64)
        np.testing.assert_allclose(
            adv, NP_ADVANTAGES[name](r), rtol=1e-5, atol=1e-6, err_msg=str((k, name))
        )
        equal = np.repeat(r.max(1) == r.min(1), r.shape[1])
        assert np.all(adv[equal] == 0.0)
    # RLOO with a group of two is the pair's difference; it is not Dr. GRPO (a planted
    # "mean over all G" baseline fails the comparison).
    r2 = cases["g2"]
    np.testing.assert_allclose(
        got[("g2", "rloo")].reshape(-1, 2)[:, 0], r2[:, 0] - r2[:, 1], rtol=1e-6
    )
    np.testing.assert_allclose(
        got[("g2", "rloo")].reshape(-1, 2)[:, 1], r2[:, 1] - r2[:, 0], rtol=1e-6
    )
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(got[("g4", "dr_grpo")], np_rloo(cases["g4"]), rtol=1e-5)
    with pytest.raises(ValueError):
        objectives.ADVANTAGES["rloo"].fn(jnp.zeros(4), 1)


def test_advantage_names_and_older_spelling():
    assert objectives.advantage_name("grpo") == "grpo"
    assert objectives.advantage_name("grpo", scale_adv_by_std=False) == "dr_grpo"
    assert objectives.advantage_name("rloo") == "rloo"
    with pytest.raises(ValueError, match="config.rl.scale_adv_by_std"):
        objectives.advantage_name("rloo", scale_adv_by_std=False)
    with pytest.raises(ValueError, match="config.rl.advantage"):
        objectives.advantage_name("ppo")
    with pytest.raises(ValueError, match="config.rl.policy_loss"):
        objectives.policy_loss("grpo")
    assert objectives.loss_agg("auto", "gspo") == "seq-mean-token-mean"
    assert (
        objectives.loss_agg("auto", "ppo_clip")
        == objectives.loss_agg("auto", "cispo")
        == "token-mean"
    )
    assert objectives.loss_agg("token-mean", "gspo") == "token-mean"


# --------------------------------------------------------------- DAPO's overlong terms
def test_overlong_penalty_at_the_boundary_lengths():
    L, C = 20, 4  # L_max, L_cache: the penalty starts past 16 tokens
    lengths = np.array([0, 15, 16, 17, 18, 19, 20, 21, 40], np.int32)
    pen, off, half = run(
        lambda x: (
            shaping.overlong_penalty(x, L, C),
            shaping.overlong_penalty(x, L, 0),
            shaping.overlong_penalty(x, L, C, penalty=0.5),
        ),
        lengths,
    )
    # DAPO eq. (13): 0 up to L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache up to
    # L_max, -1 past it.
    want = np.array([0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    np.testing.assert_allclose(pen, want, rtol=1e-6)
    np.testing.assert_array_equal(off, np.zeros(9))
    np.testing.assert_allclose(half, 0.5 * want, rtol=1e-6)
    with pytest.raises(ValueError):
        shaping.overlong_penalty(jnp.asarray(lengths), L, L + 1)


def test_truncated_rows_have_no_eos():
    EOS = 1
    tokens = np.array(
        [[5, 6, 7, 1, 0], [5, 6, 7, 8, 9], [5, 1, 0, 0, 0], [1, 6, 7, 8, 9]], np.int32
    )
    mask = np.array([[0, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 1, 1, 1]], f32)
    # row 3: its only EOS is in the prompt (mask 0): truncated; row 2: EOS at its last slot.
    np.testing.assert_array_equal(
        run(lambda t, m: shaping.truncated(t, m, EOS), tokens, mask), [False, True, False, True]
    )


# ------------------------------------------------------------ DAPO's dynamic sampling
def test_informative_groups_and_fill_order():
    r = np.array([[1, 1], [0, 1], [0, 0], [2, 1]], f32)
    np.testing.assert_array_equal(filtering.informative_groups(r), [False, True, False, True])
    # 2P candidates (an earlier draw's groups first): informative in order, then the rest.
    inf = np.array([False, True, False, True, True, False, True, False])
    np.testing.assert_array_equal(filtering.fill_groups(inf, 4), [1, 3, 4, 6])
    np.testing.assert_array_equal(filtering.fill_groups(inf[:4], 4), [1, 3, 0, 2])
    np.testing.assert_array_equal(filtering.fill_groups(np.zeros(4, bool), 2), [0, 1])
    with pytest.raises(ValueError):
        filtering.fill_groups(inf, 9)
