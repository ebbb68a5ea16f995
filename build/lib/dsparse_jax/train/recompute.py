"""Every teacher-forced recompute of the RL step, no gradient: one place.

Two policies share theta (the model's nnx.State):
  pi_dense(theta)          dense attention, no adapter: the policy being trained;
  the actor's twin         the rollout policy re-run teacher-forced: sparse attention on
                           exactly the rollout's recorded pages (+ the LoRA tree phi), or,
                           in a speculative sparse_self rollout, the drafter itself.

`token_logprobs` is the teacher-forced forward every update shares (with a gradient in
theta's and phi's losses). The recomputes:
  `dense_and_twin`  dense theta and the actor's twin of a batch, with the exact mismatch
                    metrics of the two full distributions (the [B, S, V] logits never
                    leave the device call); `of_rollout` runs it on a Rollout;
  `logprobs`        one policy's log-probs: the reference (rl.kl_coef) and phi's teacher
                    recomputed after theta's update (distill.teacher=recomputed);
  `teacher_logits`  the teacher's full logits inside phi's step (exact divergences).
The forwards run over equal groups of rows in sequence (`map_row_chunks`), so peak memory
is that of a group; the metrics are computed over the whole batch (`batch_metrics`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.rl import losses, mismatch
from dsparse_jax.sampling.sampler import Rollout, truncate_logits


# ------------------------------------------------------------------------------ forwards
def token_logprobs(
    graphdef,
    params,
    tokens_BxS,
    *,
    temperature: float = 1.0,
    spec: AttentionSpec = AttentionSpec(),
    pages=None,
    lora=None,
    lora_scale: float = 1.0,
    draft_start=None,
    with_logits: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
):
    """Teacher-forced log p(token_s | tokens_<s) under log_softmax(logits / temperature).

    top_k / top_p (rl.top_k, rl.top_p): the log-probs and entropy are those of the
    truncated distribution the rollout drew from (sampler.truncate_logits: top-k, then
    top-p, renormalised); a token outside it gets TRUNCATED_LOGP, with no gradient.
    draft_start: the self-speculative drafter's record (Transformer.forward). Returns
    (logp_BxS, entropy_BxS) and, if with_logits, the scaled logits [B, S, V] aligned the
    same way (row s = the distribution token s was drawn from; never truncated).
    """
    model = nnx.merge(graphdef, params)
    logits = model.forward(
        tokens_BxS, spec, pages=pages, lora=lora, lora_scale=lora_scale, draft_start=draft_start
    )
    logits = logits / max(temperature, 1e-6)
    logits = jnp.pad(logits[:, :-1], ((0, 0), (1, 0), (0, 0)))  # row s predicts token s
    if top_k or top_p < 1.0:
        logp, entropy = _truncated_logprobs(logits, tokens_BxS, top_k, top_p)
    else:
        logp_all = jax.nn.log_softmax(logits, axis=-1)
        logp = jnp.take_along_axis(logp_all, tokens_BxS[..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    logp = logp.at[:, 0].set(0.0)
    entropy = entropy.at[:, 0].set(0.0)
    return (logp, entropy, logits) if with_logits else (logp, entropy)


# The log-prob of a token outside the truncated distribution (probability 0): finite, so
# the ratios of the losses stay defined (their log-ratio clamp bounds them), no gradient.
TRUNCATED_LOGP = -1e3


def _truncated_logprobs(logits_BxSxV, tokens_BxS, top_k: int, top_p: float):
    """(logp_BxS, entropy_BxS) of the top-k / top-p truncation of the scaled logits."""
    b, s, v = logits_BxSxV.shape
    kept = truncate_logits(logits_BxSxV.reshape(b * s, v), top_k, top_p).reshape(b, s, v)
    logp_all = jax.nn.log_softmax(kept, axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens_BxS[..., None], axis=-1)[..., 0]
    p_all = jnp.exp(logp_all)
    entropy = -jnp.sum(p_all * jnp.where(p_all > 0, logp_all, 0.0), axis=-1)
    return jnp.maximum(logp, TRUNCATED_LOGP), entropy


def map_row_chunks(fn, rows: dict, chunks: int):
    """fn(rows) computed on `chunks` equal groups of rows in sequence (lax.map) and
    concatenated back to [B, ...]: peak memory of B / chunks rows, one compiled body.
    `chunks` divides B (callers take gcd(B, chunks))."""
    if chunks == 1:
        return fn(rows)
    split = jax.tree.map(lambda x: x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:]), rows)
    out = jax.lax.map(fn, split)
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), out)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "spec", "chunks"))
def logprobs(
    params,
    tokens_BxS,
    pages=None,
    *,
    graphdef,
    temperature: float,
    spec: AttentionSpec = AttentionSpec(),
    chunks: int = 1,
):
    """One policy's log-probs and entropies of a rollout batch, no gradient, over `chunks`
    groups of rows in sequence (`map_row_chunks`): the reference policy's (rl.kl_coef) and
    phi's recomputed teacher's. With a sparse spec and the rollout's pages: the
    teacher-forced sparse forward."""
    fn = lambda r: token_logprobs(
        graphdef, params, r["tokens"], temperature=temperature, spec=spec, pages=r["pages"]
    )
    return map_row_chunks(fn, {"tokens": tokens_BxS, "pages": pages}, chunks)


def teacher_logits(teacher_params, tokens_BxS, *, graphdef, temperature: float):
    """The dense teacher's scaled logits [B, S, V] (aligned like `token_logprobs`), detached:
    the divergence target inside phi's step (train/distill.py)."""
    _, _, logits = token_logprobs(
        graphdef,
        jax.lax.stop_gradient(teacher_params),
        tokens_BxS,
        temperature=temperature,
        with_logits=True,
    )
    return jax.lax.stop_gradient(logits)


