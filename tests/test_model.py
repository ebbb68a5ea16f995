"""The Gemma 2/3 model: a float64 numpy reference of the whole forward, decode == forward,
and the individual conventions (soft-capping, QK-norm, RMSNorm, RoPE, tied embeddings,
GQA, presets, bf16, config validation).

Speed: weights are drawn with numpy into an nnx.eval_shape skeleton (no eager init),
and every model call goes through one cached jit per (config, function), so the file
compiles a handful of small programs. Tolerances (f32 model vs f64 reference):
logits 2e-5 absolute, decode vs teacher-forced logits 1e-5 absolute.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import out_and_grads
from model_utils import random_params as _random_params

from dsparse_jax.attention import dense
from dsparse_jax.attention.spec import AttentionSpec, LayerInfo
from dsparse_jax.model import config as C
from dsparse_jax.model.transformer import RMSNorm, Transformer, apply_rope, count_params

LOGIT_TOL = 2e-5  # f32 model vs f64 numpy reference
DECODE_TOL = 1e-5  # prefill/decode logits vs teacher-forced forward logits (both f32)

# Small caps so both soft-caps really bind; a query_scale and a global RoPE scale that
# differ from the defaults; local layers with a window (6) shorter than the sequences.
BASE = C.tiny(vocab_size=40).replace(
    d_model=32,
    head_dim=8,
    mlp_dim=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    sliding_window=6,
    attn_softcap=2.0,
    final_softcap=3.0,
    query_scale=0.3,
    rope_base_local=100.0,
    rope_base_global=1000.0,
    rope_scale_global=2.0,
)


# ----------------------------------------------------------------------------- helpers


def random_params(cfg, seed=0, norm_scale=0.3):
    """Embeddings of std 2/sqrt(d) so the final soft-cap binds."""
    return _random_params(cfg, seed, embed_std=2.0, norm_scale=norm_scale)


@functools.lru_cache(maxsize=None)
def model_fns(cfg, seed=0):
    """Jitted forward / prefill / decode of one random model (one compile each)."""
    graphdef, state = random_params(cfg, seed)
    spec = AttentionSpec()

    @jax.jit
    def forward(state, tokens):
        return nnx.merge(graphdef, state).forward(tokens, spec, return_hidden=True)

    @functools.partial(jax.jit, static_argnames="max_len")
    def prefill(state, tokens, lengths, max_len):
        m = nnx.merge(graphdef, state)
        return m.prefill(tokens, lengths, m.init_cache(tokens.shape[0], max_len, spec), spec)

    @jax.jit
    def decode(state, tok, pos, caches):
        logits, caches, _ = nnx.merge(graphdef, state).decode(tok, pos, caches, spec)
        return logits, caches

    return graphdef, state, forward, prefill, decode


def np_params(state):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), nnx.to_pure_dict(state))


def np_rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + scale)


def np_rope(x_TxNxH, pos_T, base, scale):
    """Gemma split-half RoPE via complex numbers: z_i = x_i + i x_{i+H/2} rotated by
    pos / scale / base^(2i/H)."""
    h = x_TxNxH.shape[-1]
    theta = (pos_T[:, None] / scale) / base ** (2.0 * np.arange(h // 2) / h)  # [T, H/2]
    z = (x_TxNxH[..., : h // 2] + 1j * x_TxNxH[..., h // 2 :]) * np.exp(1j * theta)[:, None]
    return np.concatenate([z.real, z.imag], -1)


def np_softcap(x, cap):
    return x if cap is None else cap * np.tanh(x / cap)


def np_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def np_attention(q_TxNxH, k_TxKxH, v_TxKxH, scale, cap, window, q_pos=None):
    """Causal (+ window) GQA attention: query head n uses KV head n // (N / K)."""
    t, n, _ = q_TxNxH.shape
    kv = k_TxKxH.shape[1]
    q_pos = np.arange(t) if q_pos is None else q_pos
    k_pos = np.arange(k_TxKxH.shape[0])
    out = np.zeros(q_TxNxH.shape)
    for head in range(n):
        kh = head // (n // kv)
        s = np_softcap(q_TxNxH[:, head] @ k_TxKxH[:, kh].T * scale, cap)
        ok = k_pos[None] <= q_pos[:, None]
        if window is not None:
            ok &= q_pos[:, None] - k_pos[None] < window
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (p / p.sum(-1, keepdims=True)) @ v_TxKxH[:, kh]
    return out


