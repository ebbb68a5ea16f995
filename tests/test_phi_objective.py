"""phi's objective means what it says (issue 43, items 2 and 3).

- Every sampled estimator that rl/modes.DISTILL_KL allows, used as a loss, has in
  expectation the gradient of the divergence the table names, under the sampling
  distribution of its mode: the actor's own samples (distillsparse) or the dense
  policy's (speculative). A categorical student q = softmax(theta) against a fixed
  teacher p: the mean of 200k per-sample gradients against jax.grad of the exact
  divergence, within 5 standard errors per component. The combinations the table
  refuses have no such divergence (k1 on the actor's samples: zero mean gradient).
  Planted: the old k1 (log q - log p whoever sampled) on dense samples fails.
- tv_distance is the rejection rate 1 - sum min(p, q).
- phi_objective resolves "auto" per mode and refuses, naming the field, a PPO term, a
  cached teacher, or an estimator without a divergence in speculative mode.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.rl import losses, modes

V, N = 5, 200_000
THETA = jnp.array([0.3, -0.5, 1.0, 0.0, -1.2])  # the student's logits
P_LOGITS = jnp.array([0.1, 0.4, 0.2, -0.8, 0.0])  # the teacher's

EXACT = {
    "kl_reverse": lambda q, p: losses.reverse_kl(q[None, None], p[None, None])[0, 0],
    "kl_forward": lambda q, p: losses.forward_kl(q[None, None], p[None, None])[0, 0],
    "tv": lambda q, p: losses.tv_distance(q[None, None], p[None, None])[0, 0],
}
SAMPLER = {"actor": "student", "dense": "teacher"}


def _mean_grad(estimator, sampler: str, seed: int = 0):
    """(mean, standard error) over N samples of d/d theta of estimator(log q(x), log p(x))
    with x drawn from q (sampler actor) or p (dense)."""
    src = THETA if sampler == "actor" else P_LOGITS
    x_N = jax.random.categorical(jax.random.key(seed), src, shape=(N,))
    log_p = jax.nn.log_softmax(P_LOGITS)

    def one(theta, x):
        return estimator(jax.nn.log_softmax(theta)[x], log_p[x])

    g_NxV = jax.vmap(jax.grad(one), in_axes=(None, 0))(THETA, x_N)
    return np.asarray(g_NxV.mean(0)), np.asarray(g_NxV.std(0)) / np.sqrt(N)


def _close(mean, se, want):
    return bool(np.all(np.abs(mean - want) < 5 * se + 1e-6))


ALLOWED = [
    (kind, sampler)
    for kind, d in modes.DISTILL_KL.items()
    if kind not in modes.EXACT_KINDS
    for sampler in ("actor", "dense")
    if d[sampler] is not None
]


@pytest.mark.parametrize("kind,sampler", ALLOWED)
def test_sampled_estimator_has_the_gradient_of_its_divergence(kind, sampler):
    divergence = modes.DISTILL_KL[kind][sampler]
    want = np.asarray(jax.grad(lambda t: EXACT[divergence](t, P_LOGITS))(THETA))
    mean, se = _mean_grad(
        lambda lq, lp: losses.sampled_divergence(lq, lp, kind, SAMPLER[sampler]), sampler
    )
    assert np.abs(want).max() > 20 * se.max()  # the test can tell a gradient from zero
    assert _close(mean, se, want), (kind, sampler, mean, want)


def test_refused_estimators_follow_no_divergence():
    """k1 on the actor's own samples: zero gradient in expectation (why it is refused)."""
    assert modes.DISTILL_KL["k1"]["actor"] is None
    mean, se = _mean_grad(
        lambda lq, lp: losses.sampled_divergence(lq, lp, "k1", "student"), "actor"
    )
    assert _close(mean, se, np.zeros(V))


def test_planted_old_k1_on_dense_samples_fails():
    """The old k1 (log q - log p whoever sampled) pushes phi away from dense."""
    want = np.asarray(jax.grad(lambda t: EXACT["kl_forward"](t, P_LOGITS))(THETA))
    mean, se = _mean_grad(lambda lq, lp: lq - jax.lax.stop_gradient(lp), "dense")
    assert not _close(mean, se, want)
    assert np.allclose(mean, -want, atol=5 * se.max() + 1e-6)


def test_tv_distance_is_the_rejection_rate():
    q, p = jax.nn.softmax(THETA), jax.nn.softmax(P_LOGITS)
    want = 1.0 - np.minimum(np.asarray(p), np.asarray(q)).sum()
    assert abs(float(EXACT["tv"](THETA, P_LOGITS)) - want) < 1e-6
    assert float(EXACT["tv"](THETA, THETA)) < 1e-6


SPEC = modes.get("speculative", "sparse_self")
DS = modes.get("distillsparse")


def test_auto_resolves_per_mode():
    o = modes.phi_objective(DS, "auto", "auto", "auto")
    assert (o.loss, o.teacher, o.kl, o.sampler) == ("ppo+kl", "cached", "k3", "actor")
    o = modes.phi_objective(SPEC, "auto", "auto", "auto")
    assert (o.loss, o.teacher, o.sampler) == ("kl_only", "recomputed", "dense")
    assert o.kl == modes.PHI_AUTO["speculative"]["kl"] and o.divergence is not None


@pytest.mark.parametrize(
    "mode,loss,teacher,kl,field",
    [
        (SPEC, "ppo+kl", "auto", "auto", "distill.loss"),
        (SPEC, "auto", "cached", "auto", "distill.teacher"),
        (SPEC, "auto", "auto", "k2", "distill.kl"),
        (DS, "auto", "auto", "k1", "distill.kl"),
        (DS, "auto", "auto", "k4", "distill.kl"),
        (DS, "ppo", "auto", "auto", "distill.loss"),
    ],
)
def test_contradictions_are_refused(mode, loss, teacher, kl, field):
    with pytest.raises(ValueError, match=rf"^config\.{field}: "):
        modes.phi_objective(mode, loss, teacher, kl)
