"""Online training of the learned draft head (model/draft_head.py; docs/speculative.md).

Loss: the soft cross-entropy of the head's draft distribution against the detached dense
policy's, -sum_v p(v | x_<=t) log q(v | g_t, x_t), at every position t whose next token
is a completion token (teacher-forced: the true policy features at every t), times
`loss_weight`. Both distributions at the rollout temperature. The RL step runs it after
the theta update, on the step's kept rollouts, so the head tracks the policy that will
verify its next drafts. Its own Adam and its own gradient-norm clip group: its gradients
never share a global norm with theta's. Metrics: the loss, KL(p || q) (the loss minus
the policy's entropy: 0 for a perfect drafter) and the top-1 agreement (the greedy
acceptance rate of a first draft) before and after the update, and the gradient norm.

With `unroll` = k >= 2 (rl.draft_head.unroll; EAGLE-3's training-time test) the head also
trains on its own k-step unroll, what it drafts from: draft steps 2..k of a block starting
at every completion position feed it its own output as the feature
(`draft_head.unrolled_logits`), each step's soft cross-entropy against the policy at the
position it predicts. The loss is the mean over the k steps; `loss`, `kl`, `top1_agree`
stay the first step's, and `kl_<j>`, `top1_agree_<j>` report step j = 2..k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dsparse_jax.model import draft_head
from dsparse_jax.parallel import sharding


def make_tx(learning_rate: float, max_grad_norm: float):
    """The head's optimizer, with its own clip group."""
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate))


def loss_mask(completion_mask_BxT):
    """1 at positions t whose next token t + 1 is a completion token (what a draft at t
    predicts)."""
    return jnp.pad(completion_mask_BxT[:, 1:], ((0, 0), (0, 1)))


def unroll_masks(completion_mask_BxT, steps: int):
    """[max(steps, 1), B, T]: the positions draft step j (0-based) of the unroll is trained
    at. Step 0: `loss_mask`. Step j > 0 at t: also a completion token at the block start
    t - j (the drafter starts a block only at a generated token)."""
    mask_BxT = loss_mask(completion_mask_BxT)
    out = [mask_BxT]
    for j in range(1, steps):
        start_BxT = jnp.pad(completion_mask_BxT, ((0, 0), (j, 0)))[:, : mask_BxT.shape[1]]
        out.append(mask_BxT * start_BxT)
    return jnp.stack(out)


def _policy_targets(params, tokens_BxT, graphdef, layers, temperature):
    """The dense policy's features at `layers`, its token embeddings and its log-probs at
    the rollout temperature (no gradient)."""
    model = nnx.merge(graphdef, params)
    logits, hiddens = model.forward(tokens_BxT, hidden_at=layers)
    emb = model.embed_tokens(tokens_BxT)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    out = (hiddens, emb, logp, model.unembedding())
    return jax.tree.map(jax.lax.stop_gradient, out)


def _loss(head_state, head_graphdef, targets, masks_SxBxT, temperature, loss_weight):
    """The mean over the unroll's steps of each step's soft cross-entropy (one step:
    teacher-forced only, today's loss)."""
    hiddens, emb, p_logp, embed = targets
    head = nnx.merge(head_graphdef, head_state)
    steps = masks_SxBxT.shape[0]
    if steps == 1:
        logits = draft_head.teacher_forced_logits(head, hiddens, emb, embed)[None]
    else:
        logits = draft_head.unrolled_logits(head, hiddens, emb, embed, steps)
    q_logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    p = jnp.exp(p_logp)
    ce = -jnp.sum(p * q_logp, axis=-1)  # [S, B, T]
    ent = -jnp.sum(p * p_logp, axis=-1)
    agree = (jnp.argmax(q_logp, -1) == jnp.argmax(p_logp, -1)).astype(jnp.float32)
    den_S = jnp.maximum(masks_SxBxT.sum((1, 2)), 1.0)
    mean = lambda x: jnp.sum(x * masks_SxBxT, (1, 2)) / den_S
    ce_S, kl_S, agree_S = mean(ce), mean(ce - ent), mean(agree)
    metrics = {"loss": ce_S[0], "kl": kl_S[0], "top1_agree": agree_S[0]}
    for j in range(1, steps):
        metrics[f"kl_{j + 1}"], metrics[f"top1_agree_{j + 1}"] = kl_S[j], agree_S[j]
    return loss_weight * jnp.mean(ce_S), metrics


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "head_graphdef", "layers", "tx", "steps", "temperature", "unroll"),
    donate_argnums=(0, 1),
)
def draft_head_update(
    head_state,
    opt_state,
    batch,
    params,
    *,
    graphdef,
    head_graphdef,
    layers: tuple[int, ...],
    tx,
    steps: int = 1,
    temperature: float = 1.0,
    loss_weight: float = 1.0,
    unroll: int = 0,
):
    """`steps` Adam steps of the head on one batch {"tokens" [B, T], "mask" [B, T] (the
    completion mask)} against the policy `params` (frozen); `unroll` >= 2: also on draft
    steps 2..unroll of its own unroll. Returns (head_state, opt_state, metrics: loss / kl
    / top1_agree (and kl_<j> / top1_agree_<j>) before and after, grad_norm of the first
    step)."""
    targets = _policy_targets(params, batch["tokens"], graphdef, layers, temperature)
    mask = unroll_masks(batch["mask"], unroll)
    grad_fn = jax.value_and_grad(_loss, has_aux=True)

    def one(carry, _):
        state, opt = carry
        (_, m), g = grad_fn(state, head_graphdef, targets, mask, temperature, loss_weight)
        updates, opt = tx.update(g, opt, state)
        return (optax.apply_updates(state, updates), opt), (m, optax.tree.norm(g))

    (head_state, opt_state), (ms, norms) = jax.lax.scan(
        one, (head_state, opt_state), None, length=steps
    )
    _, after = _loss(head_state, head_graphdef, targets, mask, temperature, loss_weight)
    metrics = {k: v[0] for k, v in ms.items()}
    metrics.update({f"{k}_after": v for k, v in after.items()})
    metrics["grad_norm"] = norms[0]
    return sharding.constrain_update((head_state, opt_state, metrics))