def np_forward(p, cfg, tokens_T, window_override="cfg"):
    """The whole Gemma forward of one sequence in float64 (written from the formulas)."""
    eps, d = cfg.norm_eps, cfg.d_model
    x = p["embed"][tokens_T] * math.sqrt(d)
    pos = np.arange(len(tokens_T), dtype=np.float64)
    scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5
    for i in range(cfg.num_layers):
        lp = p["layers"][i]
        local = cfg.layer_pattern[i % len(cfg.layer_pattern)] == "local"
        base = cfg.rope_base_local if local else cfg.rope_base_global
        rscale = 1.0 if local else cfg.rope_scale_global
        window = cfg.sliding_window if local else None
        if window_override != "cfg":
            window = window_override
        a, at = np_rms(x, lp["pre_attn_norm"]["scale"], eps), lp["attn"]
        q = np.einsum("td,dnh->tnh", a, at["q"])
        k = np.einsum("td,dkh->tkh", a, at["k"])
        v = np.einsum("td,dkh->tkh", a, at["v"])
        if cfg.qk_norm:
            q = np_rms(q, at["q_norm"]["scale"], eps)
            k = np_rms(k, at["k_norm"]["scale"], eps)
        q, k = np_rope(q, pos, base, rscale), np_rope(k, pos, base, rscale)
        o = np_attention(q, k, v, scale, cfg.attn_softcap, window)
        x = x + np_rms(np.einsum("tnh,nhd->td", o, at["o"]), lp["post_attn_norm"]["scale"], eps)
        m, mp = np_rms(x, lp["pre_mlp_norm"]["scale"], eps), lp["mlp"]
        y = (np_gelu(m @ mp["gate"]) * (m @ mp["up"])) @ mp["down"]
        x = x + np_rms(y, lp["post_mlp_norm"]["scale"], eps)
    x = np_rms(x, p["final_norm"]["scale"], eps)
    return np_softcap(x @ p["embed"].T, cfg.final_softcap)


SEQ_SHAPE = (3, 20)  # one token shape for every f32 forward: one compile per config


def rand_tokens(seed, shape, vocab=40):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


# ----------------------------------------------------------------------------- whole model
@pytest.mark.parametrize("kv_heads", [1, 2, 4])  # GQA ratios 4, 2, 1
def test_forward_matches_numpy_reference(kv_heads):
    cfg = BASE.replace(num_kv_heads=kv_heads)
    _, state, forward, _, _ = model_fns(cfg)
    tokens = rand_tokens(kv_heads, SEQ_SHAPE)
    logits, _ = forward(state, tokens)
    assert logits.shape == SEQ_SHAPE + (40,) and logits.dtype == jnp.float32
    p = np_params(state)
    for b in range(SEQ_SHAPE[0]):
        ref = np_forward(p, cfg, np.asarray(tokens[b]))
        np.testing.assert_allclose(np.asarray(logits[b]), ref, atol=LOGIT_TOL, rtol=0)
        # The sliding window (6 < 20 tokens) matters: a window-less reference differs.
        assert np.abs(np_forward(p, cfg, np.asarray(tokens[b]), None) - ref).max() > 1e-3


def test_decode_matches_forward_ragged_batch():
    """Prefill of a right-padded ragged prompt batch (junk after each length), then one
    decode step per token at each row's own position: every logit equals the
    teacher-forced forward's, across local layers whose window (6) is < the length (20)."""
    _, state, forward, prefill, decode = model_fns(BASE)
    (b, t), buf, max_len = SEQ_SHAPE, 7, 32
    lengths = np.array([7, 2, 5])
    tokens = np.asarray(rand_tokens(1, (b, t)))
    junk = np.asarray(rand_tokens(2, (b, buf)))
    prompts = np.where(np.arange(buf)[None] < lengths[:, None], tokens[:, :buf], junk)
    assert (prompts != tokens[:, :buf]).any()  # the padding really differs from the truth
    ref, _ = forward(state, jnp.asarray(tokens))
    ref = np.asarray(ref)

    logits, caches = prefill(state, jnp.asarray(prompts), jnp.asarray(lengths), max_len)
    np.testing.assert_allclose(
        np.asarray(logits), ref[np.arange(b), lengths - 1], atol=DECODE_TOL, rtol=0
    )
    checked = 0
    for step in range(t - lengths.min()):
        pos = lengths + step
        tok = np.where(pos < t, tokens[np.arange(b), np.minimum(pos, t - 1)], 0)
        logits, caches = decode(
            state, jnp.asarray(tok, jnp.int32), jnp.asarray(pos, jnp.int32), caches
        )
        logits = np.asarray(logits)
        for r in np.flatnonzero(pos < t):
            np.testing.assert_allclose(
                logits[r],
                ref[r, pos[r]],
                atol=DECODE_TOL,
                rtol=0,
                err_msg=f"row {r} position {pos[r]}",
            )
            checked += 1
    assert checked == (t - lengths).sum()


