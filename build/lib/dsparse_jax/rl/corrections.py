"""Off-policy corrections for rollout/trainer mismatch: TIS weights and MIS masks.

old_logp: the trainer's policy before the update (pi_old, dense), rollout_logp: the
policy that generated the tokens (mu, e.g. sparse). Ratio rho = exp(old - rollout).
All outputs are detached (stop_gradient); metrics are fractions over masked tokens.
"""

import dataclasses

import jax
import jax.numpy as jnp

from dsparse_jax.rl.losses import masked_mean


@dataclasses.dataclass(frozen=True)
class Correction:
    """Which correction theta's batch applies (rl.is_correction) and the settings of both:
    the TIS clip and the MIS mask are measured either way."""

    kind: str = "none"  # none | tis | mis
    tis_cap: float = 2.0  # TIS weight min(pi_old / mu, cap)
    mis_lo: float = 0.5  # MIS keeps tokens with ratio in [lo, hi]
    mis_hi: float = 2.0
    mis_level: str = "token"  # token | sequence (geometric mean ratio)


def tis_weights(old_logp_BxT, rollout_logp_BxT, mask_BxT, cap):
    """Truncated importance weights w = min(rho, cap), 0 outside the mask.

    Returns (w_BxT, metrics) with metrics['tis_clip_frac'] = fraction of masked
    tokens with rho > cap and metrics['tis_weight_mean'] = mean w over masked tokens.
    Pass w as `token_weights_BxT` to `policy_loss`.
    """
    valid_BxT = mask_BxT > 0
    log_rho_BxT = jnp.where(valid_BxT, old_logp_BxT - rollout_logp_BxT, 0.0)
    log_rho_BxT = jax.lax.stop_gradient(log_rho_BxT.astype(jnp.float32))
    log_cap = jnp.log(jnp.asarray(cap, jnp.float32))
    # exp(min(log rho, log C)) == min(rho, C) without overflow.
    w_BxT = jnp.where(valid_BxT, jnp.exp(jnp.minimum(log_rho_BxT, log_cap)), 0.0)
    metrics = {
        "tis_clip_frac": masked_mean((log_rho_BxT > log_cap).astype(jnp.float32), mask_BxT),
        "tis_weight_mean": masked_mean(w_BxT, mask_BxT),
    }
    return w_BxT, metrics


def mis_mask(old_logp_BxT, rollout_logp_BxT, mask_BxT, lo, hi, level="token"):
    """Masked importance sampling (IcePop-style): drop tokens whose ratio leaves [lo, hi].

    level='token':    keep token t iff lo <= rho_t <= hi.
    level='sequence': rho_seq = exp(mean of log rho over the sequence's masked tokens)
                      (geometric mean); keep all its tokens iff lo <= rho_seq <= hi.
    Returns (new_mask_BxT, metrics) with new_mask = mask * keep (same dtype as mask) and
    metrics['mis_masked_frac'] = fraction of masked tokens dropped.
    """
    m = mask_BxT.astype(jnp.float32)
    valid_BxT = m > 0
    log_rho_BxT = jnp.where(valid_BxT, old_logp_BxT - rollout_logp_BxT, 0.0)
    log_rho_BxT = jax.lax.stop_gradient(log_rho_BxT.astype(jnp.float32))
    log_lo, log_hi = jnp.log(jnp.asarray(lo, jnp.float32)), jnp.log(jnp.asarray(hi, jnp.float32))
    if level == "token":
        keep_BxT = (log_rho_BxT >= log_lo) & (log_rho_BxT <= log_hi)
    elif level == "sequence":
        n_B = jnp.sum(m, axis=1)
        seq_log_rho_B = jnp.sum(log_rho_BxT * m, axis=1) / jnp.maximum(n_B, 1.0)
        keep_B = (seq_log_rho_B >= log_lo) & (seq_log_rho_B <= log_hi)
        keep_BxT = jnp.broadcast_to(keep_B[:, None], m.shape)
    else:
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    new_mask_BxT = (m * keep_BxT).astype(mask_BxT.dtype)
    metrics = {"mis_masked_frac": masked_mean((~keep_BxT).astype(jnp.float32), m)}
    return new_mask_BxT, metrics