# ------------------------------------------------------------- dense theta and the twin
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
    top_k=0,
    top_p=1.0,
) -> dict:
    """Per-token outputs of the recompute on one chunk of rows: dense_logp, dense_entropy
    and, with a twin, twin_logp and `token_mismatch` (the [B, S, V] logits stay here).
    draft_start: the twin is the self-speculative drafter (Transformer.forward). top_k /
    top_p: the log-probs are the truncated distributions' (the rollout's); the mismatch
    figures compare the untruncated ones."""
    dense_logp, dense_ent, dense_logits = token_logprobs(
        graphdef,
        params,
        tokens_BxS,
        temperature=temperature,
        spec=dense_spec,
        with_logits=True,
        top_k=top_k,
        top_p=top_p,
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
            top_k=top_k,
            top_p=top_p,
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
        "top_k",
        "top_p",
    ),
)
def dense_and_twin(
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
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict:
    """Teacher-forced log-probs of a rollout batch, no gradient (top_k / top_p: of the
    rollout's truncated distributions, `token_logprobs`).

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
            top_k=top_k,
            top_p=top_p,
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


# ---------------------------------------------------------------------- a rollout's rows
@dataclasses.dataclass(frozen=True)
class Settings:
    """What the RL step recomputes of a rollout, and how (rl_state.make_setup)."""

    temperature: float
    dense_spec: AttentionSpec  # theta's attention (dense)
    twin_spec: AttentionSpec | None  # the actor's (None: a dense actor, no twin)
    lora_scale: float = 1.0
    row_chunks: int = 1  # rows run in gcd(rows, row_chunks) groups: the update's microbatches
    bin_width: int = 256  # metrics.position_bin
    num_bins: int = 1
    draft_tokens: int = 0  # speculative: the drafter's twin_accept_rate_<j>, j <= this
    twin_every: int = 1  # metrics.twin_every: where only the figures read the twin
    all_rows_every: int = 0  # metrics.all_rows_every: also all M generated rows
    top_k: int = 0  # rl.top_k / rl.top_p: the log-probs of the rollout's truncation
    top_p: float = 1.0


def _draft_record(r: Rollout):
    """(draft_start, draft_logprobs) of a speculative sparse_self rollout, else None: the
    actor's twin is then the drafter."""
    return None if r.draft_start is None else (r.draft_start, r.draft_logprobs)


def _metric_settings(s: Settings) -> dict:
    return dict(bin_width=s.bin_width, num_bins=s.num_bins, draft_tokens=s.draft_tokens)


def row_groups(rows: int, s: Settings) -> int:
    """Row groups of a no-gradient forward of `rows` rows: gcd(rows, s.row_chunks)."""
    return math.gcd(rows, s.row_chunks)


def of_rollout(graphdef, params, lora, r: Rollout, s: Settings, twin: bool = True) -> dict:
    """`dense_and_twin` of the rows of `r`: dense theta and, with `twin`, the actor's twin."""
    return dense_and_twin(
        params,
        lora,
        r.tokens,
        r.prompt_lengths,
        r.completion_mask,
        r.pages(),
        r.logprobs,
        _draft_record(r),
        graphdef=graphdef,
        temperature=s.temperature,
        dense_spec=s.dense_spec,
        twin_spec=s.twin_spec if twin else None,
        lora_scale=s.lora_scale,
        chunks=row_groups(r.tokens.shape[0], s),
        top_k=s.top_k,
        top_p=s.top_p,
        **_metric_settings(s),
    )


def rollout_metrics(rec: dict, r: Rollout, s: Settings) -> dict:
    """`batch_metrics` of the rows of `r` from their recompute arrays `rec` (e.g. the kept
    rows of an all-rows recompute)."""
    return batch_metrics(
        rec,
        r.tokens,
        r.prompt_lengths,
        r.completion_mask,
        r.logprobs,
        _draft_record(r),
        **_metric_settings(s),
    )
