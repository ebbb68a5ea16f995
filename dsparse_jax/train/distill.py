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
from dsparse_jax.rl.modes import DISTILL_KL, DISTILL_LOSSES, EXACT_KINDS
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


def accepted_drafts(draft_start_BxS):
    """bool [B, S]: the tokens that are accepted drafts of the self-speculative drafter (a
    position it ran past its block's start; the block's first token came from p)."""
    return (draft_start_BxS >= 0) & (jnp.arange(draft_start_BxS.shape[1]) > draft_start_BxS)


def draft_metrics(alpha_BxS, twin_logp, mask_BxS, draft_start_BxS, draft_logq_BxS, k: int):
    """The drafter's twin against the sampler: max |twin log q - sampled log q| over the
    accepted drafts, and per draft position j the twin's predicted acceptance (mean
    alpha over the tokens whose distribution tested draft j: row s is drawn from position
    s - 1, which is j - 1 past its block's start)."""
    took = accepted_drafts(draft_start_BxS) & (mask_BxS > 0)
    out = {"twin_draft_max_abs": jnp.max(jnp.where(took, jnp.abs(twin_logp - draft_logq_BxS), 0.0))}
    start_prev = jnp.pad(draft_start_BxS[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    offset = jnp.arange(draft_start_BxS.shape[1]) - 1 - start_prev
    tested = (start_prev >= 0) & (mask_BxS > 0)
    for j in range(k):
        out[f"twin_accept_rate_{j + 1}"] = losses.masked_mean(alpha_BxS, tested & (offset == j))
    return out


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
    params,
    lora,
    tokens_BxS,
    pages,
    *,
    graphdef,
    temperature,
    dense_spec,
    twin_spec,
    lora_scale,
    draft_start=None,
) -> dict:
    """Per-token outputs of the recompute on one chunk of rows: dense_logp, dense_entropy
    and, with a twin, twin_logp and `token_mismatch` (the [B, S, V] logits stay here).
    draft_start: the twin is the self-speculative drafter (Transformer.forward)."""
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
            draft_start=draft_start,
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
        "draft_tokens",
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
    draft=None,
    *,
    graphdef,
    temperature: float,
    dense_spec: AttentionSpec,
    twin_spec: AttentionSpec | None,
    lora_scale: float = 1.0,
    bin_width: int = 256,
    num_bins: int = 1,
    chunks: int = 1,
    draft_tokens: int = 0,
) -> dict:
    """Teacher-forced log-probs of a rollout batch, no gradient.

    Always: dense_logp / dense_entropy (theta, dense_spec, no adapter). With twin_spec
    (sparse modes): twin_logp, the rollout policy re-run teacher-forced (twin_spec with the
    rollout's `pages`, and `lora` when given), and exact mismatch metrics twin vs dense,
    plus twin_mu_max_abs = max |twin_logp - rollout_logp| (should be ~0: the twin is the
    actor). Without a twin (dense mode) the metrics compare dense_logp with the sampler's
    own log-probs mu (numerics only). Always: mu_dense_max_abs = max |rollout_logp -
    dense_logp| (~0 where the rollout is the dense policy's: dense, speculative).

    draft: (draft_start, draft_logprobs) of a speculative sparse_self rollout (Rollout):
    the twin is then the drafter itself, twin_draft_max_abs = max |twin_logp - log q| over
    the accepted drafts replaces twin_mu_max_abs, and twin_accept_rate_j (j = 1 ..
    draft_tokens) is the twin's mean sum_v min(p, q) at the positions that tested draft j:
    what the sampler's spec_accept_rate_j measures, predicted.

    The forwards run over `chunks` equal groups of rows in sequence (lax.map), so peak
    memory is that of B / chunks rows; the metrics are computed over the whole batch
    (`batch_metrics`). Returns the per-token arrays of `token_stats` and "metrics".
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
            draft_start=r["draft_start"],
        ),
        {"tokens": tokens_BxS, "pages": pages, "draft_start": None if draft is None else draft[0]},
        chunks,
    )
    out = dict(stats)
    out["metrics"] = batch_metrics(
        stats,
        tokens_BxS,
        prompt_lengths_B,
        mask_BxS,
        rollout_logp_BxS,
        draft,
        bin_width=bin_width,
        num_bins=num_bins,
        draft_tokens=draft_tokens,
    )
    return out


@functools.partial(jax.jit, static_argnames=("bin_width", "num_bins", "draft_tokens"))
def batch_metrics(
    stats: dict,
    tokens_BxS,
    prompt_lengths_B,
    mask_BxS,
    rollout_logp_BxS,
    draft=None,
    *,
    bin_width: int = 256,
    num_bins: int = 1,
    draft_tokens: int = 0,
) -> dict:
    """The recompute's metrics of a batch from its per-token outputs (`recompute`'s arrays,
    or any subset of their rows: the kept rows of an all-rows recompute)."""
    dense_logp, m = stats["dense_logp"], mask_BxS
    if "twin_logp" not in stats:
        k3 = losses.kl_estimate(rollout_logp_BxS, dense_logp, "k3")
        metrics = {"kl_k3": losses.masked_mean(k3, m)}
        metrics.update(_log_ratio_metrics(dense_logp, rollout_logp_BxS, m))
    else:
        twin_logp = stats["twin_logp"]
        metrics = mismatch_metrics(
            stats,
            dense_logp,
            twin_logp,
            m,
            completion_positions(tokens_BxS, prompt_lengths_B),
            bin_width=bin_width,
            num_bins=num_bins,
        )
        if draft is None:
            metrics["twin_mu_max_abs"] = jnp.max(
                jnp.where(m > 0, jnp.abs(twin_logp - rollout_logp_BxS), 0.0)
            )
        else:
            metrics.update(draft_metrics(stats["alpha"], twin_logp, m, *draft, draft_tokens))
    # The rollout's own log-probs against dense theta: numerics only where the rollout is
    # the dense policy's (dense mode, speculative rollouts), the mismatch otherwise.
    metrics["mu_dense_max_abs"] = jnp.max(
        jnp.where(m > 0, jnp.abs(dense_logp - rollout_logp_BxS), 0.0)
    )
    return metrics


# ------------------------------------------------------------------------------ phi update
@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """Static settings of the phi step (hashable: a jit static argument)."""

    spec: AttentionSpec  # the actor's (sparse) attention
    lora_scale: float
    temperature: float = 1.0
    loss: str = "ppo+kl"  # ppo+kl | kl_only
    kl: str = "k3"  # a key of rl/modes.DISTILL_KL
    kl_coef: float = 1e-3  # lambda
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    loss_agg: str = "token-mean"
    microbatches: int = 1
    sampler: str = "actor"  # whose samples the tokens are: actor | dense (speculative)
    teacher: str = "cached"  # cached | recomputed (phases.update_phi)

    def __post_init__(self):
        if self.loss not in DISTILL_LOSSES:
            raise ValueError(f"DistillSettings.loss must be one of {DISTILL_LOSSES}")
        if self.kl not in DISTILL_KL or DISTILL_KL[self.kl].get(self.sampler) is None:
            raise ValueError(
                f"DistillSettings.kl={self.kl!r} on {self.sampler!r} samples: no divergence "
                f"(rl/modes.DISTILL_KL)"
            )

    @property
    def exact(self) -> bool:
        return self.kl in EXACT_KINDS

    @property
    def divergence(self) -> str:
        """The divergence (rl/modes.DIVERGENCES) whose gradient the loss term follows."""
        return DISTILL_KL[self.kl][self.sampler]

    @property
    def value_name(self) -> str:
        """What the logged value of the term is: a sampled estimator's value estimates
        KL(sampler || other) (reverse on the actor's samples, forward on dense ones), an
        exact one is its divergence."""
        if self.exact:
            return self.divergence
        return {"actor": "kl_reverse", "dense": "kl_forward"}[self.sampler] + "_" + self.kl


def _divergence_term(s: DistillSettings, logp, logits, mb: dict, teacher_params, graphdef):
    """Per-token [B, S] divergence between the actor (logp, logits) and the detached
    teacher: over the vocabulary from the teacher's logits, or sampled from its log-probs."""
    if not s.exact:
        sampler = "student" if s.sampler == "actor" else "teacher"
        return losses.sampled_divergence(logp, mb["teacher_logp"], s.kl, sampler)
    _, _, t_logits = token_logprobs(
        graphdef,
        jax.lax.stop_gradient(teacher_params),
        mb["tokens"],
        temperature=s.temperature,
        with_logits=True,
    )
    t_logits = jax.lax.stop_gradient(t_logits)
    exact = {
        "exact_reverse": losses.reverse_kl,
        "exact_forward": losses.forward_kl,
        "tv": losses.tv_distance,
    }
    return exact[s.kl](logits, t_logits)


def phi_loss_terms(lora, params, graphdef, mb: dict, s: DistillSettings, teacher_params=None):
    """(numerator, (denominator, metric sums)) of the phi loss on one microbatch.

    mb: tokens, mask, adv [B], rollout_logp (mu: the PPO term's old log-probs), pages,
    draft_start (speculative sparse_self: the twin is the drafter, Transformer.forward)
    and teacher_logp (sampled estimators) — or teacher_params (exact divergences)."""
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
        draft_start=mb.get("draft_start"),
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
    div = _divergence_term(s, logp, logits, mb, teacher_params, graphdef)
    div_num, _ = losses.aggregate(div, mask, s.loss_agg)
    metrics["ppo_num"] = jax.lax.stop_gradient(num)
    num = num + s.kl_coef * div_num
    value = losses.masked_sum_count(jax.lax.stop_gradient(div), mask)[0]
    metrics[f"distill_{s.value_name}_sum"] = value
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
