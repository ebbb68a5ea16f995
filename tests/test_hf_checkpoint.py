"""Hugging Face import and export of every family (Gemma 2/3, Qwen2.5, Qwen3, Llama 3)
against transformers' own forward.

Needs torch + transformers (requirements-hf.txt); skipped with the reason otherwise.
Tiny random models are built with transformers on CPU, saved with save_pretrained,
imported with dsparse_jax.model.hf_checkpoint and compared position by position in f32:
max |logit difference| <= LOGIT_ATOL (logits are O(1..10) here).
"""

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed: pip install -r requirements-hf.txt"
)
transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: pip install -r requirements-hf.txt"
)
pytest.importorskip("safetensors", reason="safetensors not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from dsparse_jax.model import hf_checkpoint as hfc  # noqa: E402
from dsparse_jax.model.lora import LoRAConfig, init_lora  # noqa: E402

LOGIT_ATOL = 1e-4
SEQ = 24  # > sliding_window, so local layers really are windowed


def _randomize(model, seed):
    """Every parameter random (HF inits norms to zero, which would hide norm mapping bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _gemma3(tmp_path):
    cfg = transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=5,
        query_pre_attn_scalar=24,
        rope_theta=1000.0,
        rope_local_base_freq=50.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    return model


def _gemma2(tmp_path):
    cfg = transformers.Gemma2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=6,
        query_pre_attn_scalar=20,
        rope_theta=500.0,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
        max_position_embeddings=128,
        attn_implementation="eager",
    )
    return transformers.Gemma2ForCausalLM(cfg).eval()


_DECODER = dict(  # the shapes the Qwen / Llama builders share
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    attn_implementation="eager",
)


def _qwen2(tmp_path):
    """Qwen2.5: q/k/v biases, an untied output head (the config's default)."""
    cfg = transformers.Qwen2Config(**_DECODER, rope_theta=1000.0, tie_word_embeddings=False)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _qwen3(tmp_path):
    """Qwen3: QK-norm, no biases, head_dim apart from hidden / heads, a tied head (4B)."""
    cfg = transformers.Qwen3Config(
        **_DECODER, head_dim=24, rope_theta=1e6, tie_word_embeddings=True
    )
    return transformers.Qwen3ForCausalLM(cfg).eval()


def _llama(tmp_path):
    """Llama 3.1: the llama3 RoPE scaling (small original length, so that all three
    frequency bands occur at head_dim 16), an untied head."""
    cfg = transformers.LlamaConfig(
        **_DECODER,
        rope_theta=500.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


BUILDERS = {"gemma3": _gemma3, "gemma2": _gemma2, "qwen2": _qwen2, "qwen3": _qwen3, "llama": _llama}


def _hf_logits(model, tokens_BxT):
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(np.asarray(tokens_BxT), dtype=torch.long))
    return out.logits.float().numpy()


def _our_logits(cfg, graphdef, params, tokens_BxT, lora=None, lora_scale=1.0):
    model = nnx.merge(graphdef, params)
    return np.asarray(model.forward(jnp.asarray(tokens_BxT), lora=lora, lora_scale=lora_scale))


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def saved(request, tmp_path_factory):
    """(kind, HF model, its save_pretrained directory)."""
    tmp = tmp_path_factory.mktemp(request.param)
    model = BUILDERS[request.param](tmp)
    _randomize(model, seed=len(request.param))
    model.save_pretrained(tmp / "hf", safe_serialization=True)
    return request.param, model, str(tmp / "hf")


def _tokens(vocab, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=(2, SEQ)).astype(np.int32)


def test_config_from_hf(saved):
    kind, model, path = saved
    cfg = hfc.load_model_config(path)
    hf = model.config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (
        cfg.vocab_size,
        cfg.d_model,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.mlp_dim,
    ) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
        head_dim,
        hf.intermediate_size,
    )
    assert cfg.family == kind
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    if kind in ("qwen2", "qwen3", "llama"):
        assert cfg.layer_pattern == ("global",) and cfg.sliding_window is None
        assert cfg.scale == pytest.approx(head_dim**-0.5)
        assert cfg.qk_norm == (kind == "qwen3") and cfg.arch.qkv_bias == (kind == "qwen2")
        assert cfg.rope_base_global == hf.rope_theta
        if kind == "llama":
            assert (cfg.rope_type, cfg.rope_scale_global, cfg.rope_original_max_len) == (
                "llama3",
                8.0,
                32,
            )
        return
    kinds = ["local" if t == "sliding_attention" else "global" for t in hf.layer_types]
    assert [cfg.layer_kind(i) for i in range(cfg.num_layers)] == kinds
    assert cfg.sliding_window == hf.sliding_window
    assert cfg.scale == pytest.approx(hf.query_pre_attn_scalar**-0.5)
    if kind == "gemma3":
        assert cfg.layer_pattern == ("local",) * 5 + ("global",)
        assert cfg.qk_norm and cfg.rope_scale_global == 2.0
        assert (cfg.rope_base_global, cfg.rope_base_local) == (1000.0, 50.0)
    else:
        assert cfg.layer_pattern == ("local", "global")
        assert not cfg.qk_norm and (cfg.attn_softcap, cfg.final_softcap) == (3.0, 4.0)


def test_logits_match_transformers(saved):
    _, model, path = saved
    cfg, graphdef, params = hfc.load(path)
    tokens = _tokens(cfg.vocab_size)
    ours, ref = _our_logits(cfg, graphdef, params, tokens), _hf_logits(model, tokens)
    assert ours.shape == ref.shape == (2, SEQ, cfg.vocab_size)
    assert np.abs(ref).max() > 1.0  # a meaningful comparison, not all-zero logits
    err_T = np.abs(ours - ref).max(axis=(0, 2))  # per position
    assert err_T.max() <= LOGIT_ATOL, f"per-position max |diff|: {err_T}"


def test_export_roundtrip_and_transformers_reload(saved, tmp_path):
    kind, model, path = saved
    cfg, graphdef, params = hfc.load(path)
    files = hfc.export(str(tmp_path / "out"), params, cfg, dtype="float32")
    assert files == ["config.json", "model.safetensors"]
    tree = nnx.to_pure_dict(params)
    again = nnx.to_pure_dict(hfc.load_params(str(tmp_path / "out"), cfg))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), tree, again
    )
    assert hfc.load_model_config(str(tmp_path / "out")) == cfg
    cls = type(model)
    reloaded = cls.from_pretrained(
        str(tmp_path / "out"), attn_implementation="eager", torch_dtype=torch.float32
    ).eval()
    tokens = _tokens(cfg.vocab_size, seed=1)
    np.testing.assert_allclose(
        _hf_logits(reloaded, tokens), _hf_logits(model, tokens), atol=1e-5, rtol=0
    )


