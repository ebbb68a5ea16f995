"""Policy-gradient and KL loss terms for GRPO / DistillSparse: the policy losses PPO-clip
(`policy_loss`), GSPO (`gspo_loss`) and CISPO (`cispo_loss`), one signature each (the
table rl/objectives.POLICY_LOSSES names them), and the KL estimators.

Conventions: token arrays are [B, T], aligned to the model's token buffer;
`mask_BxT` is 1.0 on completion tokens that count, 0.0 elsewhere; log-probs are
those of the sampled tokens. Values at masked-out positions are never used (they may
be garbage), and they get zero gradient.

Loss terms return (numerator, denominator) with loss = numerator / denominator.
Denominators depend only on the masks, never on parameters. So, for minibatches i of
one batch,  sum_i num_i / sum_i den_i  equals the full-batch loss exactly, and the
full-batch gradient is  sum_i grad(num_i) / sum_i den_i : accumulate gradients of the
numerators and divide once by the total denominator (which can be computed up front
from the masks).
"""

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean")


def masked_sum_count(x_BxT, mask_BxT):
    """(sum of x over masked entries weighted by mask, sum of mask). Both f32 scalars."""
    m = mask_BxT.astype(jnp.float32)
    x = jnp.where(m > 0, x_BxT.astype(jnp.float32), 0.0)
    return jnp.sum(x * m), jnp.sum(m)


def masked_mean(x_BxT, mask_BxT):
    """Mask-weighted mean of x; 0.0 when the mask is empty."""
    s, n = masked_sum_count(x_BxT, mask_BxT)
    return s / jnp.maximum(n, 1.0)


def aggregate(loss_BxT, mask_BxT, agg="token-mean"):
    """Reduce a per-token loss to (numerator, denominator).

    'token-mean':          num = sum of masked token losses, den = number of tokens.
    'seq-mean-token-mean': num = sum over sequences of their token-mean,
                           den = number of sequences with >= 1 masked token.
    """
    m = mask_BxT.astype(jnp.float32)
    x_BxT = jnp.where(m > 0, loss_BxT.astype(jnp.float32), 0.0) * m
    if agg == "token-mean":
        return jnp.sum(x_BxT), jnp.sum(m)
    if agg == "seq-mean-token-mean":
        n_B = jnp.sum(m, axis=1)
        seq_mean_B = jnp.sum(x_BxT, axis=1) / jnp.maximum(n_B, 1.0)
        return jnp.sum(seq_mean_B), jnp.sum((n_B > 0).astype(jnp.float32))
    raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")


