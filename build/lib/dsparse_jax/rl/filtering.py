"""Oversampling filters: keep n of the M rollouts of each prompt; and DAPO's dynamic
sampling: keep the groups whose rewards vary (`informative_groups`, `fill_groups`).

Batch layout: B = P * M rows, the M samples of prompt p at rows p*M .. p*M + M - 1.
Per-prompt indices idx_Pxn (values in [0, M)) are turned into flat batch rows by
`flat_kept_indices`; kept groups stay contiguous (B' = P * n), so GRPO advantages can
be computed on the kept batch with group_size = n.
"""

import jax
import jax.numpy as jnp
import numpy as np


def top_n_by_reward(rewards_PxM, n, key):
    """Indices [P, n] of the n highest-reward samples per prompt.

    Ties are broken uniformly at random by `key` (deterministic for a given key).
    Returned in order of decreasing reward (tied entries in random order).
    """
    P, M = rewards_PxM.shape
    if not 1 <= n <= M:
        raise ValueError(f"need 1 <= n <= M, got n={n}, M={M}")
    tie_PxM = jax.random.uniform(key, (P, M))
    # lexsort: last key is primary -> sort by -reward, then by the random tie-break.
    order_PxM = jnp.lexsort((tie_PxM, -rewards_PxM.astype(jnp.float32)), axis=-1)
    return order_PxM[:, :n]


def flat_kept_indices(idx_Pxn, M):
    """Flat batch rows [P * n] for per-prompt indices: row = p * M + idx[p, j]."""
    P = idx_Pxn.shape[0]
    return (jnp.arange(P)[:, None] * M + idx_Pxn).reshape(-1)


def gather_kept(x_BxX, idx_Pxn, M):
    """Rows of x (array or pytree of arrays with leading dim B = P * M) kept by idx_Pxn.

    Returns leading dim P * n, sample j of prompt p at row p * n + j.
    """
    rows = flat_kept_indices(idx_Pxn, M)
    B = idx_Pxn.shape[0] * M

    def take(a):
        if a.shape[0] != B:
            raise ValueError(f"leading dim {a.shape[0]} != P * M = {B}")
        return a[rows]

    return jax.tree.map(take, x_BxX)


def acceptance_fraction(logp_dense_BxT, logp_sparse_BxT, mask_BxT, C, key):
    """Per trajectory, the fraction of masked tokens passing a Bernoulli test with
    probability min(1, exp(logp_dense - logp_sparse) / C). Returns [B] (0 if no tokens).
    """
    m = mask_BxT.astype(jnp.float32)
    valid_BxT = m > 0
    log_ratio_BxT = jnp.where(valid_BxT, logp_dense_BxT - logp_sparse_BxT, 0.0).astype(jnp.float32)
    prob_BxT = jnp.exp(jnp.minimum(log_ratio_BxT - jnp.log(jnp.asarray(C, jnp.float32)), 0.0))
    u_BxT = jax.random.uniform(key, m.shape)
    passed_BxT = (u_BxT < prob_BxT).astype(jnp.float32) * m
    return jnp.sum(passed_BxT, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)


def acceptance_rate_select(logp_dense_BxT, logp_sparse_BxT, mask_BxT, C, n, M, key):
    """Keep the n samples per prompt with the highest acceptance fraction.

    Returns (idx_Pxn, frac_B); idx as in `top_n_by_reward` (ties broken at random).
    """
    B = mask_BxT.shape[0]
    if B % M != 0:
        raise ValueError(f"batch {B} is not a multiple of M={M}")
    key_test, key_tie = jax.random.split(key)
    frac_B = acceptance_fraction(logp_dense_BxT, logp_sparse_BxT, mask_BxT, C, key_test)
    idx_Pxn = top_n_by_reward(frac_B.reshape(B // M, M), n, key_tie)
    return idx_Pxn, frac_B


def informative_groups(rewards_PxG):
    """bool [P]: the groups whose rewards are not all equal (DAPO's dynamic sampling keeps
    these: a group of equal rewards has zero advantage under every estimator)."""
    r = jnp.asarray(rewards_PxG)
    return r.max(axis=1) > r.min(axis=1)


def fill_groups(informative_Q, p):
    """Indices [p] of the groups a batch of p groups keeps from Q >= p candidates (the
    groups of earlier draws first): the informative ones in order, then, if there are fewer
    than p, the uninformative ones in order (they fill the fixed shape; the caller masks
    their loss). numpy, on the host."""
    informative_Q = np.asarray(informative_Q, bool)
    if not 1 <= p <= informative_Q.shape[0]:
        raise ValueError(f"need 1 <= p <= {informative_Q.shape[0]} groups, got p={p}")
    return np.argsort(~informative_Q, kind="stable")[:p]