def test_final_logit_softcap_formula():
    """logits = cap * tanh(u / cap) with u = final_norm(h) . embed^T computed here."""
    _, state, forward, _, _ = model_fns(BASE)
    logits, hidden = forward(state, rand_tokens(3, SEQ_SHAPE))
    p = np_params(state)
    u = np_rms(np.asarray(hidden, np.float64), p["final_norm"]["scale"], BASE.norm_eps)
    u = u @ p["embed"].T  # tied output embedding
    cap = BASE.final_softcap
    assert np.abs(u).max() > 1.5 * cap  # the cap binds
    assert np.abs(np.asarray(logits)).max() <= cap
    np.testing.assert_allclose(np.asarray(logits), cap * np.tanh(u / cap), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_attention_logit_softcap_and_gqa(kv):
    """dense.sequence_attention / decode_attention == numpy softcapped GQA attention."""
    rng = np.random.default_rng(kv)
    t, n, h, cap, scale = 9, 4, 8, 1.5, 1.0
    q, k, v = (rng.normal(size=(1, t, m, h)) for m in (n, kv, kv))
    layer = LayerInfo(index=0, window=None, softcap=cap, scale=scale)
    raw = np.einsum("tnh,skh->ts", q[0][:, :1], k[0][:, :1]) * scale
    assert np.abs(raw).max() > 2 * cap  # the cap binds

    @jax.jit
    def run(q, k, v):
        seq = dense.sequence_attention(q, k, v, layer)
        dec = dense.decode_attention(
            q[:, -1], k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), jnp.array([t - 1]), layer
        )
        return seq, dec

    f32 = lambda x: jnp.asarray(x, jnp.float32)
    seq, dec = run(f32(q), f32(k), f32(v))
    ref = np_attention(q[0], k[0], v[0], scale, cap, None)
    np.testing.assert_allclose(np.asarray(seq[0]), ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(dec[0]), ref[-1], atol=1e-5, rtol=0)
    uncapped = np_attention(q[0], k[0], v[0], scale, None, None)
    assert np.abs(uncapped - ref).max() > 1e-2  # a missing cap would be caught
    np.testing.assert_allclose(
        np.asarray(dense.softcap(jnp.array([-100.0, 0.3, 7.0]), 2.0)),
        2.0 * np.tanh(np.array([-100.0, 0.3, 7.0]) / 2.0),
        rtol=1e-6,
    )
    assert dense.softcap(3.0, None) == 3.0


@pytest.mark.parametrize("t,window,kv", [(17, 4, 1), (40, 8, 2), (40, 3, 4)])
def test_banded_local_attention_matches_full(t, window, kv):
    """Sliding-window layers over t >= 4 * window run in bands: same outputs as numpy and
    the same gradients as the full masked computation (f32, 1e-5)."""
    rng = np.random.default_rng(t)
    n, h = 4, 8
    q, k, v = (jnp.asarray(rng.normal(size=(2, t, m, h)), jnp.float32) for m in (n, kv, kv))
    layer = LayerInfo(index=0, window=window, softcap=2.0, scale=0.5)
    out, g_band = out_and_grads(functools.partial(dense.sequence_attention, layer=layer), q, k, v)
    for row in range(2):
        ref = np_attention(*(np.asarray(x[row], np.float64) for x in (q, k, v)), 0.5, 2.0, window)
        np.testing.assert_allclose(np.asarray(out[row]), ref, atol=1e-5, rtol=0)
    _, g_full = out_and_grads(functools.partial(dense._full_attention, layer=layer), q, k, v)
    for a, b in zip(g_band, g_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("t,window", [(300, None), (260, 100)])
def test_causal_block_attention_matches_full(t, window):
    """Sequences of >= 2 causal blocks skip the blocks above the diagonal: same outputs
    and gradients as the full masked computation (f32, 1e-5), also with a window too long
    for bands (each block then starts at its first visible key)."""
    assert t >= 2 * dense.CAUSAL_BLOCK and (window is None or t < 4 * window)
    rng = np.random.default_rng(t)
    q, k, v = (jnp.asarray(rng.normal(size=(1, t, m, 8)), jnp.float32) for m in (4, 2, 2))
    layer = LayerInfo(index=0, window=window, softcap=2.0, scale=0.5)
    out, g_block = out_and_grads(functools.partial(dense.sequence_attention, layer=layer), q, k, v)
    full, g_full = out_and_grads(functools.partial(dense._full_attention, layer=layer), q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full), atol=1e-5, rtol=0)
    for a, b in zip(g_block, g_full):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- pieces
