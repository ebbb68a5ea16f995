"""The learned draft head (EAGLE-3 / MTP style; NeMo-RL's online-trained drafter): one
decoder block that predicts the policy's next token from the policy's own features.

At position t its input is the pair (g_t, x_t):
  g_t  a feature of the prefix up to t - 1: the policy's residual stream after an early, a
       middle and the last layer at position t - 1 (each RMS-normalised, concatenated and
       projected to d_model: `fuse`) when that position was verified by the policy; the
       head's own output h_{t-1} when t - 1 is a draft of this round (no policy feature
       exists yet);
  x_t  the token at t, through the policy's embedding (shared, frozen).
The block (Gemma pre/post-norm attention + MLP, global attention with its own KV cache)
maps proj([g_t, emb(x_t)]) to h_t, and the policy's unembedding of final_norm(h_t) gives
the draft distribution of x_{t+1}. Run autoregressively it drafts k tokens.

An nnx module with its own parameters: sampling/speculative.py merges it inside the
jitted sampler from (graphdef, state); train/draft_head.py trains it (its own optimizer
and clip group). Its linear maps carry the policy's names (q, k, v, o, gate, up, down), so
the mesh's partition rules shard it like a policy layer.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention.dense import MASK_VALUE, softcap
from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.model import transformer
from dsparse_jax.model.config import ModelConfig


def default_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high features: after layer 1, num_layers // 2 and the last."""
    return (min(1, num_layers - 1), num_layers // 2, num_layers - 1)


def parse_layers(text: str, num_layers: int) -> tuple[int, ...]:
    """rl.draft_head.layers ("" -> default_layers; "1,3,5"; negative counts from the end)."""
    if not str(text).strip():
        return default_layers(num_layers)
    try:
        raw = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ValueError(f"must be a comma list of integers, got {text!r}") from None
    if any(not -num_layers <= x < num_layers for x in raw):
        raise ValueError(f"layers must be in [-{num_layers}, {num_layers - 1}], got {text!r}")
    return tuple(x % num_layers for x in raw)


# Its attention: dense, XLA, over a cache of any length (page_size 1: no page structure).
HEAD_SPEC = AttentionSpec(page_size=1)


@dataclasses.dataclass(frozen=True)
class DraftHeadConfig:
    layers: tuple[int, ...]  # the policy layers whose outputs form the feature g


class DraftHead(nnx.Module):
    def __init__(self, cfg: ModelConfig, head_cfg: DraftHeadConfig, rngs: nnx.Rngs):
        d, n = cfg.d_model, len(head_cfg.layers)
        pd = jnp.dtype(cfg.param_dtype)
        self.cfg, self.layers = cfg, head_cfg.layers
        self.feat_norms = nnx.List(
            [transformer.RMSNorm(d, cfg.norm_eps, pd) for _ in head_cfg.layers]
        )
        self.fuse = transformer._init(rngs, (n, d, d), n * d, pd)
        self.emb_norm = transformer.RMSNorm(d, cfg.norm_eps, pd)
        self.in_norm = transformer.RMSNorm(d, cfg.norm_eps, pd)
        self.proj = transformer._init(rngs, (2, d, d), 2 * d, pd)
        # One global-attention block (the policy's shapes; no sliding window).
        self.block = transformer.Block(dataclasses.replace(cfg, layer_pattern=("global",)), 0, rngs)
        self.final_norm = transformer.RMSNorm(d, cfg.norm_eps, pd)

    def feature(self, hiddens):
        """g from the policy's outputs at `self.layers` (a tuple of [..., D])."""
        x = jnp.stack([norm(h) for norm, h in zip(self.feat_norms, hiddens)], axis=-2)
        return jnp.einsum("...nd,nde->...e", x, self.fuse[...].astype(x.dtype))

    def _input(self, g_BxTxD, emb_BxTxD):
        """The block's input proj([g, emb(x)]) [B, T, D]."""
        x = jnp.stack([self.in_norm(g_BxTxD), self.emb_norm(emb_BxTxD)], axis=-2)
        return jnp.einsum("...nd,nde->...e", x, self.proj[...].astype(x.dtype))

    def __call__(self, g_BxTxD, emb_BxTxD, mode: str, **kw):
        """h [B, T, D] and the head's cache; mode and kw as `Block` (train | prefill |
        decode | extend, cache, pos_B, lengths_B). Dense attention."""
        h, cache, _ = self.block(self._input(g_BxTxD, emb_BxTxD), mode, HEAD_SPEC, **kw)
        return h, cache

    def unrolled_pass(self, g_BxTxD, emb_BxTxD, ks: list, vs: list):
        """Pass j = len(ks) of the unrolled training (`unrolled_logits`): `Block.__call__`
        with `_unrolled_attention` over the K/V of passes 0..j. Returns (h [B, T, D], ks
        and vs with this pass's K/V [B, T, K, H] appended)."""
        block, attn = self.block, self.block.attn
        x = self._input(g_BxTxD, emb_BxTxD)
        b, t, _ = x.shape
        q, k, v = attn._qkv(
            block.pre_attn_norm(x), jnp.broadcast_to(jnp.arange(t), (b, t)), None, 1.0
        )
        ks, vs = ks + [k], vs + [v]
        a = attn._out(_unrolled_attention(q, ks, vs, attn.info), None, 1.0)
        return block.residual(x, a), ks, vs

    def logits(self, h, embed_VxD):
        """The draft distribution's logits [..., V] (f32) through the policy's unembedding."""
        x = self.final_norm(h)
        out = jnp.einsum(
            "...d,vd->...v", x, embed_VxD.astype(x.dtype), preferred_element_type=jnp.float32
        )
        return softcap(out, self.cfg.final_softcap)

    def init_cache(self, batch: int, max_len: int):
        cfg = self.cfg
        return kv_cache.init_layer_cache(
            batch,
            cfg.num_kv_heads,
            max_len,
            cfg.head_dim,
            jnp.dtype(cfg.dtype),
            self.block.attn.info,
            HEAD_SPEC,
        )


def create(cfg: ModelConfig, head_cfg: DraftHeadConfig, key):
    """(graphdef, state) of a freshly initialised head."""
    return nnx.split(DraftHead(cfg, head_cfg, nnx.Rngs(params=key)))


def shifted_features(g_BxTxD):
    """The head's g input at every position t from features indexed by their own position
    (g_{t} is the feature of t - 1): shift right by one, zero at t = 0."""
    return jnp.pad(g_BxTxD, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def teacher_forced_logits(head: DraftHead, hiddens, tokens_emb_BxTxD, embed_VxD):
    """The head's draft logits [B, T, V] at every position, from the policy's outputs at
    `head.layers` over a whole sequence (training: the true feature at every t)."""
    g = shifted_features(head.feature(hiddens))
    h, _ = head(g, tokens_emb_BxTxD, "train")
    return head.logits(h, embed_VxD)


def _shift(x_BxTx, n: int):
    """x delayed by n positions along axis 1 (entry t holds x[t - n]; zeros before 0)."""
    pad = [(0, 0), (n, 0)] + [(0, 0)] * (x_BxTx.ndim - 2)
    return jnp.pad(x_BxTx, pad)[:, : x_BxTx.shape[1]]


def _unrolled_attention(q_BxTxNxH, ks, vs, info):
    """Attention of unroll pass j = len(ks) - 1. Its query at t is draft step j of the
    block that starts at c = t - j, and sees what the head's cache holds at that draft
    step: pass 0's entries (the true features) at positions <= c, and pass i's entry at
    c + i for i = 1..j (the head's own outputs of this block; i = j is its own entry).
    ks / vs: per pass, [B, T, K, H]."""
    if info.window is not None:
        raise ValueError("the draft head's attention is global")
    j = len(ks) - 1
    b, t, n, h = q_BxTxNxH.shape
    kv = ks[0].shape[2]
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kv, n // kv, h) * info.scale
    pos = jnp.arange(t)
    logits = jnp.einsum("btkgh,bskh->btkgs", q_BxTxKxGxH, ks[0], preferred_element_type=jnp.float32)
    ok_TxS = pos[None, :] <= pos[:, None] - j
    if j:  # pass i's entry at c + i = t - (j - i): pass i's K/V delayed by j - i
        k_BxTxJxKxH = jnp.stack([_shift(ks[i], j - i) for i in range(1, j + 1)], axis=2)
        v_BxTxJxKxH = jnp.stack([_shift(vs[i], j - i) for i in range(1, j + 1)], axis=2)
        own = jnp.einsum(
            "btkgh,btikh->btkgi", q_BxTxKxGxH, k_BxTxJxKxH, preferred_element_type=jnp.float32
        )
        logits = jnp.concatenate([logits, own], axis=-1)
        ok_TxJ = pos[:, None] - (j - jnp.arange(1, j + 1))[None, :] >= 0
        ok_TxS = jnp.concatenate([ok_TxS, ok_TxJ], axis=1)
    logits = softcap(logits, info.softcap)
    logits = jnp.where(ok_TxS[None, :, None, None], logits.astype(jnp.float32), MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(vs[0].dtype)
    out = jnp.einsum("btkgs,bskh->btkgh", probs[..., :t], vs[0])
    if j:
        out = out + jnp.einsum("btkgi,btikh->btkgh", probs[..., t:], v_BxTxJxKxH)
    return out.reshape(b, t, n, h)


def unrolled_logits(head: DraftHead, hiddens, tokens_emb_BxTxD, embed_VxD, steps: int):
    """EAGLE-3's training-time test: the head's logits at draft steps 0..steps-1 of a
    draft block starting at every position, [steps, B, T, V]. Entry [j, :, t] is draft
    step j of the block starting at c = t - j, exactly as the drafter computes it
    (sampling/speculative.py `_draft_head`, with the true tokens as the drafts): step 0
    takes the policy's feature of c - 1 and x_c, step j > 0 the head's own output of step
    j - 1 (at t - 1) and x_t, attending to the true entries at <= c and its own entries
    of steps 1..j. One pass per step over the whole sequence (pass j reads pass j - 1's
    outputs); step 0 equals `teacher_forced_logits` up to float rounding."""
    g = shifted_features(head.feature(hiddens))
    ks, vs, out = [], [], []
    for _ in range(steps):
        h, ks, vs = head.unrolled_pass(g, tokens_emb_BxTxD, ks, vs)
        out.append(head.logits(h, embed_VxD))
        g = shifted_features(h)  # the next step at t reads this step's output at t - 1
    return jnp.stack(out)


# ------------------------------------------------------------------------------- export
EXPORT_WEIGHTS = "draft_head.safetensors"
EXPORT_CONFIG = "draft_head.json"


def _leaf_name(path) -> str:
    """block.attn.q for the state path of that parameter (nnx's .value dropped)."""
    keys = [k.key if hasattr(k, "key") else getattr(k, "idx", None) for k in path]
    return ".".join(str(k) for k in keys if k is not None and k != "")


def export(out_dir: str, state, layers: tuple[int, ...], dtype: str = "float32") -> list[str]:
    """Writes the head as safetensors in this project's layout (one tensor per parameter,
    named by its path, e.g. block.attn.q [D, N, H]) plus draft_head.json (the policy
    layers it reads). `load_exported` reads it back. Returns the files written."""
    import safetensors.numpy  # pylint: disable=import-outside-toplevel

    tensors = {
        _leaf_name(p): np.ascontiguousarray(np.asarray(jax.device_get(x), np.float32), dtype)
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    }
    os.makedirs(out_dir, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(out_dir, EXPORT_WEIGHTS))
    with open(os.path.join(out_dir, EXPORT_CONFIG), "w") as f:
        json.dump({"layers": list(layers), "format": "dsparse_jax draft head v1"}, f, indent=2)
    return [EXPORT_WEIGHTS, EXPORT_CONFIG]


def load_exported(out_dir: str, cfg: ModelConfig):
    """(graphdef, state) of a head written by `export`, for the policy shapes `cfg`."""
    import safetensors.numpy  # pylint: disable=import-outside-toplevel

    with open(os.path.join(out_dir, EXPORT_CONFIG)) as f:
        layers = tuple(json.load(f)["layers"])
    graphdef, template = create(cfg, DraftHeadConfig(layers), jax.random.key(0))
    tensors = safetensors.numpy.load_file(os.path.join(out_dir, EXPORT_WEIGHTS))
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(tensors[_leaf_name(p)], x.dtype), template
    )
    return graphdef, state
