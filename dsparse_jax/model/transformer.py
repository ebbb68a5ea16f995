"""The decoder-only transformer of every family (Gemma 2/3, Qwen2.5, Qwen3, Llama 3) in
flax.nnx; what differs between families is data (ModelConfig.arch, model/families.py).

One model serves three call modes, all through the same attention interface
(dsparse_jax.model.attention_dispatch):
  forward(tokens_BxT)                      teacher-forced logits (training, log-prob recompute)
  prefill(tokens_BxT, lengths_B, cache)    dense prompt pass that fills the KV cache
  decode(tokens_B, pos_B, cache)           one token per sequence at its own position
Sequences are right-padded and token position == index. The static AttentionSpec picks
dense or block-sparse attention and the implementation; `lora` is an optional delta tree
{layer_index: {name: {"a": A, "b": B}}} applied as x.(W + A.B * lora_scale) inside the
linear maps (names: q, k, v, o, gate, up, down).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsparse_jax.attention import cache as kv_cache
from dsparse_jax.attention.dense import softcap
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo
from dsparse_jax.model import attention_dispatch as attention
from dsparse_jax.model.config import ModelConfig

ATTN_NAMES = ("q", "k", "v", "o")  # Attention's linear maps
MLP_NAMES = ("gate", "up", "down")  # MLP's
LINEAR_NAMES = ATTN_NAMES + MLP_NAMES


def _dtype(name: str):
    return jnp.dtype(name)


def lora_weight(w, lora_ab, lora_scale: float):
    """W + A.B * lora_scale in f32 (A: in_dims + (r,), B: (r,) + out_dims)."""
    delta = jnp.tensordot(
        lora_ab["a"].astype(jnp.float32), lora_ab["b"].astype(jnp.float32), axes=1
    )
    return w.astype(jnp.float32) + delta * lora_scale


def merges_lora(compute_dtype) -> bool:
    """Whether a LoRA delta is merged into its weight: in f32 compute only."""
    return jnp.dtype(compute_dtype) == jnp.float32


def linear(x, w, n_in: int, lora_ab=None, lora_scale: float = 1.0):
    """x contracted over its last n_in dims with w's first n_in dims, plus a LoRA delta.

    In f32 the delta is merged, x.(W + A.B * s): one full-width matmul (and in training one
    weight-gradient matmul that A and B share) instead of rank-r matmuls, which run far
    below peak on CPU; same result up to float rounding. In lower precision a merged weight
    would round small deltas away, so the delta is applied as (x.A).B * s.
    """
    if lora_ab is not None and merges_lora(x.dtype):
        w = lora_weight(w, lora_ab, lora_scale)
        lora_ab = None
    y = jnp.tensordot(x, w.astype(x.dtype), axes=n_in)
    if lora_ab is not None:
        xa = jnp.tensordot(x, lora_ab["a"].astype(x.dtype), axes=n_in)
        y = y + jnp.tensordot(xa, lora_ab["b"].astype(x.dtype), axes=1) * lora_scale
    return y


def llama3_timescale(timescale_H, factor: float, low: float, high: float, original: int):
    """Llama 3.1's RoPE scaling: wavelengths above original / low are divided by factor,
    those below original / high kept, the band between interpolated smoothly (as
    transformers' _compute_llama3_parameters, on 1 / timescale)."""
    inv = 1.0 / timescale_H
    wavelen = 2 * jnp.pi * timescale_H
    scaled = jnp.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return 1.0 / jnp.where(medium, smoothed, scaled)


def apply_rope(x_BxTxNxH, pos_BxT, base: float, scale: float = 1.0, llama3=None):
    """Rotary embedding, first half / second half of head_dim (Gemma's and transformers'
    rotate_half convention). llama3: (low, high, original length) of Llama 3.1's scaling by
    `scale` (else positions are divided by `scale`)."""
    h = x_BxTxNxH.shape[-1]
    frac = 2 * jnp.arange(h // 2, dtype=jnp.float32) / h
    timescale = base**frac
    if llama3 is not None:
        timescale, scale = llama3_timescale(timescale, scale, *llama3), 1.0
    angle = (pos_BxT[..., None].astype(jnp.float32) / scale) / timescale  # [B, T, H/2]
    sin, cos = jnp.sin(angle)[:, :, None], jnp.cos(angle)[:, :, None]
    x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxH.dtype)


def layer_info(cfg: ModelConfig, index: int) -> LayerInfo:
    """What attention needs to know about layer `index` of a model."""
    return LayerInfo(
        index=index, window=cfg.layer_window(index), softcap=cfg.attn_softcap, scale=cfg.scale
    )


def sparse_layers(cfg: ModelConfig, spec: AttentionSpec) -> list[int]:
    """The layers whose decode is block-sparse under `spec`: the global layers at or past
    spec.sparse.dense_layers (sliding-window layers never are)."""
    return [i for i in range(cfg.num_layers) if spec.is_sparse_layer(layer_info(cfg, i))]


class RMSNorm(nnx.Module):
    """RMSNorm times (offset + scale): Gemma's offset 1 (scale starts at zero), the other
    families' 0 (scale starts at one)."""

    def __init__(self, dim: int, eps: float, param_dtype, offset: float = 1.0):
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - offset, param_dtype))
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def norm(cfg: ModelConfig, dim: int | None = None) -> RMSNorm:
    """An RMSNorm of cfg's family over `dim` (default d_model)."""
    return RMSNorm(dim or cfg.d_model, cfg.norm_eps, _dtype(cfg.param_dtype), cfg.arch.norm_offset)