def test_rmsnorm_one_plus_scale():
    norm = RMSNorm(8, 1e-6, jnp.float32)
    assert np.all(np.asarray(norm.scale[...]) == 0.0)  # starts at zero: identity gain
    x = np.random.default_rng(0).normal(size=(3, 8)) * 5
    np.testing.assert_allclose(
        np.asarray(norm(jnp.asarray(x, jnp.float32))),
        x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6),
        rtol=1e-5,
    )
    scale = np.linspace(-0.5, 0.7, 8)
    norm.scale[...] = jnp.asarray(scale, jnp.float32)
    np.testing.assert_allclose(
        np.asarray(norm(jnp.asarray(x, jnp.float32))), np_rms(x, scale, 1e-6), rtol=1e-5
    )


def test_qk_norm_formula():
    """q = RoPE(RMSNorm_headdim(x W_q) * (1 + q_scale)), same for k, before RoPE."""
    graphdef, state, _, _, _ = model_fns(BASE)
    model = nnx.merge(graphdef, state)
    attn, p = model.layers[1].attn, np_params(state)["layers"][1]["attn"]
    assert attn.qk_norm and np.abs(p["q_norm"]["scale"]).max() > 0.1
    x = np.random.default_rng(0).normal(size=(1, 5, 32))
    pos = np.array([[0, 1, 2, 7, 30]])
    q, k, v = jax.jit(lambda x, pos: attn._qkv(x, pos, None, 1.0))(
        jnp.asarray(x, jnp.float32), jnp.asarray(pos)
    )
    qn = np_rms(np.einsum("td,dnh->tnh", x[0], p["q"]), p["q_norm"]["scale"], 1e-6)
    kn = np_rms(np.einsum("td,dkh->tkh", x[0], p["k"]), p["k_norm"]["scale"], 1e-6)
    # Layer 1 is global: base 1000, position scale 2.
    np.testing.assert_allclose(np.asarray(q[0]), np_rope(qn, pos[0], 1000.0, 2.0), atol=2e-5)
    np.testing.assert_allclose(np.asarray(k[0]), np_rope(kn, pos[0], 1000.0, 2.0), atol=2e-5)
    np.testing.assert_allclose(np.asarray(q[0, 0]), qn[0], atol=2e-5)  # RoPE(0) = identity
    np.testing.assert_allclose(
        np.asarray(v[0]), np.einsum("td,dkh->tkh", x[0], p["v"]), atol=2e-5
    )  # v is not normalised


