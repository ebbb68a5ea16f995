"""DistillSparse pieces of the RL step: teacher-forced recomputes and the phi (LoRA) update.

Two policies share theta (the model's nnx.State):
  pi_dense(theta)          dense attention, no adapter: the policy being trained;
  pi_sparse(theta, phi)    block-sparse attention + the LoRA delta tree phi: the actor.

`recompute` runs, in one jitted call and without gradients, the dense teacher-forced
forward (theta, no adapter) and, in sparse modes, the rollout policy's teacher-forced
twin (sparse attention on exactly the rollout's recorded pages, plus phi in
distillsparse). It returns both token log-probs and the exact mismatch metrics of the two
full distributions; the [B, S, V] logits never leave the device call.

`phi_update` is one optimizer step of phi with theta frozen:
  L = L_PPO(log pi_sparse, adv; old = rollout log-probs mu)              (distill.loss=ppo+kl)
      + lambda * KL(pi_sparse || pi_dense) on the sampled tokens, teacher detached.
The gradient is taken with respect to the LoRA tree only (theta enters as a plain,
stop-gradient argument, so no gradient of theta is ever formed) and theta is not an
output. KL kinds: k1, k2, k3 (METHOD.md clamps) on the sampled tokens, using cached or
recomputed dense log-probs (`teacher_logp` in the minibatch); exact_reverse
KL(sparse || dense) and exact_forward KL(dense || sparse) over the full vocabulary, using
the teacher's full logits from a dense forward of `teacher_params` inside the step (the
pre-update theta for distill.teacher=cached, the updated one for recomputed).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.parallel import sharding
from dsparse_jax.rl import losses, mismatch
from dsparse_jax.rl.modes import DISTILL_LOSSES, KL_KINDS
from dsparse_jax.train.steps import accumulated_update, map_row_chunks, token_logprobs


# ------------------------------------------------------------------------ mismatch metrics
def completion_positions(tokens_BxS, prompt_lengths_B):
    """0-based position of every buffer entry within its completion (negative in prompts)."""
    return jnp.arange(tokens_BxS.shape[1])[None, :] - prompt_lengths_B[:, None]


def token_mismatch(dense_logits, twin_logits) -> dict:
    """Per token, from the two full distributions: alpha = sum_v min(p_dense, p_sparse),
    exact KL(sparse || dense) (kl_rev) and KL(dense || sparse) (kl_fwd); each [B, S]."""
    return {
        "alpha": mismatch.token_acceptance(dense_logits, twin_logits),
        "kl_rev": mismatch.token_kl(twin_logits, dense_logits),
        "kl_fwd": mismatch.token_kl(dense_logits, twin_logits),
    }


def mismatch_metrics(
    token_stats: dict,
    dense_logp,
    twin_logp,
    mask_BxS,
    positions_BxS,
    *,
    bin_width: int,
    num_bins: int,
) -> dict:
    """Exact mismatch between the rollout policy's twin (p_sparse) and pi_dense.

    token_stats: `token_mismatch` of the batch. Adds the k3 estimate of KL(sparse || dense)
    on the sampled token and the log-ratio d = logp_dense - logp_sparse (log rho of
    TIS/MIS). Returns scalars and, per completion-position bin, arrays [num_bins] (NaN
    for empty bins).
    """
    alpha, kl_rev = token_stats["alpha"], token_stats["kl_rev"]
    k3 = losses.kl_estimate(twin_logp, dense_logp, "k3")
    mean = lambda x: losses.masked_mean(x, mask_BxS)
    out = {
        "alpha_mean": mean(alpha),
        "alpha_p5": mismatch.masked_percentile(alpha, mask_BxS, 5.0),
        "kl_exact": mean(kl_rev),
        "kl_exact_fwd": mean(token_stats["kl_fwd"]),
        "kl_k3": mean(k3),
    }
    out.update(_log_ratio_metrics(dense_logp, twin_logp, mask_BxS))
    a_bins = mismatch.position_bins(alpha, mask_BxS, positions_BxS, bin_width, num_bins)
    k_bins = mismatch.position_bins(kl_rev, mask_BxS, positions_BxS, bin_width, num_bins)
    out["bins"] = {
        "alpha_mean": a_bins["mean"],
        "alpha_p5": a_bins["percentile"],
        "kl_exact": k_bins["mean"],
        "tokens": a_bins["count"],
    }
    return out


def _log_ratio_metrics(dense_logp, other_logp, mask_BxS) -> dict:
    s = mismatch.log_ratio_stats(dense_logp, other_logp, mask_BxS)
    return {
        "log_ratio_mean": s["mean"],
        "log_ratio_mean_abs": s["mean_abs"],
        "log_ratio_max_abs": s["max_abs"],
        "seq_log_ratio_mean": s["seq_mean"],
        "seq_log_ratio_token_mean": s["seq_token_mean"],
    }


def flatten_metrics(m: dict, prefix: str = "") -> dict:
    """Host floats; per-bin arrays become keys like alpha_p5_bin0, alpha_p5_bin1, ..."""
    out = {}
    for k, v in m.items():
        if k == "bins":
            for name, arr in v.items():
                for i, x in enumerate(np.asarray(arr).tolist()):
                    out[f"{prefix}{name}_bin{i}"] = float(x)
        else:
            out[prefix + k] = float(np.asarray(v))
    return out


# ------------------------------------------------------------------------------ recompute
def token_stats(
    params, lora, tokens_BxS, pages, *, graphdef, temperature, dense_spec, twin_spec, lora_scale
) -> dict:
    """Per-token outputs of the recompute on one chunk of rows: dense_logp, dense_entropy
    and, with a twin, twin_logp and `token_mismatch` (the [B, S, V] logits stay here)."""
    dense_logp, dense_ent, dense_logits = token_logprobs(
        graphdef, params, tokens_BxS, temperature=temperature, spec=dense_spec, with_logits=True
    )
    out = {"dense_logp": dense_logp, "dense_entropy": dense_ent}
    if twin_spec is not None:
        twin_logp, _, twin_logits = token_logprobs(
            graphdef,
            params,
            tokens_BxS,
            temperature=temperature,
            spec=twin_spec,
            pages=pages,
            lora=lora,
            lora_scale=lora_scale,
            with_logits=True,
        )
        out["twin_logp"] = twin_logp
        out.update(token_mismatch(dense_logits, twin_logits))
    return out


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "temperature",
        "dense_spec",
        "twin_spec",
        "lora_scale",
        "bin_width",
        "num_bins",
        "chunks",
    ),
)
def recompute(
    params,
    lora,
    tokens_BxS,
    prompt_lengths_B,
    mask_BxS,
    pages,
    rollout_logp_BxS,
    *,
    graphdef,
    temperature: float,
    dense_spec: AttentionSpec,
    twin_spec: AttentionSpec | None,
    lora_scale: float = 1.0,
    bin_width: int = 256,
    num_bins: int = 1,
    chunks: int = 1,
) -> dict:
    """Teacher-forced log-probs of a rollout batch, no gradient.

    Always: dense_logp / dense_entropy (theta, dense_spec, no adapter). With twin_spec
    (sparse modes): twin_logp, the rollout policy re-run teacher-forced (twin_spec with the
    rollout's `pages`, and `lora` when given), and exact mismatch metrics twin vs dense,
    plus twin_mu_max_abs = max |twin_logp - rollout_logp| (should be ~0: the twin is the
    actor). Without a twin (dense mode) the metrics compare dense_logp with the sampler's
    own log-probs mu (numerics only). Always: mu_dense_max_abs = max |rollout_logp -
    dense_logp| (~0 where the rollout is the dense policy's: dense, speculative).

    The forwards run over `chunks` equal groups of rows in sequence (lax.map), so peak
    memory is that of B / chunks rows; the metrics are computed over the whole batch.
    """
    stats = map_row_chunks(
        lambda r: token_stats(
            params,
            lora,
            r["tokens"],
            r["pages"],
            graphdef=graphdef,
            temperature=temperature,
            dense_spec=dense_spec,
            twin_spec=twin_spec,
            lora_scale=lora_scale,
        ),
        {"tokens": tokens_BxS, "pages": pages},
        chunks,
    )
    out = {"dense_logp": stats["dense_logp"], "dense_entropy": stats["dense_entropy"]}
    dense_logp, m = stats["dense_logp"], mask_BxS
    if twin_spec is None:
        k3 = losses.kl_estimate(rollout_logp_BxS, dense_logp, "k3")
        metrics = {"kl_k3": losses.masked_mean(k3, m)}
        metrics.update(_log_ratio_metrics(dense_logp, rollout_logp_BxS, m))
    else:
        twin_logp = out["twin_logp"] = stats["twin_logp"]
        metrics = mismatch_metrics(
            stats,
            dense_logp,
            twin_logp,
            m,
            completion_positions(tokens_BxS, prompt_lengths_B),
            bin_width=bin_width,
            num_bins=num_bins,
        )
        metrics["twin_mu_max_abs"] = jnp.max(
            jnp.where(m > 0, jnp.abs(twin_logp - rollout_logp_BxS), 0.0)
        )
    # The rollout's own log-probs against dense theta: numerics only where the rollout is
    # the dense policy's (dense mode, speculative rollouts), the mismatch otherwise.
    metrics["mu_dense_max_abs"] = jnp.max(
        jnp.where(m > 0, jnp.abs(dense_logp - rollout_logp_BxS), 0.0)
    )
    out["metrics"] = metrics
    return out


# ------------------------------------------------------------------------------ phi update
@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Static settings of the phi step (hashable: a jit static argument)."""

    spec: AttentionSpec  # the actor's (sparse) attention
    lora_scale: float
    temperature: float = 1.0
    loss: str = "ppo+kl"  # ppo+kl | kl_only
    kl: str = "k3"  # k1 | k2 | k3 | exact_reverse | exact_forward
    kl_coef: float = 1e-3  # lambda
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    microbatches: int = 1

    def __post_init__(self):
        if self.loss not in DISTILL_LOSSES:
            raise ValueError(f"DistillSettings.loss must be one of {DISTILL_LOSSES}")
        if self.kl not in KL_KINDS:
            raise ValueError(f"DistillSettings.kl must be one of {KL_KINDS}")

    @property
    def exact(self) -> bool:
        return self.kl.startswith("exact")


def phi_loss_terms(lora, params, graphdef, mb: dict, s: DistillSettings, teacher_params=None):
    """(numerator, (denominator, metric sums)) of the phi loss on one microbatch.

    mb: tokens, mask, adv [B], rollout_logp (mu: the PPO term's old log-probs), pages,
    and teacher_logp (k-estimators) — or teacher_params (exact KLs)."""
    params = jax.lax.stop_gradient(params)
    logp, _, logits = token_logprobs(
        graphdef,
        params,
        mb["tokens"],
        temperature=s.temperature,
        spec=s.spec,
        pages=mb["pages"],
        lora=lora,
        lora_scale=s.lora_scale,
        with_logits=True,
    )
    mask = mb["mask"]
    if s.loss == "ppo+kl":
        num, den, metrics = losses.policy_loss(
            logp,
            mb["rollout_logp"],
            mb["adv"],
            mask,
            clip_low=s.clip_low,
            clip_high=s.clip_high,
            dual_clip=s.dual_clip,
            agg=s.loss_agg,
        )
    else:
        num, den = losses.aggregate(jnp.zeros_like(logp), mask, s.loss_agg)
        metrics = {"num_tokens": jnp.sum(mask.astype(jnp.float32))}
    if s.exact:
        _, _, t_logits = token_logprobs(
            graphdef,
            jax.lax.stop_gradient(teacher_params),
            mb["tokens"],
            temperature=s.temperature,
            with_logits=True,
        )
        t_logits = jax.lax.stop_gradient(t_logits)
        kl = (
            losses.reverse_kl(logits, t_logits)
            if s.kl == "exact_reverse"
            else losses.forward_kl(logits, t_logits)
        )
    else:
        kl = losses.kl_estimate(logp, mb["teacher_logp"], s.kl)
    kl_num, _ = losses.aggregate(kl, mask, s.loss_agg)
    metrics["ppo_num"] = jax.lax.stop_gradient(num)
    num = num + s.kl_coef * kl_num
    metrics["distill_kl_sum"] = losses.masked_sum_count(jax.lax.stop_gradient(kl), mask)[0]
    metrics["loss_num"] = jax.lax.stop_gradient(num)
    metrics["loss_den"] = den
    return num, (den, metrics)


@functools.partial(jax.jit, static_argnames=("graphdef", "tx", "settings"), donate_argnums=(0, 1))
def phi_update(
    lora,
    opt_state,
    mb: dict,
    params,
    teacher_params=None,
    *,
    graphdef,
    tx,
    settings: DistillSettings,
):
    """One optimizer step of phi on a minibatch (theta frozen, not returned).

    Returns (lora, opt_state, metric sums). Microbatches accumulate exactly, as in
    grpo.grpo_update."""
    if settings.exact and teacher_params is None:
        raise ValueError(f"distill.kl={settings.kl} needs teacher_params")
    terms = lambda phi, one: phi_loss_terms(
        phi, params, graphdef, one, settings, teacher_params
    )  # d/d(phi) only
    mb = sharding.constrain_batch(mb)  # on a mesh: outputs pinned to the rules (sharding.py)
    return sharding.constrain_update(
        accumulated_update(terms, lora, opt_state, mb, settings.microbatches, tx)
    )