def test_export_merges_lora_and_shards(saved, tmp_path):
    kind, model, path = saved
    cfg, graphdef, params = hfc.load(path)
    lcfg = LoRAConfig(rank=4, alpha=8.0, layers=(0, cfg.num_layers - 1))
    lora = init_lora(cfg, lcfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    lora = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.2, jnp.float32), lora)
    tokens = _tokens(cfg.vocab_size, seed=2)
    want = _our_logits(cfg, graphdef, params, tokens, lora=lora, lora_scale=lcfg.scale)
    plain = _our_logits(cfg, graphdef, params, tokens)
    assert np.abs(want - plain).max() > 1e-2  # the adapter changes the model
    files = hfc.export(
        str(tmp_path / "merged"),
        params,
        cfg,
        lora=lora,
        lora_scale=lcfg.scale,
        dtype="float32",
        max_shard_bytes=40_000,
    )
    assert hfc.INDEX_FILE in files and len(files) > 3
    merged = hfc.load_params(str(tmp_path / "merged"), cfg)
    got = _our_logits(cfg, graphdef, merged, tokens)
    assert np.abs(got - want).max() <= LOGIT_ATOL
    reloaded = (
        type(model)
        .from_pretrained(
            str(tmp_path / "merged"), attn_implementation="eager", torch_dtype=torch.float32
        )
        .eval()
    )
    assert np.abs(_hf_logits(reloaded, tokens) - want).max() <= LOGIT_ATOL


def test_bf16_checkpoint_imports(saved, tmp_path):
    _, model, path = saved
    cfg, graphdef, params = hfc.load(path)
    hfc.export(str(tmp_path / "bf16"), params, cfg)  # default dtype bfloat16
    cfg16 = hfc.load_model_config(str(tmp_path / "bf16"), param_dtype="bfloat16")
    p16 = hfc.load_params(str(tmp_path / "bf16"), cfg16)
    leaves = jax.tree.leaves(p16)
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    w16 = np.asarray(nnx.to_pure_dict(p16)["embed"], np.float32)
    w32 = np.asarray(nnx.to_pure_dict(params)["embed"])
    np.testing.assert_allclose(w16, w32, rtol=1e-2, atol=1e-2)