def test_rope_gemma_split_half_and_relative_position():
    rng = np.random.default_rng(0)
    h = 8
    x = rng.normal(size=(1, 6, 2, h))
    pos = np.array([[0, 1, 5, 17, 100, 1234]])
    out = np.asarray(
        jax.jit(functools.partial(apply_rope, base=10_000.0, scale=4.0))(
            jnp.asarray(x, jnp.float32), jnp.asarray(pos)
        )
    )
    np.testing.assert_allclose(out[0], np_rope(x[0], pos[0], 10_000.0, 4.0), atol=1e-4)
    # Explicit split-half pairing for one element: (x_0, x_{h/2}) rotated by pos * 1 / scale.
    a = pos[0, 2] / 4.0
    np.testing.assert_allclose(
        out[0, 2, 0, [0, h // 2]],
        [
            x[0, 2, 0, 0] * np.cos(a) - x[0, 2, 0, h // 2] * np.sin(a),
            x[0, 2, 0, h // 2] * np.cos(a) + x[0, 2, 0, 0] * np.sin(a),
        ],
        atol=1e-5,
    )
    np.testing.assert_allclose(
        np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5
    )  # a rotation
    # Relative position: q(m) . k(n) depends only on m - n.
    q, k = rng.normal(size=h), rng.normal(size=h)
    pairs = np.array([[3, 0], [10, 7], [503, 500], [0, 3], [7, 10], [500, 503]])
    # q rotated at m, k rotated at n
    rq = np.asarray(
        apply_rope(
            jnp.asarray(np.broadcast_to(q, (1, 6, 1, h)), jnp.float32),
            jnp.asarray(pairs[None, :, 0]),
            10_000.0,
        )
    )[0, :, 0]
    rk = np.asarray(
        apply_rope(
            jnp.asarray(np.broadcast_to(k, (1, 6, 1, h)), jnp.float32),
            jnp.asarray(pairs[None, :, 1]),
            10_000.0,
        )
    )[0, :, 0]
    dots = (rq * rk).sum(-1)
    np.testing.assert_allclose(dots[:3], dots[0], atol=1e-4)  # offset +3
    np.testing.assert_allclose(dots[3:], dots[3], atol=1e-4)  # offset -3
    assert abs(dots[0] - dots[3]) > 1e-3 and abs(dots[0] - q @ k) > 1e-3


def test_embedding_scaled_and_tied():
    graphdef, state, _, _, _ = model_fns(BASE)
    model = nnx.merge(graphdef, state)
    tokens = jnp.array([[0, 5, 39, 5]])
    emb = np.asarray(model.embed[...])
    np.testing.assert_allclose(
        np.asarray(model.embed_tokens(tokens))[0],
        emb[[0, 5, 39, 5]] * math.sqrt(BASE.d_model),
        rtol=1e-6,
    )
    # Tied: the embedding is the only vocab-sized parameter (no separate output head).
    shapes = [x.shape for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert [s for s in shapes if BASE.vocab_size in s] == [(40, 32)]
    # The output matrix is the embedding: logits (no final cap) = final_norm(h) . E^T.
    nocap = BASE.replace(final_softcap=None)
    h = np.random.default_rng(0).normal(size=(1, 3, 32))
    m2 = nnx.merge(random_params(nocap)[0], state)
    np.testing.assert_allclose(
        np.asarray(m2._logits(jnp.asarray(h, jnp.float32))),
        np_rms(h, np_params(state)["final_norm"]["scale"], 1e-6) @ emb.T.astype(np.float64),
        atol=1e-5,
    )


# ----------------------------------------------------------------------------- configs
def n_params(cfg):
    d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    per_layer = d * n * h * 2 + d * k * h * 2 + 3 * d * f + 4 * d + (2 * h if cfg.qk_norm else 0)
    return cfg.vocab_size * d + cfg.num_layers * per_layer + d


@pytest.mark.parametrize(
    "name,published,lo,hi",
    [
        ("gemma2_2b", 2_614_341_888, 2.5e9, 2.7e9),
        ("gemma3_1b", 999_885_952, 0.95e9, 1.05e9),
        ("gemma3_4b", None, 3.8e9, 4.0e9),  # 3.88e9 text-only (4.3e9 with the vision tower)
        ("tiny", None, 1e6, 5e6),
    ],
)
def test_presets_build_with_plausible_sizes(name, published, lo, hi):
    cfg = C.preset(name)
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))  # shapes only
    count = count_params(model)
    assert count == n_params(cfg)
    assert lo < count < hi
    if published is not None:
        assert count == published  # the released checkpoints' parameter counts
    assert model.embed.shape == (cfg.vocab_size, cfg.d_model)
    assert len(model.layers) == cfg.num_layers
    a = model.layers[0].attn
    assert a.q.shape == (cfg.d_model, cfg.num_heads, cfg.head_dim)
    assert a.k.shape == (cfg.d_model, cfg.num_kv_heads, cfg.head_dim)
    assert a.o.shape == (cfg.num_heads, cfg.head_dim, cfg.d_model)
    assert hasattr(a, "q_norm") == cfg.qk_norm


def test_preset_layer_patterns():
    g2, g3, g34 = C.gemma2_2b(), C.gemma3_1b(), C.gemma3_4b()
    assert [g2.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert [g3.layer_kind(i) for i in range(12)] == (["local"] * 5 + ["global"]) * 2
    assert g3.layer_rope(5) == (1_000_000.0, 1.0, None) and g3.layer_rope(0) == (
        10_000.0,
        1.0,
        None,
    )
    assert g34.layer_rope(5) == (1_000_000.0, 8.0, None)
    assert g34.layer_rope(4) == (10_000.0, 1.0, None)
    assert (g2.attn_softcap, g2.final_softcap) == (50.0, 30.0)
    assert g3.attn_softcap is None and g3.final_softcap is None and g3.qk_norm
    assert C.preset("gemma3_1b", vocab_size=99).vocab_size == 99
    with pytest.raises(ValueError, match="unknown model preset"):
        C.preset("gemma9")


def test_bf16_runs_and_is_close_to_f32():
    """bf16 params and compute: finite, f32 logits, within bf16 error of the float64
    reference of the same (bf16-rounded) weights; and really computed in bf16."""
    cfg16 = BASE.replace(param_dtype="bfloat16", dtype="bfloat16", num_layers=2)
    graphdef16, state16 = random_params(cfg16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state16))
    tokens = rand_tokens(4, (2, 12))
    logits16, hidden16 = jax.jit(
        lambda s, t: nnx.merge(graphdef16, s).forward(t, return_hidden=True)
    )(state16, tokens)
    assert logits16.dtype == jnp.float32 and hidden16.dtype == jnp.bfloat16
    lp16 = np.asarray(jax.nn.log_softmax(logits16, -1), np.float64)
    assert np.all(np.isfinite(lp16))
    p = np_params(state16)  # the bf16 weights, exactly, in float64
    lp64 = np.stack([np_forward(p, cfg16, np.asarray(tokens[b])) for b in range(2)])
    lp64 = lp64 - np.log(np.exp(lp64).sum(-1, keepdims=True))
    err = np.abs(lp16 - lp64)
    assert err.max() < 0.15 and err.mean() < 0.03, (err.max(), err.mean())
    assert err.max() > 1e-4  # it really ran in bf16 (f32 would be ~1e-6)


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(d_model=0), "d_model must be positive"),
        (dict(num_layers=-1), "num_layers must be positive"),
        (dict(vocab_size=0), "vocab_size must be positive"),
        (dict(num_heads=4, num_kv_heads=3), "multiple of"),
        (dict(layer_pattern=()), "layer_pattern"),
        (dict(layer_pattern=("global", "sliding")), "layer_pattern"),
        (dict(sliding_window=None), "sliding_window is required"),
        (dict(dtype="float16"), "dtype"),
        (dict(param_dtype="int8"), "param_dtype"),
    ],
)
def test_config_validation(override, match):
    with pytest.raises(ValueError, match=match):
        BASE.replace(**override)