def _init(rngs: nnx.Rngs, shape, fan_in: int, dtype):
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * fan_in**-0.5)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pd = _dtype(cfg.param_dtype)
        self.q = _init(rngs, (d, n, h), d, pd)
        self.k = _init(rngs, (d, k, h), d, pd)
        self.v = _init(rngs, (d, k, h), d, pd)
        self.o = _init(rngs, (n, h, d), n * h, pd)
        self.qkv_bias = cfg.arch.qkv_bias
        if self.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((n, h), pd))
            self.k_bias = nnx.Param(jnp.zeros((k, h), pd))
            self.v_bias = nnx.Param(jnp.zeros((k, h), pd))
        if cfg.qk_norm:
            self.q_norm = norm(cfg, h)
            self.k_norm = norm(cfg, h)
        self.qk_norm = cfg.qk_norm
        self.rope_base, self.rope_scale, self.rope_llama3 = cfg.layer_rope(index)
        self.info = layer_info(cfg, index)

    def _qkv(self, x_BxTxD, pos_BxT, lora, lora_scale):
        get = (lambda name: None) if lora is None else lora.get
        q = linear(x_BxTxD, self.q[...], 1, get("q"), lora_scale)
        k = linear(x_BxTxD, self.k[...], 1, get("k"), lora_scale)
        v = linear(x_BxTxD, self.v[...], 1, get("v"), lora_scale)
        if self.qkv_bias:
            q = q + self.q_bias[...].astype(q.dtype)
            k = k + self.k_bias[...].astype(k.dtype)
            v = v + self.v_bias[...].astype(v.dtype)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = (self.rope_base, self.rope_scale, self.rope_llama3)
        return apply_rope(q, pos_BxT, *rope), apply_rope(k, pos_BxT, *rope), v

    def draft(self, x_base_BxTxD, x_own_BxTxD, spec: AttentionSpec, pages, start_BxT, lora, scale):
        """The self-speculative drafter, teacher-forced: (the dense stream's output, the
        draft stream's). The base stream (no adapter, dense attention) makes the verifier's
        keys and values; the draft stream (+ phi) attends to them before each query's
        draft-block start and to its own from there (attend_draft)."""
        b, t, _ = x_base_BxTxD.shape
        pos_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
        qb, kb, vb = self._qkv(x_base_BxTxD, pos_BxT, None, 1.0)
        base = attention.attend_sequence(qb, kb, vb, self.info, AttentionSpec())
        q, k, v = self._qkv(x_own_BxTxD, pos_BxT, lora, scale)
        own = attention.attend_draft(q, k, v, kb, vb, start_BxT, self.info, spec, pages)
        return self._out(base, None, 1.0), self._out(own, lora, scale)

    def _out(self, o_BxTxNxH, lora, lora_scale):
        return linear(
            o_BxTxNxH, self.o[...], 2, None if lora is None else lora.get("o"), lora_scale
        )

    def __call__(
        self,
        x_BxTxD,
        mode: str,
        spec: AttentionSpec,
        *,
        cache=None,
        pos_B=None,
        lengths_B=None,
        pages=None,
        lora=None,
        lora_scale=1.0,
        tree=None,
    ):
        """Returns (out_BxTxD, new_cache, page_ids_or_None)."""
        b, t, _ = x_BxTxD.shape
        if mode == "decode":
            pos_BxT = pos_B[:, None]
        elif mode == "extend":  # t tokens per row from slot pos_B on
            slot_BxT = pos_B[:, None] + jnp.arange(t)[None]
            pos_BxT = slot_BxT if tree is None else pos_B[:, None] + tree.depth
        else:
            pos_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
        q, k, v = self._qkv(x_BxTxD, pos_BxT, lora, lora_scale)
        page_ids = None
        if mode == "decode":
            cache = kv_cache.write_decode(cache, k[:, 0], v[:, 0], pos_B, self.info, spec)
            o, page_ids = attention.attend_decode(q[:, 0], cache, pos_B, self.info, spec)
            o = o[:, None]
        elif mode == "extend":  # always dense: the speculative verifier
            cache = kv_cache.write_extend(cache, k, v, slot_BxT)
            o = attention.attend_extend(q, cache, pos_BxT, self.info, tree)
        else:
            if mode == "prefill":
                cache = kv_cache.write_prefill(cache, k, v, lengths_B, self.info, spec)
            o = attention.attend_sequence(q, k, v, self.info, spec, pages)
        return self._out(o, lora, lora_scale), cache, page_ids


ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