def test_mismatch_error_lists_every_problem(saved, tmp_path):
    _, _, path = saved
    cfg = hfc.load_model_config(path)
    tensors = hfc.read_tensors(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.o_proj.weight"] = np.zeros((3, 3), np.float32)
    tensors["model.layers.0.extra.weight"] = np.zeros((2,), np.float32)
    with pytest.raises(hfc.CheckpointMismatchError) as e:
        hfc.hf_to_tree(tensors, cfg)
    msg = str(e.value)
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in msg
    assert "model.layers.0.extra.weight" in msg and "1 unexpected" in msg
    assert "model.layers.0.self_attn.o_proj.weight: checkpoint (3, 3)" in msg
    # A checkpoint of a different architecture: the wrong layer count is caught too.
    with pytest.raises(hfc.CheckpointMismatchError, match="missing"):
        hfc.hf_to_tree(hfc.read_tensors(path), cfg.replace(num_layers=cfg.num_layers + 1))


def test_output_head_matches_tie_word_embeddings(saved, tmp_path):
    _, _, path = saved
    cfg = hfc.load_model_config(path)
    tensors = hfc.read_tensors(path)
    if not cfg.tie_embeddings:  # untied: the head is read, and required
        tree = hfc.hf_to_tree(tensors, cfg)
        np.testing.assert_array_equal(tree["lm_head"], tensors["lm_head.weight"])
        assert not np.array_equal(tree["lm_head"], tree["embed"])
        del tensors["lm_head.weight"]
        with pytest.raises(hfc.CheckpointMismatchError, match="missing: lm_head.weight"):
            hfc.hf_to_tree(tensors, cfg)
        return
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    assert "lm_head" not in hfc.hf_to_tree(tensors, cfg)  # tied copy: fine
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    with pytest.raises(hfc.CheckpointMismatchError, match="tie_word_embeddings is true"):
        hfc.hf_to_tree(tensors, cfg)


def test_multimodal_gemma3_layout(tmp_path):
    """A Gemma3ForConditionalGeneration-style directory: text_config + language_model.*."""
    model = _gemma3(tmp_path)
    _randomize(model, 7)
    model.save_pretrained(tmp_path / "text", safe_serialization=True)
    cfg = hfc.load_model_config(str(tmp_path / "text"))
    tensors = hfc.read_tensors(str(tmp_path / "text"))
    from safetensors.numpy import save_file

    mm = {"language_model." + k: v for k, v in tensors.items()}
    mm["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((2, 2), np.float32)
    os.makedirs(tmp_path / "mm")
    save_file(mm, str(tmp_path / "mm" / "model.safetensors"))
    with open(tmp_path / "text" / "config.json") as f:
        text_cfg = json.load(f)
    with open(tmp_path / "mm" / "config.json", "w") as f:
        json.dump({"model_type": "gemma3", "text_config": text_cfg}, f)
    assert hfc.load_model_config(str(tmp_path / "mm")) == cfg
    p = nnx.to_pure_dict(hfc.load_params(str(tmp_path / "mm"), cfg))
    np.testing.assert_array_equal(np.asarray(p["embed"]), tensors["model.embed_tokens.weight"])


def test_transformers5_rope_parameters():
    """transformers >= 5 writes rope settings per layer type in rope_parameters."""
    hf = {
        "model_type": "gemma3_text",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "sliding_window": 4,
        "query_pre_attn_scalar": 8,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    cfg = hfc.model_config_from_hf(hf)
    assert (cfg.rope_base_global, cfg.rope_scale_global, cfg.rope_base_local) == (1e6, 8.0, 1e4)
    assert cfg.layer_pattern == ("local",) * 5 + ("global",)
    with pytest.raises(ValueError, match="rope_type"):
        hfc.model_config_from_hf(
            {**hf, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}
        )
    with pytest.raises(ValueError, match="model_type"):
        hfc.model_config_from_hf({**hf, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope_type 'llama3'.*gemma3"):
        hfc.model_config_from_hf(
            {**hf, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1.0}}
        )


def test_gemma_tokenizer_matches_transformers(tmp_path):
    """Our GemmaTokenizer and transformers' GemmaTokenizer agree on a tiny Gemma-like model."""
    from dsparse_jax.data.tokenizers import gemma as gt

    corpus = [
        "Natalia sold 48 clips in April and half as many in May. How many in all?",
        gt.MATH_INSTRUCTION,
        "user\nmodel\n0123456789 +-*/=()[]{}.,$#%",
    ] * 20
    ours = gt.train_gemma_like(corpus, vocab_size=400)
    ours.save(tmp_path / "tokenizer.model")
    theirs = transformers.GemmaTokenizer(vocab_file=str(tmp_path / "tokenizer.model"))
    assert (theirs.pad_token_id, theirs.eos_token_id, theirs.bos_token_id) == (0, 1, 2)
    prompt = gt.math_prompt("Natalia sold 48 clips. How many?")
    ids = ours.encode(prompt, add_bos=True)
    assert ids == theirs.encode(prompt)
    assert theirs.convert_ids_to_tokens(ids[1]) == gt.START_OF_TURN
    assert theirs.decode(ids, skip_special_tokens=False).endswith(prompt)


def test_missing_fields_take_transformers_defaults():
    """A sparse text_config (as in multimodal Gemma 3 releases) gets transformers' defaults."""
    for kind, cls in (
        ("gemma3_text", transformers.Gemma3TextConfig),
        ("gemma2", transformers.Gemma2Config),
    ):
        sparse = {"model_type": kind, "num_hidden_layers": 12, "hidden_size": 128}
        full = cls(num_hidden_layers=12, hidden_size=128).to_dict()
        assert hfc.model_config_from_hf(sparse) == hfc.model_config_from_hf(full)
