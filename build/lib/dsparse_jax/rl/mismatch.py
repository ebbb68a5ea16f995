"""Exact rollout/trainer mismatch metrics from the full logits of two forwards.

Logits are [B, T, V] (computed in f32), temperature already applied by the caller.
Per-token results are [B, T]; reduce them over `mask_BxT` (completion tokens).
"""

import jax
import jax.numpy as jnp

from dsparse_jax.rl.losses import exact_kl, masked_sum_count


def token_acceptance(logits_p_BxTxV, logits_q_BxTxV):
    """alpha_t = sum_v min(p(v), q(v)) = 1 - TV(p, q), per token [B, T]."""
    p = jax.nn.softmax(logits_p_BxTxV.astype(jnp.float32), axis=-1)
    q = jax.nn.softmax(logits_q_BxTxV.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.minimum(p, q), axis=-1)


def token_kl(logits_p_BxTxV, logits_q_BxTxV):
    """Exact KL(p || q) over the vocabulary, per token [B, T]."""
    return exact_kl(logits_p_BxTxV, logits_q_BxTxV)


def _sorted_percentile(sorted_N, start, count, q):
    """Linear-interpolated q-th percentile of sorted_N[start : start + count]; NaN if count == 0."""
    last = jnp.maximum(count - 1, 0)
    pos = (q / 100.0) * last.astype(jnp.float32)
    lo = jnp.minimum(jnp.floor(pos).astype(jnp.int32), last)
    hi = jnp.minimum(lo + 1, last)
    frac = pos - lo.astype(jnp.float32)
    v_lo, v_hi = sorted_N[start + lo], sorted_N[start + hi]
    return jnp.where(count > 0, v_lo + frac * (v_hi - v_lo), jnp.nan)


def masked_percentile(x, mask, q):
    """q-th percentile (0..100) of x over entries with mask > 0, static shapes.

    Same rule as np.percentile(..., method='linear') (numpy's default): with the k
    kept values sorted, v[i] at i = q/100 * (k - 1), linearly interpolated between
    floor(i) and floor(i) + 1. NaN if no entry is kept.
    """
    valid_N = mask.reshape(-1) > 0
    sorted_N = jnp.sort(jnp.where(valid_N, x.reshape(-1).astype(jnp.float32), jnp.inf))
    return _sorted_percentile(sorted_N, 0, jnp.sum(valid_N.astype(jnp.int32)), q)


def position_bins(alpha_BxT, mask_BxT, positions_BxT, bin_width, num_bins, q=5.0):
    """Per position bin: mean, q-th percentile (default 5th) and token count of alpha.

    positions_BxT: 0-based position of each token within its completion; token t goes
    to bin positions // bin_width. Tokens with bin >= num_bins are dropped (choose
    num_bins = ceil(max_len / bin_width) to cover everything). Percentile rule: see
    `masked_percentile` (numpy 'linear'). Empty bins give NaN mean and percentile.
    One sort of the B*T values (by bin, then value); num_bins must be static.
    Returns {'mean': [K], 'percentile': [K], 'count': [K] int32} with K = num_bins.
    """
    K = num_bins
    bin_N = positions_BxT.reshape(-1) // bin_width
    keep_N = (mask_BxT.reshape(-1) > 0) & (bin_N >= 0) & (bin_N < K)
    bin_N = jnp.where(keep_N, bin_N, K).astype(jnp.int32)  # K collects dropped tokens
    x_N = jnp.where(keep_N, alpha_BxT.reshape(-1).astype(jnp.float32), 0.0)
    sorted_N = x_N[jnp.lexsort((x_N, bin_N))]
    count_K = jnp.bincount(bin_N, length=K + 1)[:K]
    start_K = jnp.cumsum(count_K) - count_K
    sum_K = jax.ops.segment_sum(x_N, bin_N, num_segments=K + 1)[:K]
    mean_K = jnp.where(count_K > 0, sum_K / jnp.maximum(count_K, 1), jnp.nan)
    pct_K = jax.vmap(_sorted_percentile, in_axes=(None, 0, 0, None))(sorted_N, start_K, count_K, q)
    return {"mean": mean_K, "percentile": pct_K, "count": count_K.astype(jnp.int32)}


def log_ratio_stats(logp_a_BxT, logp_b_BxT, mask_BxT):
    """Statistics of the per-token log-ratio d = logp_a - logp_b over masked tokens.

    'mean', 'mean_abs', 'max_abs' (0 if no tokens): token-level.
    'seq_mean': mean over sequences (with >= 1 token) of sum_t d, the sequence
                log-likelihood ratio log a(y) - log b(y).
    'seq_token_mean': mean over those sequences of the per-sequence token-mean of d
                (log of the geometric-mean ratio used by sequence-level MIS).
    """
    m = mask_BxT.astype(jnp.float32)
    d_BxT = jnp.where(m > 0, (logp_a_BxT - logp_b_BxT).astype(jnp.float32), 0.0)
    s, n = masked_sum_count(d_BxT, m)
    s_abs, _ = masked_sum_count(jnp.abs(d_BxT), m)
    n_B = jnp.sum(m, axis=1)
    has_B = (n_B > 0).astype(jnp.float32)
    num_seqs = jnp.maximum(jnp.sum(has_B), 1.0)
    seq_sum_B = jnp.sum(d_BxT * m, axis=1)
    return {
        "mean": s / jnp.maximum(n, 1.0),
        "mean_abs": s_abs / jnp.maximum(n, 1.0),
        "max_abs": jnp.max(jnp.where(m > 0, jnp.abs(d_BxT), 0.0)),
        "seq_mean": jnp.sum(seq_sum_B * has_B) / num_seqs,
        "seq_token_mean": jnp.sum(seq_sum_B / jnp.maximum(n_B, 1.0)) / num_seqs,
    }
