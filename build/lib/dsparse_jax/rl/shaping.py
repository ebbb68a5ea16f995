"""DAPO's length terms (arXiv 2503.14476, section 3.4): the soft overlong penalty added to
the reward, and which samples were truncated (overlong filtering masks their loss).
Pure jnp; the select phase applies them (train/phases.py)."""

import jax.numpy as jnp


def overlong_penalty(lengths_B, max_len, buffer, penalty=1.0):
    """DAPO's soft overlong punishment of a completion of |y| tokens, L_max = max_len,
    L_cache = buffer:

      0                                      |y| <= L_max - L_cache
      penalty * ((L_max - L_cache) - |y|) / L_cache    L_max - L_cache < |y| <= L_max
      -penalty                               L_max < |y|

    (continuous: -penalty at |y| = L_max). f32 [B]; buffer 0: all zeros."""
    if buffer <= 0:
        return jnp.zeros(lengths_B.shape, jnp.float32)
    if buffer > max_len:
        raise ValueError(f"buffer {buffer} exceeds max_len {max_len}")
    over_B = lengths_B.astype(jnp.float32) - (max_len - buffer)
    return -penalty * jnp.clip(over_B / buffer, 0.0, 1.0)


def truncated(tokens_BxS, mask_BxS, eos_id):
    """bool [B]: the rows whose completion holds no EOS (stopped by the length limit)."""
    ended_B = jnp.any((tokens_BxS == eos_id) & (mask_BxS > 0), axis=1)
    return ~ended_B