def policy_loss(
    logp_BxT,
    old_logp_BxT,
    adv_B,
    mask_BxT,
    *,
    clip_low,
    clip_high,
    dual_clip=None,
    token_weights_BxT=None,
    agg="token-mean",
    log_ratio_clamp=20.0,
):
    """PPO-clip (the GRPO surrogate), token level; loss to minimise. Returns (num, den, metrics).

    ratio = exp(clamp(logp - old_logp, +-log_ratio_clamp)), A = adv_B per sequence:
      l = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    dual_clip = c > 1 (dual-clip PPO): for A < 0, l = min(l, -A * c).
    token_weights_BxT (e.g. TIS weights) multiply l and are detached.
    loss = num / den (see module docstring for minibatch accumulation).

    metrics (all detached): entries ending in '_sum' are sums over masked tokens, to be
    divided by 'num_tokens' (see combine_metrics):
      clip_frac_sum       tokens where the PPO clip is active (clipped term > unclipped)
      clip_frac_low_sum   ... of which A < 0 (ratio < 1 - clip_low)
      clip_frac_high_sum  ... of which A > 0 (ratio > 1 + clip_high)
      dual_clip_frac_sum  tokens where the dual clip is active
      ratio_sum           sum of ratios;  ppo_kl_sum  sum of (old_logp - logp) (k1)
      ratio_max / ratio_min   over masked tokens (-inf / +inf if none)
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    m = mask_BxT.astype(jnp.float32)
    valid_BxT = m > 0
    log_ratio_BxT = jnp.where(valid_BxT, logp_BxT - old_logp_BxT, 0.0)
    log_ratio_BxT = jnp.clip(log_ratio_BxT, -log_ratio_clamp, log_ratio_clamp)
    ratio_BxT = jnp.exp(log_ratio_BxT)
    adv_Bx1 = adv_B.astype(jnp.float32)[:, None]

    unclipped_BxT = -adv_Bx1 * ratio_BxT
    clipped_BxT = -adv_Bx1 * jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high)
    pg_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
    clip_active_BxT = clipped_BxT > unclipped_BxT
    if dual_clip is not None:
        dual_bound_Bx1 = -adv_Bx1 * dual_clip
        dual_active_BxT = (adv_Bx1 < 0) & (pg_BxT > dual_bound_Bx1)
        pg_BxT = jnp.where(adv_Bx1 < 0, jnp.minimum(pg_BxT, dual_bound_Bx1), pg_BxT)
    else:
        dual_active_BxT = jnp.zeros_like(clip_active_BxT)
    if token_weights_BxT is not None:
        pg_BxT = pg_BxT * jax.lax.stop_gradient(token_weights_BxT.astype(jnp.float32))

    num, den = aggregate(pg_BxT, m, agg)
    low_BxT, high_BxT = clip_active_BxT & (adv_Bx1 < 0), clip_active_BxT & (adv_Bx1 > 0)
    metrics = _ratio_metrics(
        m, clip_active_BxT, low_BxT, high_BxT, dual_active_BxT, ratio_BxT, log_ratio_BxT
    )
    return num, den, metrics


def gspo_loss(
    logp_BxT,
    old_logp_BxT,
    adv_B,
    mask_BxT,
    *,
    clip_low,
    clip_high,
    dual_clip=None,
    token_weights_BxT=None,
    agg="seq-mean-token-mean",
    log_ratio_clamp=20.0,
):
    """GSPO (arXiv 2507.18071), sequence level; loss to minimise. Returns (num, den, metrics).

    The sequence ratio is the length-normalised likelihood ratio of sequence i,
      s_i = exp(clamp(mean over its masked tokens of (logp - old_logp), +-log_ratio_clamp)),
    clipped per sequence with GSPO's own (small) range:
      l_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_low, 1 + clip_high)).
    Every masked token of sequence i carries l_i (times its detached token weight), so
    agg='seq-mean-token-mean' gives the paper's mean over sequences (1/G sum_i l_i) and
    'token-mean' weights each sequence by its length. A row's terms depend on that row
    only, so minibatch num / den sums are exact. At sequence length 1, s_i is the token
    ratio and this is `policy_loss`. No dual clip. metrics: `policy_loss`'s, with the
    sequence ratio (per token) and its clip.
    """
    _no_dual_clip("gspo", dual_clip, agg)
    m = mask_BxT.astype(jnp.float32)
    valid_BxT = m > 0
    log_ratio_BxT = jnp.where(valid_BxT, logp_BxT - old_logp_BxT, 0.0)
    n_B = jnp.sum(m, axis=1)
    seq_log_ratio_B = jnp.sum(log_ratio_BxT * m, axis=1) / jnp.maximum(n_B, 1.0)
    seq_log_ratio_B = jnp.clip(seq_log_ratio_B, -log_ratio_clamp, log_ratio_clamp)
    s_B = jnp.exp(seq_log_ratio_B)
    adv = adv_B.astype(jnp.float32)
    unclipped_B = -adv * s_B
    clipped_B = -adv * jnp.clip(s_B, 1.0 - clip_low, 1.0 + clip_high)
    pg_B = jnp.maximum(unclipped_B, clipped_B)
    pg_BxT = jnp.broadcast_to(pg_B[:, None], m.shape)
    if token_weights_BxT is not None:
        pg_BxT = pg_BxT * jax.lax.stop_gradient(token_weights_BxT.astype(jnp.float32))
    num, den = aggregate(pg_BxT, m, agg)

    per_token = lambda x_B: jnp.broadcast_to(x_B[:, None], m.shape)
    active_B = clipped_B > unclipped_B
    metrics = _ratio_metrics(
        m,
        per_token(active_B),
        per_token(active_B & (adv < 0)),
        per_token(active_B & (adv > 0)),
        jnp.zeros(m.shape, bool),
        per_token(s_B),
        jnp.clip(log_ratio_BxT, -log_ratio_clamp, log_ratio_clamp),
    )
    return num, den, metrics


def cispo_loss(
    logp_BxT,
    old_logp_BxT,
    adv_B,
    mask_BxT,
    *,
    clip_low,
    clip_high,
    dual_clip=None,
    token_weights_BxT=None,
    agg="token-mean",
    log_ratio_clamp=20.0,
):
    """CISPO (MiniMax-M1, arXiv 2506.13585), token level; loss to minimise. Returns
    (num, den, metrics).

    A clipped, detached importance weight on a REINFORCE term, per token:
      r = exp(clamp(logp - old_logp, +-log_ratio_clamp)),  w = sg(clip(r, 1 - clip_low,
      1 + clip_high)),  l = -w * A * logp
    so every token keeps the gradient -w * A * grad logp (none is clipped out of it; at
    r = 1 it is PPO's unclipped gradient). agg='token-mean' is the paper's 1 / sum |o_i|.
    The value of l is not PPO's (it holds logp). No dual clip. metrics: `policy_loss`'s,
    with the clip the weight's (low: r < 1 - clip_low, high: r > 1 + clip_high).
    """
    _no_dual_clip("cispo", dual_clip, agg)
    m = mask_BxT.astype(jnp.float32)
    valid_BxT = m > 0
    log_ratio_BxT = jnp.where(valid_BxT, logp_BxT - old_logp_BxT, 0.0)
    log_ratio_BxT = jnp.clip(log_ratio_BxT, -log_ratio_clamp, log_ratio_clamp)
    ratio_BxT = jnp.exp(log_ratio_BxT)
    w_BxT = jax.lax.stop_gradient(jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high))
    adv_Bx1 = adv_B.astype(jnp.float32)[:, None]
    pg_BxT = -w_BxT * adv_Bx1 * jnp.where(valid_BxT, logp_BxT, 0.0).astype(jnp.float32)
    if token_weights_BxT is not None:
        pg_BxT = pg_BxT * jax.lax.stop_gradient(token_weights_BxT.astype(jnp.float32))
    num, den = aggregate(pg_BxT, m, agg)

    low_BxT, high_BxT = ratio_BxT < 1.0 - clip_low, ratio_BxT > 1.0 + clip_high
    metrics = _ratio_metrics(
        m,
        low_BxT | high_BxT,
        low_BxT,
        high_BxT,
        jnp.zeros(m.shape, bool),
        ratio_BxT,
        log_ratio_BxT,
    )
    return num, den, metrics


def _no_dual_clip(name, dual_clip, agg):
    if dual_clip is not None:
        raise ValueError(f"{name} has no dual clip, got dual_clip={dual_clip}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")


def _ratio_metrics(m, clip_BxT, low_BxT, high_BxT, dual_BxT, ratio_BxT, log_ratio_BxT):
    """The policy losses' metrics (see `policy_loss`), all detached; m: the f32 mask."""
    valid_BxT = m > 0
    ratio_sg_BxT = jax.lax.stop_gradient(ratio_BxT)
    token_sum = lambda x_BxT: masked_sum_count(jax.lax.stop_gradient(x_BxT).astype(jnp.float32), m)[
        0
    ]
    return {
        "clip_frac_sum": token_sum(clip_BxT),
        "clip_frac_low_sum": token_sum(low_BxT),
        "clip_frac_high_sum": token_sum(high_BxT),
        "dual_clip_frac_sum": token_sum(dual_BxT),
        "ratio_sum": token_sum(ratio_BxT),
        "ppo_kl_sum": token_sum(-log_ratio_BxT),
        "ratio_max": jnp.max(jnp.where(valid_BxT, ratio_sg_BxT, -jnp.inf)),
        "ratio_min": jnp.min(jnp.where(valid_BxT, ratio_sg_BxT, jnp.inf)),
        "num_tokens": jnp.sum(m),
    }


def combine_metrics(metrics_list):
    """Merge metric dicts of minibatches into full-batch values.

    '*_sum' keys -> summed then divided by total 'num_tokens' (key without '_sum');
    '*_max' / '*_min' -> max / min; 'num_tokens' -> summed. Other keys are summed.
    """
    out, total = {}, sum(m["num_tokens"] for m in metrics_list)
    for k in metrics_list[0]:
        vals = [m[k] for m in metrics_list]
        if k.endswith("_sum"):
            out[k[:-4]] = sum(vals) / jnp.maximum(total, 1.0)
        elif k.endswith("_max"):
            out[k] = jnp.max(jnp.stack(vals))
        elif k.endswith("_min"):
            out[k] = jnp.min(jnp.stack(vals))
        else:
            out[k] = sum(vals)
    return out


def kl_estimate(logp_BxT, ref_logp_BxT, kind="k3", *, log_ratio_clamp=20.0, kl_clamp=10.0):
    """Per-token estimator of KL(pi || ref) on tokens sampled from pi. Returns [B, T].

    r = ref_logp - logp (ref is detached):  'k1' = -r,  'k2' = r^2 / 2,
    'k3' = exp(r) - r - 1 with r clamped to +-log_ratio_clamp and the result to
    +-kl_clamp (the clamps apply to k3 only; None disables one).
    DistillSparse: kl_estimate(logp_sparse, logp_dense, 'k3') = KL(pi_sparse || pi_dense).
    Reduce with `aggregate` / `masked_sum_count`.
    """
    r_BxT = jax.lax.stop_gradient(ref_logp_BxT).astype(jnp.float32) - logp_BxT.astype(jnp.float32)
    if kind == "k1":
        return -r_BxT
    if kind == "k2":
        return 0.5 * jnp.square(r_BxT)
    if kind == "k3":
        if log_ratio_clamp is not None:
            r_BxT = jnp.clip(r_BxT, -log_ratio_clamp, log_ratio_clamp)
        kl_BxT = jnp.exp(r_BxT) - r_BxT - 1.0
        if kl_clamp is not None:
            kl_BxT = jnp.clip(kl_BxT, -kl_clamp, kl_clamp)
        return kl_BxT
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def exact_kl(logits_a_BxTxV, logits_b_BxTxV):
    """Full-vocabulary KL(a || b) per token, [B, T], computed in f32.

    Vocabulary entries with p_a = 0 contribute 0 (safe for -inf logits).
    """
    la = jax.nn.log_softmax(logits_a_BxTxV.astype(jnp.float32), axis=-1)
    lb = jax.nn.log_softmax(logits_b_BxTxV.astype(jnp.float32), axis=-1)
    pa = jnp.exp(la)
    support = pa > 0
    diff = jnp.where(support, la, 0.0) - jnp.where(support, lb, 0.0)
    return jnp.sum(jnp.where(support, pa * diff, 0.0), axis=-1)


def sampled_divergence(student_logp_BxT, teacher_logp_BxT, kind, sampler, *, kl_clamp=10.0):
    """Per-token sampled estimate of KL(sampler || other) on tokens drawn from `sampler`
    ('student': the actor's own samples; 'teacher': the dense policy's, as in a
    speculative rollout), teacher detached. Returns [B, T].

    With s = log sampler(x) and o = log other(x):  'k1' = s - o,  'k2' = (s - o)^2 / 2,
    'k3' = exp(o - s) - (o - s) - 1 (o - s clamped to +-20, the result to +-kl_clamp).
    Used as a loss of the student q, the estimators' expected gradients differ from what
    their values estimate (METHOD.md, "Distilling for acceptance"):
      student samples: k1 -> 0; k2 -> grad KL(q || p); k3 -> grad KL(p || q);
      teacher samples: k1 -> grad KL(p || q); k2 -> no divergence; k3 -> grad KL(p || q).
    rl/modes.DISTILL_KL is the table of which combination trains phi towards what.
    """
    q_BxT = student_logp_BxT.astype(jnp.float32)
    p_BxT = jax.lax.stop_gradient(teacher_logp_BxT).astype(jnp.float32)
    if sampler not in ("student", "teacher"):
        raise ValueError(f"sampler must be 'student' or 'teacher', got {sampler!r}")
    s_BxT, o_BxT = (q_BxT, p_BxT) if sampler == "student" else (p_BxT, q_BxT)
    if kind == "k1":
        return s_BxT - o_BxT
    if kind == "k2":
        return 0.5 * jnp.square(s_BxT - o_BxT)
    if kind == "k3":
        r_BxT = jnp.clip(o_BxT - s_BxT, -20.0, 20.0)
        return jnp.clip(jnp.exp(r_BxT) - r_BxT - 1.0, -kl_clamp, kl_clamp)
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3', got {kind!r}")


def tv_distance(student_logits_BxTxV, teacher_logits_BxTxV):
    """Total variation 1 - sum_v min(p(v), q(v)) per token [B, T]: the chance that a draft
    from q is rejected by a verifier p (speculative sampling), in f32."""
    q = jax.nn.softmax(student_logits_BxTxV.astype(jnp.float32), axis=-1)
    p = jax.nn.softmax(teacher_logits_BxTxV.astype(jnp.float32), axis=-1)
    return 1.0 - jnp.sum(jnp.minimum(p, q), axis=-1)


def reverse_kl(student_logits_BxTxV, teacher_logits_BxTxV):
    """KL(student || teacher) per token (mode-seeking; DistillSparse's direction)."""
    return exact_kl(student_logits_BxTxV, teacher_logits_BxTxV)


def forward_kl(student_logits_BxTxV, teacher_logits_BxTxV):
    """KL(teacher || student) per token (mass-covering)."""
    return exact_kl(teacher_logits_BxTxV, student_logits_BxTxV)
