"""RL math: advantages, PPO loss, KL estimators, TIS/MIS, filters, mismatch metrics.

Expected values are hand-computed (see comments) or computed with numpy.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.rl import advantages, corrections, filtering, losses, mismatch

LOG = math.log


# ---------------------------------------------------------------- advantages
def test_grpo_advantages_hand_values():
  r = jnp.array([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
  # Group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3) -> +-0.5 * sqrt(3).
  adv = advantages.grpo_advantages(r, 4)
  a = 0.5 * math.sqrt(3.0)
  np.testing.assert_allclose(adv, [a, -a, a, -a, 0, 0, 0, 0], rtol=1e-5)
  # Population std 0.5 -> +-1 (up to eps).
  adv0 = advantages.grpo_advantages(r, 4, ddof=0, eps=0.0)
  np.testing.assert_allclose(adv0, [1, -1, 1, -1, 0, 0, 0, 0], rtol=1e-6)
  # Dr. GRPO: no std scaling.
  adv_dr = advantages.grpo_advantages(r, 4, scale_by_std=False)
  np.testing.assert_allclose(adv_dr, [0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0], rtol=1e-6)
  # std = 0 group gives exact zeros, and group_size 1 gives zeros (no NaN).
  assert np.all(np.asarray(adv[4:]) == 0.0)
  np.testing.assert_array_equal(advantages.grpo_advantages(r, 1), np.zeros(8))
  with pytest.raises(ValueError):
    advantages.grpo_advantages(r, 3)


# ---------------------------------------------------------------- policy loss
def _ppo_case():
  """Two sequences (A=+1, A=-2) with known ratios, one masked garbage token each,
  and a third, fully masked sequence."""
  ratios = np.array([[0.5, 1.0, 1.5, 1.0], [0.5, 1.2, 4.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
  old = np.array([[-1.0, -2.0, -0.5, -3.0], [-2.0, -1.0, -4.0, -1.0], [-1.0] * 4])
  logp = old + np.log(ratios)
  logp[0, 3] = 50.0  # masked garbage
  logp[1, 3] = -1e9
  mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], np.float32)
  adv = np.array([1.0, -2.0, 5.0])
  return (jnp.asarray(logp, jnp.float32), jnp.asarray(old, jnp.float32),
          jnp.asarray(adv, jnp.float32), jnp.asarray(mask))


def test_policy_loss_clip_hand_values():
  logp, old, adv, mask = _ppo_case()
  # clip_low 0.2, clip_high 0.28 -> ratio clipped to [0.8, 1.28].
  # A=+1: ratio .5 -> max(-.5, -.8) = -.5; 1 -> -1; 1.5 -> max(-1.5, -1.28) = -1.28 (clip, high)
  # A=-2: ratio .5 -> max(1, 1.6) = 1.6 (clip, low); 1.2 -> 2.4; 4 -> max(8, 2.56) = 8
  num, den, met = losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(num, -0.5 - 1 - 1.28 + 1.6 + 2.4 + 8.0, rtol=1e-5)
  assert float(den) == 6.0
  assert float(met["clip_frac_sum"]) == 2.0
  assert float(met["clip_frac_low_sum"]) == 1.0
  assert float(met["clip_frac_high_sum"]) == 1.0
  assert float(met["dual_clip_frac_sum"]) == 0.0
  np.testing.assert_allclose(met["ratio_sum"], 0.5 + 1 + 1.5 + 0.5 + 1.2 + 4.0, rtol=1e-5)
  np.testing.assert_allclose([met["ratio_max"], met["ratio_min"]], [4.0, 0.5], rtol=1e-5)
  np.testing.assert_allclose(met["ppo_kl_sum"], -np.log([0.5, 1.5, 0.5, 1.2, 4.0]).sum(), rtol=1e-5)
  fin = losses.combine_metrics([met])
  np.testing.assert_allclose(fin["clip_frac"], 2.0 / 6.0, rtol=1e-6)

  # Dual clip c=3: A=-2, ratio 4 -> min(8, 2 * 3) = 6.
  num_d, _, met_d = losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                       dual_clip=3.0)
  np.testing.assert_allclose(num_d, 9.22 - 2.0, rtol=1e-5)
  assert float(met_d["dual_clip_frac_sum"]) == 1.0
  with pytest.raises(ValueError):
    losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=0.9)

  # seq-mean-token-mean: (-2.78 / 3 + 12 / 3) over 2 non-empty sequences.
  num_s, den_s, _ = losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                       agg="seq-mean-token-mean")
  np.testing.assert_allclose(num_s, -2.78 / 3 + 4.0, rtol=1e-5)
  assert float(den_s) == 2.0
  with pytest.raises(ValueError):
    losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="sum")


def test_policy_loss_gradients_and_weights():
  logp, old, adv, mask = _ppo_case()
  f = lambda lp, dual: losses.policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                          dual_clip=dual)[0]
  # d/dlogp of -A * ratio is -A * ratio where unclipped, 0 where clipped or masked.
  g = jax.grad(f)(logp, None)
  np.testing.assert_allclose(g, [[-0.5, -1.0, 0, 0], [0, 2.4, 8.0, 0], [0, 0, 0, 0]], rtol=1e-5)
  g_d = jax.grad(f)(logp, 3.0)
  np.testing.assert_allclose(g_d, [[-0.5, -1.0, 0, 0], [0, 2.4, 0, 0], [0, 0, 0, 0]], rtol=1e-5)
  assert np.all(np.isfinite(g)) and np.all(np.isfinite(g_d))

  # Token weights multiply the per-token loss and receive no gradient.
  w = jnp.array([[2.0, 1.0, 0.5, 9.0], [1.0, 0.5, 0.25, 9.0], [9.0] * 4])
  fw = lambda w_: losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28,
                                     token_weights_BxT=w_)[0]
  np.testing.assert_allclose(fw(w), -1.0 - 1.0 - 0.64 + 1.6 + 1.2 + 2.0, rtol=1e-5)
  np.testing.assert_array_equal(jax.grad(fw)(w), np.zeros((3, 4)))

  # jit gives the same value.
  jf = jax.jit(functools.partial(losses.policy_loss, clip_low=0.2, clip_high=0.28,
                                 dual_clip=3.0, agg="seq-mean-token-mean"))
  np.testing.assert_allclose(
      jf(logp, old, adv, mask)[0],
      losses.policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0,
                         agg="seq-mean-token-mean")[0], rtol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_minibatch_sums_equal_full_batch(agg):
  rng = np.random.default_rng(0)
  B, T = 6, 7
  logp = jnp.asarray(rng.normal(-1.0, 0.5, (B, T)), jnp.float32)
  old = logp + jnp.asarray(rng.normal(0, 0.3, (B, T)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=B), jnp.float32)
  lengths = np.array([7, 1, 4, 0, 6, 2])
  mask = jnp.asarray(np.arange(T)[None] < lengths[:, None], jnp.float32)
  f = lambda lp, o, a, m: losses.policy_loss(lp, o, a, m, clip_low=0.2, clip_high=0.28,
                                             dual_clip=3.0, agg=agg)[:2]
  n_full, d_full = f(logp, old, adv, mask)
  halves = [slice(0, 2), slice(2, 6)]  # unequal halves with different token counts
  parts = [f(logp[s], old[s], adv[s], mask[s]) for s in halves]
  np.testing.assert_allclose(sum(p[0] for p in parts) / sum(p[1] for p in parts),
                             n_full / d_full, rtol=1e-6)
  # The mean over minibatch losses would be wrong here (different denominators).
  assert abs(np.mean([p[0] / p[1] for p in parts]) - n_full / d_full) > 1e-3
  # Gradient: accumulate grads of numerators, divide by the total denominator.
  g_full = jax.grad(lambda lp: f(lp, old, adv, mask)[0] / d_full)(logp)
  g_parts = [jax.grad(lambda lp, s=s: f(lp, old[s], adv[s], mask[s])[0])(logp[s]) for s in halves]
  np.testing.assert_allclose(jnp.concatenate(g_parts) / d_full, g_full, rtol=1e-5, atol=1e-7)
  # Metrics combine exactly too.
  mets = [losses.policy_loss(logp[s], old[s], adv[s], mask[s], clip_low=0.2, clip_high=0.28)[2]
          for s in halves]
  full = losses.combine_metrics([losses.policy_loss(logp, old, adv, mask, clip_low=0.2,
                                                    clip_high=0.28)[2]])
  comb = losses.combine_metrics(mets)
  for k in full:
    np.testing.assert_allclose(comb[k], full[k], rtol=1e-6)


# ---------------------------------------------------------------- KL
def test_kl_estimators_and_clamps():
  logp = jnp.array([-1.0, -2.0, -30.0, 0.0])
  ref = jnp.array([-1.5, -1.0, 0.0, -25.0])
  # r = ref - logp = [-0.5, 1, 30, -25]
  np.testing.assert_allclose(losses.kl_estimate(logp, ref, "k1"), [0.5, -1, -30, 25], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_estimate(logp, ref, "k2"), [0.125, 0.5, 450, 312.5], rtol=1e-6)
  # k3: r clamped to [-0.5, 1, 20, -20]; exp(r) - r - 1 = [0.1065307, e - 2, exp(20) - 21, 19]
  # then clamped to +-10.
  k3 = losses.kl_estimate(logp, ref, "k3")
  np.testing.assert_allclose(k3, [math.exp(-0.5) - 0.5, math.e - 2, 10.0, 10.0], rtol=1e-5)
  k3_noklclamp = losses.kl_estimate(logp, ref, "k3", kl_clamp=None)
  np.testing.assert_allclose(k3_noklclamp, [math.exp(-0.5) - 0.5, math.e - 2,
                                            math.exp(20) - 21, 19.0], rtol=1e-5)
  k3_raw = losses.kl_estimate(logp, ref, "k3", log_ratio_clamp=None, kl_clamp=None)
  np.testing.assert_allclose(k3_raw[3], math.exp(-25) + 24, rtol=1e-6)
  k3_tight = losses.kl_estimate(logp, ref, "k3", log_ratio_clamp=0.25, kl_clamp=None)
  np.testing.assert_allclose(k3_tight, [math.exp(-0.25) - 0.75, math.exp(0.25) - 1.25,
                                        math.exp(0.25) - 1.25, math.exp(-0.25) - 0.75], rtol=1e-5)
  # Gradient w.r.t. logp: d/dlogp (exp(r) - r - 1) = 1 - exp(r) unclamped, 0 when clamped;
  # the reference gets no gradient.
  g_lp, g_ref = jax.grad(lambda a, b: losses.kl_estimate(a, b, "k3").sum(), argnums=(0, 1))(logp, ref)
  np.testing.assert_allclose(g_lp, [1 - math.exp(-0.5), 1 - math.e, 0, 0], rtol=1e-5)
  np.testing.assert_array_equal(g_ref, np.zeros(4))
  with pytest.raises(ValueError):
    losses.kl_estimate(logp, ref, "k4")


def _np_softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_exact_kl_against_numpy():
  rng = np.random.default_rng(1)
  a = rng.normal(size=(2, 3, 11)).astype(np.float32)
  b = rng.normal(size=(2, 3, 11)).astype(np.float32) * 2
  pa, pb = _np_softmax(a.astype(np.float64)), _np_softmax(b.astype(np.float64))
  kl_ab = np.sum(pa * (np.log(pa) - np.log(pb)), -1)
  kl_ba = np.sum(pb * (np.log(pb) - np.log(pa)), -1)
  np.testing.assert_allclose(losses.exact_kl(a, b), kl_ab, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(losses.reverse_kl(a, b), kl_ab, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(losses.forward_kl(a, b), kl_ba, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(losses.exact_kl(a, a), np.zeros((2, 3)), atol=1e-6)
  # -inf logits in `a` (zero-probability entries) contribute 0 and keep gradients finite.
  a_inf = a.copy()
  a_inf[..., :3] = -np.inf
  pa_inf = _np_softmax(a_inf.astype(np.float64))
  with np.errstate(divide="ignore", invalid="ignore"):
    terms = np.where(pa_inf > 0, pa_inf * (np.log(pa_inf) - np.log(pb)), 0.0)
  np.testing.assert_allclose(losses.exact_kl(a_inf, b), terms.sum(-1), rtol=1e-4)
  g = jax.grad(lambda x: losses.exact_kl(x, b).sum())(jnp.asarray(a_inf))
  assert np.all(np.isfinite(g))


# ---------------------------------------------------------------- TIS / MIS
def test_tis_weights():
  old = jnp.zeros((1, 4))
  # rho = exp(old - mu) = [1, 0.5, 3, 1.5]; last token masked.
  mu = jnp.array([[0.0, LOG(2.0), -LOG(3.0), -LOG(1.5)]])
  mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
  w, met = corrections.tis_weights(old, mu, mask, 2.0)
  np.testing.assert_allclose(w, [[1.0, 0.5, 2.0, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(met["tis_clip_frac"], 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(met["tis_weight_mean"], 3.5 / 3, rtol=1e-6)
  # Huge ratios do not overflow; weights are detached.
  w_big, _ = corrections.tis_weights(jnp.array([[200.0]]), jnp.array([[0.0]]), jnp.ones((1, 1)), 5.0)
  assert float(w_big[0, 0]) == pytest.approx(5.0)
  g = jax.grad(lambda o: corrections.tis_weights(o, mu, mask, 2.0)[0].sum())(old)
  np.testing.assert_array_equal(g, np.zeros((1, 4)))


def test_mis_mask_token_and_sequence():
  old = jnp.zeros((1, 5))
  # rho = [1, 0.4, 3, 1.9, 100]; last token already masked.
  mu = -jnp.log(jnp.array([[1.0, 0.4, 3.0, 1.9, 100.0]]))
  mask = jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0]])
  keep, met = corrections.mis_mask(old, mu, mask, 0.5, 2.0)
  np.testing.assert_array_equal(keep, [[1, 0, 0, 1, 0]])
  np.testing.assert_allclose(met["mis_masked_frac"], 0.5, rtol=1e-6)

  # Sequence level: geometric means (1.9*1.9*0.6)^(1/3)=1.29 (keep), 3^(2/3)=2.08 (drop),
  # 0.1^(1/3)=0.46 (drop); masked tokens (garbage) excluded from the mean.
  log_rho = jnp.array([[LOG(1.9), LOG(1.9), LOG(0.6), 9.0],
                       [LOG(3), LOG(3), 0.0, -9.0],
                       [LOG(0.1), 0.0, 0.0, 9.0]])
  mask3 = jnp.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]], jnp.float32)
  # Row 0's masked garbage token (log rho 9) would push it out if it were counted.
  keep_s, met_s = corrections.mis_mask(log_rho, jnp.zeros((3, 4)), mask3, 0.5, 2.0,
                                       level="sequence")
  np.testing.assert_array_equal(keep_s, [[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_allclose(met_s["mis_masked_frac"], 6 / 9, rtol=1e-6)
  # Token level on the same data keeps a different set.
  keep_t, _ = corrections.mis_mask(log_rho, jnp.zeros((3, 4)), mask3, 0.5, 2.0)
  np.testing.assert_array_equal(keep_t, [[1, 1, 1, 0], [0, 0, 1, 0], [0, 1, 1, 0]])
  with pytest.raises(ValueError):
    corrections.mis_mask(old, mu, mask, 0.5, 2.0, level="batch")


# ---------------------------------------------------------------- filtering
def test_top_n_keeps_highest_and_breaks_ties_randomly():
  r = jnp.array([[0.0, 3.0, 1.0, 2.0, -1.0], [1.0, 0.0, 1.0, 0.5, 1.0]])
  key = jax.random.PRNGKey(0)
  idx = filtering.top_n_by_reward(r, 2, key)
  np.testing.assert_array_equal(idx[0], [1, 3])  # decreasing reward
  assert set(np.asarray(idx[1]).tolist()) <= {0, 2, 4}
  np.testing.assert_array_equal(filtering.top_n_by_reward(r, 2, key), idx)  # deterministic
  np.testing.assert_array_equal(filtering.top_n_by_reward(r, 4, key)[0], [1, 3, 2, 0])
  with pytest.raises(ValueError):
    filtering.top_n_by_reward(r, 6, key)

  # Over many keys each pair of the three tied samples is kept ~1/3 of the time.
  keys = jax.random.split(jax.random.PRNGKey(1), 600)
  idx_K = jax.vmap(lambda k: filtering.top_n_by_reward(r, 2, k))(keys)
  assert np.all(np.asarray(idx_K[:, 0]) == np.array([1, 3]))
  pairs = [tuple(sorted(p)) for p in np.asarray(idx_K[:, 1]).tolist()]
  for pair in [(0, 2), (0, 4), (2, 4)]:
    assert 0.25 < pairs.count(pair) / 600 < 0.42, (pair, pairs.count(pair))


def test_filter_then_advantages_on_kept():
  M, n = 4, 2
  rewards_PxM = jnp.array([[0.0, 3.0, 1.0, 2.0], [5.0, 5.0, -1.0, 0.0]])
  idx = filtering.top_n_by_reward(rewards_PxM, n, jax.random.PRNGKey(3))
  rows = filtering.flat_kept_indices(idx, M)
  assert sorted(np.asarray(rows[:2]).tolist()) == [1, 3]
  assert sorted(np.asarray(rows[2:]).tolist()) == [4, 5]  # groups stay contiguous
  batch = {"rewards": rewards_PxM.reshape(-1), "tokens": jnp.arange(8 * 3).reshape(8, 3)}
  kept = filtering.gather_kept(batch, idx, M)
  np.testing.assert_array_equal(kept["tokens"], np.arange(24).reshape(8, 3)[np.asarray(rows)])
  adv = advantages.grpo_advantages(kept["rewards"], n, ddof=0, eps=0.0)
  # Kept rewards {3, 2} -> +-1 by reward; {5, 5} -> 0 (advantages over the kept n only).
  np.testing.assert_allclose(adv, np.where(np.asarray(kept["rewards"]) == 3.0, 1.0,
                                           np.where(np.asarray(kept["rewards"]) == 2.0, -1.0, 0.0)))
  with pytest.raises(ValueError):
    filtering.gather_kept(jnp.zeros(7), idx, M)


def test_acceptance_rate_select():
  # Deterministic tests: log-ratio >= log C passes with prob 1, -200 with prob 0.
  P, M, T = 2, 3, 4
  ok, bad = 1.0, -200.0  # C = 2: exp(1)/2 > 1
  lr = np.full((P * M, T), bad, np.float32)
  passes = [2, 4, 1, 0, 3, 3]  # tokens passing per trajectory
  for b, k in enumerate(passes):
    lr[b, :k] = ok
  mask = np.ones((P * M, T), np.float32)
  mask[5, 3] = 0.0  # traj 5: 3 passing of 3 counted -> 1.0
  dense = jnp.asarray(lr) - 1.0
  sparse = jnp.full((P * M, T), -1.0)
  idx, frac = filtering.acceptance_rate_select(dense, sparse, jnp.asarray(mask), 2.0, 2, M,
                                               jax.random.PRNGKey(0))
  np.testing.assert_allclose(frac, [0.5, 1.0, 0.25, 0.0, 0.75, 1.0], rtol=1e-6)
  np.testing.assert_array_equal(idx, [[1, 0], [2, 1]])

  # Statistical: prob = min(1, ratio / C): ratio 3, C 2 -> 1; ratio .5, C 2 -> .25.
  T = 4000
  lr = jnp.concatenate([jnp.full((1, T), LOG(3.0)), jnp.full((1, T), LOG(0.5))])
  frac = filtering.acceptance_fraction(lr, jnp.zeros((2, T)), jnp.ones((2, T)), 2.0,
                                       jax.random.PRNGKey(5))
  assert float(frac[0]) == 1.0
  assert abs(float(frac[1]) - 0.25) < 0.03


# ---------------------------------------------------------------- mismatch metrics
def test_token_acceptance_and_kl_against_numpy():
  rng = np.random.default_rng(2)
  p = rng.normal(size=(2, 3, 7)).astype(np.float32)
  q = (p + rng.normal(size=(2, 3, 7))).astype(np.float32)
  pp, pq = _np_softmax(p.astype(np.float64)), _np_softmax(q.astype(np.float64))
  np.testing.assert_allclose(mismatch.token_acceptance(p, q), np.minimum(pp, pq).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(mismatch.token_acceptance(p, q),
                             1 - 0.5 * np.abs(pp - pq).sum(-1), rtol=1e-5)
  np.testing.assert_allclose(mismatch.token_acceptance(p, p), np.ones((2, 3)), rtol=1e-6)
  np.testing.assert_allclose(mismatch.token_kl(p, q), np.sum(pp * np.log(pp / pq), -1),
                             rtol=1e-4, atol=1e-6)


def test_masked_percentile_and_position_bins_against_numpy():
  rng = np.random.default_rng(3)
  x = rng.uniform(size=(4, 9)).astype(np.float32)
  m = rng.uniform(size=(4, 9)) < 0.6
  for q in [0.0, 5.0, 37.5, 50.0, 100.0]:
    np.testing.assert_allclose(mismatch.masked_percentile(x, m, q), np.percentile(x[m], q),
                               rtol=1e-5)
  assert np.isnan(float(mismatch.masked_percentile(x, np.zeros_like(m), 5.0)))
  assert float(mismatch.masked_percentile(x, m == m, 50.0)) == pytest.approx(np.median(x), rel=1e-5)

  B, T, prompt = 3, 40, 5
  alpha = rng.uniform(0.5, 1.0, size=(B, T)).astype(np.float32)
  lengths = np.array([34, 12, 30])
  t = np.arange(T)[None]
  positions = np.broadcast_to(t - prompt, (B, T))
  mask = ((t >= prompt) & (t < prompt + lengths[:, None])).astype(np.float32)
  bw, K = 8, 5  # positions 0..33; bin 4 = [32, 40) gets 2 tokens; nothing beyond.
  out = mismatch.position_bins(jnp.asarray(alpha), jnp.asarray(mask), jnp.asarray(positions),
                               bw, K)
  out4 = mismatch.position_bins(jnp.asarray(alpha), jnp.asarray(mask), jnp.asarray(positions),
                                bw, 4)  # positions >= 32 dropped
  for k in range(K):
    sel = (mask > 0) & (positions // bw == k)
    assert int(out["count"][k]) == sel.sum()
    np.testing.assert_allclose(out["mean"][k], alpha[sel].mean(), rtol=1e-5)
    np.testing.assert_allclose(out["percentile"][k], np.percentile(alpha[sel], 5.0), rtol=1e-5)
  assert int(out["count"][4]) == 2 and int(out4["count"].sum()) == mask.sum() - 2
  np.testing.assert_allclose(out4["percentile"], out["percentile"][:4])
  empty = mismatch.position_bins(jnp.asarray(alpha), jnp.asarray(mask), jnp.asarray(positions),
                                 16, 4)
  assert int(empty["count"][3]) == 0 and np.isnan(float(empty["percentile"][3]))
  assert np.isnan(float(empty["mean"][3]))


def test_log_ratio_stats():
  a = jnp.array([[-1.0, -2.0, -3.0], [-1.0, 7.0, 0.0], [0.0, 0.0, 0.0]])
  b = jnp.array([[-1.5, -1.0, -3.0], [-4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], jnp.float32)
  # d over masked tokens: [0.5, -1, 0] and [3]; garbage (7 - 0) excluded.
  s = mismatch.log_ratio_stats(a, b, mask)
  np.testing.assert_allclose(s["mean"], 2.5 / 4, rtol=1e-6)
  np.testing.assert_allclose(s["mean_abs"], 4.5 / 4, rtol=1e-6)
  np.testing.assert_allclose(s["max_abs"], 3.0, rtol=1e-6)
  np.testing.assert_allclose(s["seq_mean"], (-0.5 + 3.0) / 2, rtol=1e-6)
  np.testing.assert_allclose(s["seq_token_mean"], (-0.5 / 3 + 3.0) / 2, rtol=1e-6)
