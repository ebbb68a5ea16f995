"""Group advantages of scalar rewards: GRPO (and Dr. GRPO, without the std) and RLOO. The
table rl/objectives.ADVANTAGES names them.

Samples of one prompt are contiguous in the batch: B = P * G, sample g of prompt p
sits at row p * G + g.
"""

import jax.numpy as jnp


def grpo_advantages(rewards_B, group_size, scale_by_std=True, eps=1e-6, ddof=1):
    """Group-relative advantages, one scalar per sample.

    adv = (r - mean_group(r)) / (std_group(r) + eps)   if scale_by_std (GRPO)
    adv =  r - mean_group(r)                            otherwise (Dr. GRPO)

    `ddof=1` is the unbiased std, as torch.std in the verl reference; use ddof=0 for
    the population std. A group whose rewards are all equal gets exactly 0 (also
    when float rounding makes its mean inexact, and with eps=0); with group_size == 1
    every advantage is 0. Raises ValueError if B % group_size != 0.
    """
    B = rewards_B.shape[0]
    if group_size < 1 or B % group_size != 0:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size}")
    r_PxG = rewards_B.astype(jnp.float32).reshape(B // group_size, group_size)
    adv_PxG = r_PxG - r_PxG.mean(axis=1, keepdims=True)
    if scale_by_std and group_size > ddof:
        std_Px1 = r_PxG.std(axis=1, ddof=ddof, keepdims=True)
        adv_PxG = adv_PxG / jnp.where(std_Px1 > 0, std_Px1 + eps, 1.0)
    all_equal_Px1 = r_PxG.max(axis=1, keepdims=True) == r_PxG.min(axis=1, keepdims=True)
    adv_PxG = jnp.where(all_equal_Px1, 0.0, adv_PxG)
    return adv_PxG.reshape(B)


def rloo_advantages(rewards_B, group_size):
    """RLOO: each sample's reward minus the mean of the other G - 1 rewards of its group,

    adv_i = r_i - 1/(G-1) sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean_group(r)),

    so with G = 2 the pair's advantages are +-(r_0 - r_1). A group whose rewards are all
    equal gets exactly 0. Raises ValueError for G < 2 or B % G != 0.
    """
    B = rewards_B.shape[0]
    if group_size < 2 or B % group_size != 0:
        raise ValueError(f"batch {B} is not a multiple of group_size {group_size} >= 2")
    r_PxG = rewards_B.astype(jnp.float32).reshape(B // group_size, group_size)
    others_PxG = (r_PxG.sum(axis=1, keepdims=True) - r_PxG) / (group_size - 1)
    adv_PxG = r_PxG - others_PxG
    all_equal_Px1 = r_PxG.max(axis=1, keepdims=True) == r_PxG.min(axis=1, keepdims=True)
    return jnp.where(all_equal_Px1, 0.0, adv_PxG).reshape(B)