def test_config_helpers():
    assert BASE.group_size == 2 and BASE.scale == 0.3
    assert BASE.replace(query_scale=None).scale == 8**-0.5
    assert BASE.replace(layer_pattern=("global",), sliding_window=None).layer_window(3) is None
    assert [BASE.layer_kind(i) for i in range(4)] == ["local", "global"] * 2


def test_sparse_layers_are_global_layers_past_dense_layers():
    """The sparse-layer listing (sampler records, experiment reports): sliding-window
    layers are never sparse."""
    from dsparse_jax.attention.spec import SparseSpec
    from dsparse_jax.model.transformer import sparse_layers

    spec = AttentionSpec(sparse=SparseSpec(dense_layers=2))
    assert sparse_layers(C.tiny().replace(num_layers=4), spec) == [3]  # local, global, ...
    assert sparse_layers(C.preset("mini"), spec) == [2, 3, 4, 5]
    assert sparse_layers(C.preset("mini"), AttentionSpec()) == []
    mini = C.preset("mini")
    assert mini.num_kv_heads >= 2 and mini.group_size >= 2 and mini.num_layers >= 6
    assert set(mini.layer_pattern) == {"global"}


def test_family_settings_are_checked():
    """A family fixes its conventions: a contradicting ModelConfig is a one-line error."""
    from dsparse_jax.model.config import ModelConfig

    base = dict(
        vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32
    )
    assert ModelConfig(**base).arch.name == "gemma2"  # the presets: Gemma 2 without qk_norm
    assert ModelConfig(**base, qk_norm=True).arch.name == "gemma3"
    assert ModelConfig(**base, family="qwen3", qk_norm=True).arch.activation == "silu"
    for bad, match in (
        (dict(family="qwen3"), "qk_norm must be True"),
        (dict(family="llama", final_softcap=30.0), "has none"),
        (dict(family="qwen2", layer_pattern=("local",), sliding_window=4), "sliding-window"),
        (dict(family="qwen2", rope_type="llama3"), "rope_type"),
        (dict(family="mistral"), "family 'mistral'"),
    ):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**base, **bad)