class MLP(nnx.Module):
    """Gated feed-forward down(act(gate(x)) * up(x)); act is the family's (GeLU-tanh or
    SiLU)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        pd = _dtype(cfg.param_dtype)
        self.gate = _init(rngs, (d, f), d, pd)
        self.up = _init(rngs, (d, f), d, pd)
        self.down = _init(rngs, (f, d), f, pd)
        self.activation = cfg.arch.activation

    def __call__(self, x, lora=None, lora_scale=1.0):
        get = (lambda name: None) if lora is None else lora.get
        gate = linear(x, self.gate[...], 1, get("gate"), lora_scale)
        up = linear(x, self.up[...], 1, get("up"), lora_scale)
        return linear(
            ACTIVATIONS[self.activation](gate) * up, self.down[...], 1, get("down"), lora_scale
        )


class Block(nnx.Module):
    """Pre-norms around attention and MLP, and post-norms on their outputs where the family
    has them (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, index: int, rngs: nnx.Rngs):
        self.pre_attn_norm = norm(cfg)
        self.attn = Attention(cfg, index, rngs)
        self.pre_mlp_norm = norm(cfg)
        self.mlp = MLP(cfg, rngs)
        self.post_norms = cfg.arch.post_norms
        if self.post_norms:
            self.post_attn_norm = norm(cfg)
            self.post_mlp_norm = norm(cfg)

    def __call__(self, x, mode, spec, lora=None, lora_scale=1.0, **kw):
        a, cache, page_ids = self.attn(
            self.pre_attn_norm(x), mode, spec, lora=lora, lora_scale=lora_scale, **kw
        )
        return self.residual(x, a, lora, lora_scale), cache, page_ids

    def residual(self, x, a, lora=None, lora_scale=1.0):
        """The block's output from its input x and attention output a."""
        if not self.post_norms:
            x = x + a
            return x + self.mlp(self.pre_mlp_norm(x), lora, lora_scale)
        x = x + self.post_attn_norm(a)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x), lora, lora_scale))

    def draft(self, x_base, x_own, spec, pages, start_BxT, lora=None, lora_scale=1.0):
        """The two streams of the self-speculative drafter (Attention.draft)."""
        a_base, a_own = self.attn.draft(
            self.pre_attn_norm(x_base),
            self.pre_attn_norm(x_own),
            spec,
            pages,
            start_BxT,
            lora,
            lora_scale,
        )
        return self.residual(x_base, a_base), self.residual(x_own, a_own, lora, lora_scale)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        pd = _dtype(cfg.param_dtype)
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), pd) * cfg.d_model**-0.5
        )
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(
                jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), pd)
                * cfg.d_model**-0.5
            )
        self.layers = nnx.List([Block(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.final_norm = norm(cfg)

    def merge_lora(self, lora, lora_scale: float) -> bool:
        """Replaces every adapted weight by W + A.B * lora_scale (f32), in place, when the
        compute dtype is f32 (where `linear` merges anyway): a decode loop then pays nothing
        per step for the adapter. Use on a transient model (e.g. inside a jitted sampler).
        Returns whether it merged; if not, pass `lora` to the calls as usual."""
        if not lora or not merges_lora(self.cfg.dtype):
            return False
        for i, maps in lora.items():
            block = self.layers[int(i)]
            for name, ab in maps.items():
                param = getattr(block.attn if name in ATTN_NAMES else block.mlp, name)
                param.set_value(lora_weight(param[...], ab, lora_scale))
        return True

    # -- pieces
    def embed_tokens(self, tokens):
        dt = _dtype(self.cfg.dtype)
        x = self.embed[...].astype(dt)[tokens]
        if not self.cfg.arch.embed_scale:
            return x
        return x * jnp.asarray(self.cfg.d_model**0.5, dt)

    def unembedding(self):
        """The output head's weight [V, D]: the embedding, or lm_head when untied."""
        return (self.embed if self.cfg.tie_embeddings else self.lm_head)[...]

    def _logits(self, x):
        x = self.final_norm(x)
        logits = jnp.einsum(
            "...d,vd->...v",
            x,
            self.unembedding().astype(x.dtype),
            preferred_element_type=jnp.float32,
        )
        return softcap(logits, self.cfg.final_softcap)

    def _run(self, x, mode, spec, caches, lora, lora_scale, pages=None, hidden_at=None, **kw):
        """(x after the last layer, caches, page ids); with hidden_at = i also x after
        layer i (a fourth output); with a tuple of layers, a tuple of them."""
        wanted = (hidden_at,) if isinstance(hidden_at, int) else hidden_at or ()
        wanted = [i % len(self.layers) for i in wanted]
        new_caches, page_ids, hidden = [], [], {}
        for i, block in enumerate(self.layers):
            layer_lora = None if lora is None else lora.get(i)
            layer_pages = None if pages is None else pages.get(i)
            cache = None if caches is None else caches[i]
            x, cache, ids = block(
                x,
                mode,
                spec,
                lora=layer_lora,
                lora_scale=lora_scale,
                cache=cache,
                pages=layer_pages,
                **kw,
            )
            new_caches.append(cache)
            page_ids.append(ids)
            if i in wanted:
                hidden[i] = x
        if isinstance(hidden_at, int):
            return x, new_caches, page_ids, hidden[wanted[0]]
        if hidden_at is not None:
            return x, new_caches, page_ids, tuple(hidden[i] for i in wanted)
        return x, new_caches, page_ids

    # -- the three modes
    def forward(
        self,
        tokens_BxT,
        spec: AttentionSpec = AttentionSpec(),
        *,
        pages=None,
        lora=None,
        lora_scale: float = 1.0,
        return_hidden: bool = False,
        hidden_at: int | tuple[int, ...] | None = None,
        draft_start=None,
    ):
        """Teacher-forced logits [B, T, V] (f32).

        pages: optional {layer: selection.PageRecord} decode record (Rollout.pages()) that makes
        the spec's sparse layers attend exactly where the sampler did. return_hidden: also
        the last layer's output [B, T, D]; hidden_at = i: also layer i's output instead (a
        tuple of layers: a tuple of outputs).
        draft_start: int32 [B, T] (Rollout.draft_start): the logits of the self-speculative
        drafter (sparse_self) instead, the function that drafted: theta + lora with `spec`
        on `pages`, reading the dense theta's keys and values before each position's draft
        block and its own from the block's start (attention/self_draft.py).
        """
        if draft_start is not None:
            x_base = x_own = self.embed_tokens(tokens_BxT)
            for i, block in enumerate(self.layers):
                x_base, x_own = block.draft(
                    x_base,
                    x_own,
                    spec,
                    None if pages is None else pages.get(i),
                    draft_start,
                    None if lora is None else lora.get(i),
                    lora_scale,
                )
            return self._logits(x_own)
        out = self._run(
            self.embed_tokens(tokens_BxT),
            "train",
            spec,
            None,
            lora,
            lora_scale,
            pages=pages,
            hidden_at=hidden_at,
        )
        x = out[0]
        if hidden_at is not None:
            return self._logits(x), out[3]
        return (self._logits(x), x) if return_hidden else self._logits(x)

    def prefill(
        self,
        tokens_BxT,
        lengths_B,
        caches,
        spec: AttentionSpec = AttentionSpec(),
        *,
        lora=None,
        lora_scale: float = 1.0,
        hidden_at: tuple[int, ...] | None = None,
    ):
        """Dense prompt pass. Returns (logits at each row's last prompt token [B, V], caches);
        with hidden_at (a tuple of layers) also their outputs at every position [B, T, D]
        (the draft head's features, model/draft_head.py)."""
        out = self._run(
            self.embed_tokens(tokens_BxT),
            "prefill",
            spec,
            caches,
            lora,
            lora_scale,
            lengths_B=lengths_B,
            hidden_at=hidden_at,
        )
        last = jnp.take_along_axis(out[0], (lengths_B - 1)[:, None, None], axis=1)[:, 0]
        return (self._logits(last), out[1]) + ((out[3],) if hidden_at is not None else ())

    def decode(
        self,
        tokens_B,
        pos_B,
        caches,
        spec: AttentionSpec = AttentionSpec(),
        *,
        lora=None,
        lora_scale: float = 1.0,
        hidden_at: int | None = None,
    ):
        """One step. Returns (logits [B, V], caches, page_ids per layer (None if dense)); with
        hidden_at = i (negative: from the end) also the residual stream after layer i [B, D]
        (the quality head's features, model/quality_head.py)."""
        out = self._run(
            self.embed_tokens(tokens_B[:, None]),
            "decode",
            spec,
            caches,
            lora,
            lora_scale,
            pos_B=pos_B,
            hidden_at=hidden_at,
        )
        logits = self._logits(out[0][:, 0])
        if hidden_at is not None:
            return logits, out[1], out[2], out[3][:, 0]
        return logits, out[1], out[2]

    def extend(
        self,
        tokens_BxT,
        start_B,
        caches,
        spec: AttentionSpec = AttentionSpec(),
        *,
        lora=None,
        lora_scale: float = 1.0,
        hidden_at: tuple[int, ...] | None = None,
        tree=None,
    ):
        """T tokens per row at positions start_B, start_B + 1, ... (a speculative verify):
        writes their keys and values into the cache (page summaries untouched: see
        kv_cache.refresh_summaries) and attends densely over it. Returns (logits [B, T, V],
        caches[, the outputs [B, T, D] of the layers in hidden_at]); T = 1 is a dense
        decode step. tree (`dense.Tree`): the T tokens are a token tree's nodes instead,
        written at slots start_B + t, each at position start_B + depth and attending to
        its ancestors only (a tree verify; `kv_cache.move_path` then puts the accepted
        path's keys and values at their positions)."""
        out = self._run(
            self.embed_tokens(tokens_BxT),
            "extend",
            spec,
            caches,
            lora,
            lora_scale,
            pos_B=start_B,
            hidden_at=hidden_at,
            tree=tree,
        )
        return (self._logits(out[0]), out[1]) + ((out[3],) if hidden_at is not None else ())

    def init_cache(self, batch: int, max_len: int, spec: AttentionSpec = AttentionSpec()):
        cfg = self.cfg
        return [
            kv_cache.init_layer_cache(
                batch,
                cfg.num_kv_heads,
                max_len,
                cfg.head_dim,
                _dtype(cfg.dtype),
                blk.attn.info,
                spec,
            )
            for blk in self.layers
        ]


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
