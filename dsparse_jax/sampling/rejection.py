"""Speculative acceptance: which drafted tokens a verifier keeps, and the token after them.

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023), per row, over the
k drafted tokens x_1..x_k and the verifier's distributions p_0..p_k (p_j is the target's
distribution for the token after x_1..x_j):

- a draft with probabilities q_j: x_{j+1} is accepted with probability
  min(1, p_j(x_{j+1}) / q_j(x_{j+1})); the first rejection at j is replaced by a sample
  from normalise(max(0, p_j - q_j));
- a deterministic draft (a proposed token, no q): x_{j+1} is accepted with probability
  p_j(x_{j+1}) (q is the point mass at x_{j+1}); a rejection is replaced by a sample from
  p_j with x_{j+1} removed, renormalised;
- all valid drafts accepted: a bonus token from p_{k_B}.

Every emitted token is then an exact sample of p (the verifier's truncated distribution,
`sampler.sampling_logprobs`). Greedy (temperature 0): a draft is accepted iff it is the
verifier's argmax, and the replacement / bonus is the argmax, token for token what plain
greedy decoding produces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accept(logp_BxTxV, drafts_BxK, draft_probs_BxKxV, num_drafts_B, key, greedy: bool):
    """Returns (accepted_B: the number of leading drafts kept, in [0, num_drafts_B];
    next_B: the replacement at the first rejection, or the bonus token; accepted_BxK: the
    per-position acceptance outcomes, valid where position < num_drafts_B).

    logp_BxTxV: T = k + 1 verifier log-probs of the distribution sampled from (-inf outside
      the truncation); drafts_BxK: the proposed tokens; draft_probs_BxKxV: the draft's
      (truncated) probabilities, or None for a deterministic draft; num_drafts_B: how many
      leading drafts of each row are real (the others are ignored).
    """
    b, k = drafts_BxK.shape
    valid_BxK = jnp.arange(k)[None] < num_drafts_B[:, None]
    if greedy:
        ok_BxK = drafts_BxK == jnp.argmax(logp_BxTxV[:, :k], axis=-1)
    else:
        key_u, key_r = jax.random.split(key)
        p_x = jnp.exp(jnp.take_along_axis(logp_BxTxV[:, :k], drafts_BxK[..., None], -1)[..., 0])
        if draft_probs_BxKxV is None:
            q_x = jnp.ones_like(p_x)
        else:
            q_x = jnp.take_along_axis(draft_probs_BxKxV, drafts_BxK[..., None], -1)[..., 0]
        u = jax.random.uniform(key_u, (b, k))
        ok_BxK = u * q_x < p_x  # u < p / q, without dividing by a zero q
    ok_BxK = ok_BxK & valid_BxK
    accepted_B = jnp.sum(jnp.cumprod(ok_BxK.astype(jnp.int32), axis=1), axis=1)

    rows = jnp.arange(b)
    logp_BxV = logp_BxTxV[rows, accepted_B]  # the distribution of the next token
    if greedy:
        return accepted_B, jnp.argmax(logp_BxV, axis=-1).astype(jnp.int32), ok_BxK
    rejected_B = accepted_B < num_drafts_B
    j_B = jnp.minimum(accepted_B, k - 1)  # the rejected position (when there is one)
    p_BxV = jnp.exp(logp_BxV)
    if draft_probs_BxKxV is None:
        remove = jax.nn.one_hot(drafts_BxK[rows, j_B], p_BxV.shape[-1], dtype=bool)
        residual_BxV = jnp.where(remove, 0.0, p_BxV)
    else:
        residual_BxV = jnp.maximum(p_BxV - draft_probs_BxKxV[rows, j_B], 0.0)
    # A rejection has probability sum(residual) > 0; the guard only catches float
    # round-off (p and q equal up to rounding) and rows without a rejection.
    use_residual = rejected_B & (residual_BxV.sum(-1) > 0)
    residual_BxV = jnp.where(use_residual[:, None], residual_BxV, p_BxV)
    next_B = jax.random.categorical(key_r, jnp.log(residual_BxV), axis=-1)
    return accepted_B, next_B.astype(jnp.int32), ok_BxK


def without(p_BxV, token_B):
    """p with token_B's mass removed (the residual after a deterministic draft of token_B is
    rejected; unnormalised)."""
    return jnp.where(jax.nn.one_hot(token_B, p_BxV.shape[-1], dtype=bool), 0.0, p_BxV)


def accept_tree(logp_BxTxV, tokens_BxT, parent_BxT, valid_BxT, width: int, key, greedy: bool):
    """Walks a token tree of deterministic drafts; returns (accepted_B: the accepted path's
    length in drafts, path_BxD: its node at each depth 0..D-1 (0: the root), next_B: the
    replacement or bonus token, reached_BxD / ok_BxD: per depth 1..D-1, whether a sibling
    was tested and whether one was accepted).

    The tree (`speculative` tree drafts): node 0 is the root (the row's last token), then
    D - 1 levels of `width` nodes each (node 1 + (d - 1) * width + i: depth d), with
    parent_BxT their parent's node index and valid_BxT whether the node exists; siblings in
    node order. logp_BxTxV: the verifier's log-probs after each node (-inf outside the
    truncation).

    The rule (recursive rejection over siblings, SpecInfer / Jeon et al. 2024 with point-mass
    drafts): at the current node with target r = p, each child x in turn is accepted with
    probability r(x) / sum(r); a rejected child's token leaves r (r <- r without x); the
    first accepted child becomes the current node (r <- its p); when none is accepted the
    next token is drawn from r. Every emitted token is an exact sample of p: by induction
    over the children, the token leaves the node with probability p(x) (docs/speculative.md).
    Greedy: a child is accepted iff it is p's argmax; the next token is p's argmax.
    """
    b, t, _ = logp_BxTxV.shape
    depth = (t - 1) // width + 1
    rows = jnp.arange(b)
    node_B = jnp.zeros((b,), jnp.int32)
    r_BxV = jnp.exp(logp_BxTxV[:, 0])
    stopped_B = jnp.zeros((b,), bool)
    path, reached, oks = [node_B], [], []
    keys = jax.random.split(key, (depth - 1) * width + 1)
    for d in range(1, depth):
        moved_B = jnp.zeros((b,), bool)
        tried_B = jnp.zeros((b,), bool)
        for i in range(width):
            n = 1 + (d - 1) * width + i
            x_B = tokens_BxT[:, n]
            is_child = valid_BxT[:, n] & (parent_BxT[:, n] == node_B) & ~stopped_B & ~moved_B
            if greedy:
                ok_B = x_B == jnp.argmax(logp_BxTxV[rows, node_B], axis=-1)
            else:
                u_B = jax.random.uniform(keys[(d - 1) * width + i], (b,))
                ok_B = u_B * r_BxV.sum(-1) < r_BxV[rows, x_B]
            take_B = is_child & ok_B
            r_BxV = jnp.where((is_child & ~ok_B)[:, None], without(r_BxV, x_B), r_BxV)
            tried_B |= is_child
            moved_B |= take_B
            node_B = jnp.where(take_B, n, node_B)
        r_BxV = jnp.where(moved_B[:, None], jnp.exp(logp_BxTxV[rows, node_B]), r_BxV)
        stopped_B |= ~moved_B
        path.append(node_B)
        reached.append(tried_B)
        oks.append(moved_B)
    path_BxD = jnp.stack(path, axis=1)
    accepted_B = jnp.sum(jnp.stack(oks, axis=1).astype(jnp.int32), axis=1)
    if greedy:
        next_B = jnp.argmax(logp_BxTxV[rows, node_B], axis=-1)
    else:
        # A rejection of every child leaves sum(r) > 0 but for float round-off; then p.
        r_BxV = jnp.where(
            r_BxV.sum(-1, keepdims=True) > 0, r_BxV, jnp.exp(logp_BxTxV[rows, node_B])
        )
        next_B = jax.random.categorical(keys[-1], jnp.log(r_BxV), axis=-1)
    return accepted_B, path_BxD, next_B.astype(jnp.int32), jnp.stack(reached, 1), jnp.stack(oks, 1)
