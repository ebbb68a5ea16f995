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


def _policy_targets(params, tokens_BxT, graphdef, layers, temperature):
    """The dense policy's features at `layers`, its token embeddings and its log-probs at
    the rollout temperature (no gradient)."""
    model = nnx.merge(graphdef, params)
    logits, hiddens = model.forward(tokens_BxT, hidden_at=layers)
    emb = model.embed_tokens(tokens_BxT)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    out = (hiddens, emb, logp, model.embed[...])
    return jax.tree.map(jax.lax.stop_gradient, out)


def _loss(head_state, head_graphdef, targets, mask_BxT, temperature, loss_weight):
    hiddens, emb, p_logp, embed = targets
    head = nnx.merge(head_graphdef, head_state)
    q_logp = jax.nn.log_softmax(
        draft_head.teacher_forced_logits(head, hiddens, emb, embed) / temperature, axis=-1
    )
    p = jnp.exp(p_logp)
    ce = -jnp.sum(p * q_logp, axis=-1)
    ent = -jnp.sum(p * p_logp, axis=-1)
    agree = (jnp.argmax(q_logp, -1) == jnp.argmax(p_logp, -1)).astype(jnp.float32)
    den = jnp.maximum(mask_BxT.sum(), 1.0)
    mean = lambda x: jnp.sum(x * mask_BxT) / den
    metrics = {"loss": mean(ce), "kl": mean(ce - ent), "top1_agree": mean(agree)}
    return loss_weight * metrics["loss"], metrics


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "head_graphdef", "layers", "tx", "steps", "temperature"),
    donate_argnums=(0, 1),
)
def head_update(
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
):
    """`steps` Adam steps of the head on one batch {"tokens" [B, T], "mask" [B, T] (the
    completion mask)} against the policy `params` (frozen). Returns (head_state,
    opt_state, metrics: loss / kl / top1_agree before and after, grad_norm of the first
    step)."""
    targets = _policy_targets(params, batch["tokens"], graphdef, layers, temperature)
    mask = loss_mask(batch["mask"])
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
