"""Hugging Face checkpoints of every family (Gemma 2/3, Qwen2.5, Qwen3, Llama 3) <-> our
nnx param tree.

A Hugging Face directory holds config.json and either model.safetensors or shards listed
in model.safetensors.index.json. `load_model_config` builds a ModelConfig from
config.json; `load_params` maps every tensor into the tree of `Transformer(cfg)`:

  HF name (model.layers.{i}.)            shape (torch Linear: [out, in])   ours
  model.embed_tokens.weight              [V, D]                            embed [V, D]
  self_attn.q_proj.weight                [N*H, D]                          attn.q [D, N, H]
  self_attn.k_proj / v_proj.weight       [K*H, D]                          attn.k / v [D, K, H]
  self_attn.o_proj.weight                [D, N*H]                          attn.o [N, H, D]
  self_attn.q_norm / k_norm.weight       [H]            (Gemma 3)          attn.q_norm/k_norm.scale
  self_attn.q_proj / k_proj / v_proj.bias [N*H] / [K*H] (Qwen2)             attn.q_bias / k_bias / v_bias
  input_layernorm.weight                 [D]                               pre_attn_norm.scale
  mlp.gate_proj / up_proj.weight         [F, D]                            mlp.gate / up [D, F]
  mlp.down_proj.weight                   [D, F]                            mlp.down [F, D]
  model.norm.weight                      [D]                               final_norm.scale
  lm_head.weight (untied head only)      [V, D]                            lm_head [V, D]
  Gemma 2/3:
  post_attention_layernorm.weight        [D]                               post_attn_norm.scale
  pre_feedforward_layernorm.weight       [D]                               pre_mlp_norm.scale
  post_feedforward_layernorm.weight      [D]                               post_mlp_norm.scale
  Qwen2/3, Llama (no post-norms; HF's "post_attention_layernorm" is the MLP's pre-norm):
  post_attention_layernorm.weight        [D]                               pre_mlp_norm.scale

Both sides store RMSNorm scales in the family's convention (Gemma: 1 + w, the others: w),
so norms copy unchanged. A tied checkpoint's lm_head.weight, if present, must equal the
embedding. Multimodal Gemma 3 checkpoints are accepted too (the language model's tensors
under language_model.*; vision tensors are ignored). `export` writes our params
(optionally with a LoRA tree merged: W + A.B * alpha / r) back in the same format,
loadable by transformers' causal LM class of the family (HF_FORMATS).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.model.config import ModelConfig
from dsparse_jax.model.families import FAMILIES
from dsparse_jax.model.transformer import ATTN_NAMES, Transformer, lora_weight

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Where the text decoder lives in the known checkpoint layouts (first match wins).
_PREFIXES = ("model.", "language_model.model.", "model.language_model.")
_IGNORED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")


@dataclasses.dataclass(frozen=True)
class HFFormat:
    """How a family is written in Hugging Face format."""

    model_types: tuple[str, ...]  # config.json model_type values read (the first is written)
    architecture: str  # the causal LM class written into config.json
    activations: tuple[str, ...]  # hidden_act values meaning the family's activation
    norms: tuple[tuple[str, str], ...]  # (HF name in a layer, our norm)


_GEMMA_NORMS = (
    ("input_layernorm", "pre_attn_norm"),
    ("post_attention_layernorm", "post_attn_norm"),
    ("pre_feedforward_layernorm", "pre_mlp_norm"),
    ("post_feedforward_layernorm", "post_mlp_norm"),
)
_DECODER_NORMS = (
    ("input_layernorm", "pre_attn_norm"),
    ("post_attention_layernorm", "pre_mlp_norm"),
)
_GELU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")
HF_FORMATS = {
    "gemma2": HFFormat(("gemma2",), "Gemma2ForCausalLM", _GELU, _GEMMA_NORMS),
    "gemma3": HFFormat(("gemma3_text", "gemma3"), "Gemma3ForCausalLM", _GELU, _GEMMA_NORMS),
    "qwen2": HFFormat(("qwen2",), "Qwen2ForCausalLM", ("silu",), _DECODER_NORMS),
    "qwen3": HFFormat(("qwen3",), "Qwen3ForCausalLM", ("silu",), _DECODER_NORMS),
    "llama": HFFormat(("llama",), "LlamaForCausalLM", ("silu",), _DECODER_NORMS),
}
assert set(HF_FORMATS) == set(FAMILIES)
MODEL_TYPES = {t: name for name, f in HF_FORMATS.items() for t in f.model_types}
# transformers' defaults for fields a config.json may leave out (e.g. the text_config of
# the multimodal Gemma 3 checkpoints lists only what differs from them).
_SHARED_DEFAULTS = dict(
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=256,
    sliding_window=4096,
)
DEFAULTS = {
    "gemma2": dict(
        _SHARED_DEFAULTS,
        vocab_size=256_000,
        rope_theta=10_000.0,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        _SHARED_DEFAULTS,
        vocab_size=262_208,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    ),
}
DEFAULTS["gemma3"] = DEFAULTS["gemma3_text"]


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: lists every problem."""


def _safetensors():
    try:
        import safetensors.numpy as st  # pylint: disable=import-outside-toplevel
        from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ImportError(
            "reading/writing Hugging Face checkpoints needs the `safetensors` "
            "package: pip install safetensors"
        ) from e
    return st, safe_open


# ------------------------------------------------------------------------------ config
def read_hf_config(ckpt_dir: str) -> dict:
    """config.json as a dict; for a multimodal Gemma 3, its text_config (with model_type)."""
    path = os.path.join(ckpt_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {ckpt_dir!r}")
    with open(path) as f:
        hf = json.load(f)
    if "text_config" in hf:  # Gemma3ForConditionalGeneration
        text = dict(hf["text_config"])
        text.setdefault("model_type", "gemma3_text")
        return text
    return hf


def _rope(hf: dict, kind: str, family: str) -> tuple[float, float, dict]:
    """(base, scale factor, ModelConfig's llama3 fields or {}) of the 'full_attention' or
    'sliding_attention' layers."""
    params = hf.get("rope_parameters")  # transformers >= 5
    if isinstance(params, Mapping) and kind in params:
        p = params[kind]
    elif isinstance(params, Mapping) and "rope_theta" in params:
        p = params
    else:  # transformers 4.x: rope_theta (+ rope_local_base_freq), rope_scaling on global
        base = hf.get("rope_theta", 10_000.0)
        if kind == "sliding_attention" and "rope_local_base_freq" in hf:
            base = hf["rope_local_base_freq"]
        p = {"rope_theta": base}
        if kind == "full_attention" and hf.get("rope_scaling"):
            p.update(hf["rope_scaling"])
    rope_type = p.get("rope_type", p.get("type", "default"))
    supported = ("default",) + FAMILIES[family].rope_types
    if rope_type not in supported:
        raise ValueError(
            f"unsupported rope_type {rope_type!r} for {kind} layers of a {family} checkpoint "
            f"(supported: {', '.join(supported)})"
        )
    base = float(p.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    if rope_type == "default":
        return base, 1.0, {}
    factor = float(p.get("factor", 1.0))
    if rope_type == "linear":
        return base, factor, {}
    return (
        base,
        factor,
        dict(
            rope_type="llama3",
            rope_low_freq_factor=float(p["low_freq_factor"]),
            rope_high_freq_factor=float(p["high_freq_factor"]),
            rope_original_max_len=int(p["original_max_position_embeddings"]),
        ),
    )


def _layer_pattern(hf: dict, num_layers: int, family: str) -> tuple[str, ...]:
    """The shortest repeating pattern of local/global layers."""
    if not FAMILIES[family].local_layers:
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
            raise ValueError(
                f"use_sliding_window / sliding_attention layers of a {family} checkpoint are "
                "not supported"
            )
        return ("global",)
    if hf.get("layer_types"):
        kinds = ["local" if t == "sliding_attention" else "global" for t in hf["layer_types"]]
        if any(t not in ("sliding_attention", "full_attention") for t in hf["layer_types"]):
            raise ValueError(f"unsupported layer_types {sorted(set(hf['layer_types']))}")
    elif hf.get("model_type") == "gemma2":
        kinds = ["local" if i % 2 == 0 else "global" for i in range(num_layers)]
    else:
        p = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        kinds = ["global" if (i + 1) % p == 0 else "local" for i in range(num_layers)]
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries for {num_layers} layers")
    for period in range(1, num_layers + 1):
        if all(kinds[i] == kinds[i % period] for i in range(num_layers)):
            return tuple(kinds[:period])
    raise AssertionError("unreachable")


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """ModelConfig of a text config dict of any family in HF_FORMATS (overrides: e.g.
    dtype)."""
    model_type = hf.get("model_type", "")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}: supported are {', '.join(MODEL_TYPES)}"
        )
    family = MODEL_TYPES[model_type]
    fmt, arch = HF_FORMATS[family], FAMILIES[family]
    act = hf.get("hidden_activation") or hf.get("hidden_act") or fmt.activations[0]
    hf = {**DEFAULTS.get(model_type, {}), **hf}
    if act not in fmt.activations:
        raise ValueError(f"unsupported hidden_act {act!r} for {family} (need {fmt.activations})")
    if family != "qwen2" and hf.get("attention_bias"):  # Qwen2's q/k/v always have biases
        raise ValueError(f"attention_bias=True is not supported for {family}")
    if hf.get("mlp_bias"):
        raise ValueError(f"mlp_bias=True is not supported for {family}")
    n_layers = int(hf["num_hidden_layers"])
    pattern = _layer_pattern(hf, n_layers, family)
    base_g, scale_g, llama3 = _rope(hf, "full_attention", family)
    base_l, scale_l, _ = _rope(hf, "sliding_attention", family)
    if scale_l != 1.0:
        raise ValueError("RoPE scaling on sliding-window layers is not supported")
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    qpas = hf.get("query_pre_attn_scalar")
    kw = dict(
        vocab_size=int(hf["vocab_size"]),
        d_model=int(hf["hidden_size"]),
        num_layers=n_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads", num_heads)),
        head_dim=head_dim,
        mlp_dim=int(hf["intermediate_size"]),
        layer_pattern=pattern,
        sliding_window=int(hf["sliding_window"]) if "local" in pattern else None,
        rope_base_global=base_g,
        rope_base_local=base_l,
        rope_scale_global=scale_g,
        query_scale=float(qpas) ** -0.5 if qpas else None,
        attn_softcap=hf.get("attn_logit_softcapping"),
        final_softcap=hf.get("final_logit_softcapping"),
        qk_norm=arch.qk_norm,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        family=family,
        tie_embeddings=bool(hf.get("tie_word_embeddings", arch.tied)),
        **llama3,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def load_model_config(ckpt_dir: str, **overrides) -> ModelConfig:
    """ModelConfig from <ckpt_dir>/config.json (overrides: e.g. param_dtype, dtype)."""
    return model_config_from_hf(read_hf_config(ckpt_dir), **overrides)


def hf_config_from(cfg: ModelConfig) -> dict:
    """A config.json dict of cfg's family that describes cfg."""
    if cfg.arch.name not in ("gemma2", "gemma3"):
        return _decoder_config(cfg)
    gemma3 = cfg.arch.name == "gemma3"
    n = cfg.num_layers
    types = [
        "sliding_attention" if cfg.layer_kind(i) == "local" else "full_attention" for i in range(n)
    ]
    hf = {
        "architectures": ["Gemma3ForCausalLM" if gemma3 else "Gemma2ForCausalLM"],
        "model_type": "gemma3_text" if gemma3 else "gemma2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": n,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": types,
        "sliding_window": cfg.sliding_window or 4096,
        "query_pre_attn_scalar": round(cfg.scale**-2, 6),
        "rms_norm_eps": cfg.norm_eps,
        "attn_logit_softcapping": cfg.attn_softcap,
        "final_logit_softcapping": cfg.final_softcap,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "torch_dtype": cfg.param_dtype,
        "rope_theta": cfg.rope_base_global,
    }
    if gemma3:
        hf["rope_local_base_freq"] = cfg.rope_base_local
        hf["rope_scaling"] = (
            None
            if cfg.rope_scale_global == 1.0
            else {"rope_type": "linear", "factor": cfg.rope_scale_global}
        )
    elif cfg.rope_base_local != cfg.rope_base_global or cfg.rope_scale_global != 1.0:
        raise ValueError("Gemma 2 format has one RoPE base and no scaling")
    return hf


def _decoder_config(cfg: ModelConfig) -> dict:
    """config.json of a Qwen2 / Qwen3 / Llama cfg."""
    family = cfg.arch.name
    hf = {
        "architectures": [HF_FORMATS[family].architecture],
        "model_type": HF_FORMATS[family].model_types[0],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base_global,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.arch.qkv_bias,
        "torch_dtype": cfg.param_dtype,
    }
    if cfg.query_scale is not None and not math.isclose(cfg.scale, cfg.head_dim**-0.5):
        raise ValueError(f"the {family} format has no query_scale (it is head_dim ** -0.5)")
    if family != "llama":
        hf["use_sliding_window"] = False
    if cfg.rope_type == "llama3":
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scale_global,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    elif cfg.rope_scale_global != 1.0:
        hf["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_scale_global}
    return hf


def transformers_caveats(cfg: ModelConfig) -> list[str]:
    """What transformers' Gemma classes do not reproduce of cfg: the export loads, but its
    logits there differ from ours. (Gemma 3's attention in transformers 4.57 never applies
    attn_logit_softcapping; the tiny preset has qk_norm, hence the Gemma 3 format, and an
    attention soft-cap.)"""
    out = []
    if cfg.qk_norm and cfg.attn_softcap is not None:
        out.append(
            f"attn_softcap={cfg.attn_softcap} with qk_norm (Gemma 3 format): transformers' "
            "Gemma3 attention ignores attn_logit_softcapping, so its logits differ from "
            "this model's (slightly, for a soft-cap well above the attention logits)"
        )
    return out


# ----------------------------------------------------------------------------- tensors
def _weight_files(ckpt_dir: str) -> list[str]:
    index = os.path.join(ckpt_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(ckpt_dir, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        files = sorted(f for f in os.listdir(ckpt_dir) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {ckpt_dir!r}")
    missing = [f for f in files if not os.path.isfile(os.path.join(ckpt_dir, f))]
    if missing:
        raise FileNotFoundError(f"{INDEX_FILE} in {ckpt_dir!r} lists missing shards {missing}")
    return [os.path.join(ckpt_dir, f) for f in files]


def read_tensors(ckpt_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint's safetensors file(s), as numpy arrays."""
    _, safe_open = _safetensors()
    out = {}
    for path in _weight_files(ckpt_dir):
        with safe_open(path, framework="np") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


def _hf_layout(cfg: ModelConfig) -> dict[str, tuple[tuple[str | int, ...], tuple[int, ...]]]:
    """{HF name without prefix: (our tree path, HF shape)} for every tensor of cfg."""
    d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    out = {
        "embed_tokens.weight": (("embed",), (cfg.vocab_size, d)),
        "norm.weight": (("final_norm", "scale"), (d,)),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (("layers", i, "attn", "q"), (n * h, d))
        out[p + "self_attn.k_proj.weight"] = (("layers", i, "attn", "k"), (k * h, d))
        out[p + "self_attn.v_proj.weight"] = (("layers", i, "attn", "v"), (k * h, d))
        out[p + "self_attn.o_proj.weight"] = (("layers", i, "attn", "o"), (d, n * h))
        if cfg.arch.qkv_bias:
            for name, heads in (("q", n), ("k", k), ("v", k)):
                out[p + f"self_attn.{name}_proj.bias"] = (
                    ("layers", i, "attn", f"{name}_bias"),
                    (heads * h,),
                )
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (("layers", i, "attn", "q_norm", "scale"), (h,))
            out[p + "self_attn.k_norm.weight"] = (("layers", i, "attn", "k_norm", "scale"), (h,))
        for hf_name, ours in HF_FORMATS[cfg.arch.name].norms:
            out[p + hf_name + ".weight"] = (("layers", i, ours, "scale"), (d,))
        out[p + "mlp.gate_proj.weight"] = (("layers", i, "mlp", "gate"), (f, d))
        out[p + "mlp.up_proj.weight"] = (("layers", i, "mlp", "up"), (f, d))
        out[p + "mlp.down_proj.weight"] = (("layers", i, "mlp", "down"), (d, f))
    return out


def _to_ours(path, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """An HF tensor in our layout (torch Linear weights are [out, in])."""
    name = path[-1]
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if name == "q":
        return w.T.reshape(cfg.d_model, n, h)
    if name in ("k", "v"):
        return w.T.reshape(cfg.d_model, k, h)
    if name == "o":
        return w.T.reshape(n, h, cfg.d_model)
    if name in ("gate", "up", "down"):
        return w.T
    if name.endswith("_bias"):
        return w.reshape(-1, h)
    return w


def _to_hf(path, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    name = path[-1]
    if name in ("q", "k", "v"):
        return w.reshape(cfg.d_model, -1).T
    if name == "o":
        return w.reshape(-1, cfg.d_model).T
    if name in ("gate", "up", "down"):
        return w.T
    if name.endswith("_bias"):
        return w.reshape(-1)
    return w


def _find_prefix(names) -> str:
    for p in _PREFIXES:
        if p + "embed_tokens.weight" in names:
            return p
    return _PREFIXES[0]


def hf_to_tree(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict:
    """The pure-dict param tree (as nnx.to_pure_dict gives) of an HF tensor dict.

    Raises CheckpointMismatchError listing every missing, unexpected and mis-shaped tensor.
    """
    prefix = _find_prefix(tensors)
    layout = _hf_layout(cfg)
    missing, shape_errors, unexpected = [], [], []
    tree: dict = {}
    for name, (path, shape) in layout.items():
        full = prefix + name
        if full not in tensors:
            missing.append(full)
            continue
        w = np.asarray(tensors[full])
        if tuple(w.shape) != shape:
            shape_errors.append(f"{full}: checkpoint {tuple(w.shape)}, model expects {shape}")
            continue
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _to_ours(path, w, cfg)
    embed = tensors.get(prefix + "embed_tokens.weight")
    heads = [name for name in _LM_HEADS if name in tensors]
    if not cfg.tie_embeddings:
        shape = (cfg.vocab_size, cfg.d_model)
        if not heads:
            missing.append("lm_head.weight (tie_word_embeddings is false)")
        elif tuple(np.shape(tensors[heads[0]])) != shape:
            shape_errors.append(
                f"{heads[0]}: checkpoint {tuple(np.shape(tensors[heads[0]]))}, model expects {shape}"
            )
        else:
            tree["lm_head"] = np.asarray(tensors[heads[0]])
    for name, w in tensors.items():
        if name.startswith(prefix) and name[len(prefix) :] in layout:
            continue
        if name.startswith(_IGNORED_PREFIXES):
            continue
        if name in _LM_HEADS:
            if cfg.tie_embeddings and (
                embed is None
                or np.shape(w) != np.shape(embed)
                or not np.array_equal(np.asarray(w), np.asarray(embed))
            ):
                unexpected.append(
                    f"{name} (differs from the embedding, but tie_word_embeddings is true)"
                )
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        unexpected.append(f"{name} {tuple(np.shape(w))}")
    if missing or unexpected or shape_errors:
        lines = [
            f"checkpoint does not match the model ({cfg.arch.name}, {cfg.num_layers} layers, "
            f"d_model={cfg.d_model}, qk_norm={cfg.qk_norm}, tied={cfg.tie_embeddings}):"
        ]
        for title, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("mis-shaped", shape_errors),
        ):
            if items:
                shown = items[:20] + (
                    [f"... and {len(items) - 20} more"] if len(items) > 20 else []
                )
                lines.append(f"  {len(items)} {title}: " + "; ".join(shown))
        raise CheckpointMismatchError("\n".join(lines))
    return tree


def abstract_params(cfg: ModelConfig):
    """(graphdef, abstract nnx.State) of Transformer(cfg), allocating nothing."""
    model = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    return nnx.split(model)


def load_params(ckpt_dir: str, cfg: ModelConfig):
    """The checkpoint's weights as an nnx.State of Transformer(cfg), in cfg.param_dtype."""
    tree = hf_to_tree(read_tensors(ckpt_dir), cfg)
    _, state = abstract_params(cfg)
    dtype = jnp.dtype(cfg.param_dtype)
    tree = jax.tree.map(lambda w: jnp.asarray(w, dtype), tree)
    nnx.replace_by_pure_dict(state, tree)
    return state


def load(ckpt_dir: str, **overrides):
    """(ModelConfig, graphdef, params) of a Hugging Face directory of any family."""
    cfg = load_model_config(ckpt_dir, **overrides)
    graphdef, _ = abstract_params(cfg)
    return cfg, graphdef, load_params(ckpt_dir, cfg)


# ------------------------------------------------------------------------------ export
def merge_lora(tree: dict, lora: Mapping | None, lora_scale: float) -> dict:
    """A copy of the pure-dict tree with W + A.B * lora_scale for every adapted map."""
    if not lora:
        return tree
    out = jax.tree.map(lambda x: x, tree)
    for i, maps in lora.items():
        layer = out["layers"][int(i)]
        for name, ab in maps.items():
            group = "attn" if name in ATTN_NAMES else "mlp"
            layer[group][name] = np.asarray(lora_weight(layer[group][name], ab, lora_scale))
    return out


def tree_to_hf(tree: Mapping, cfg: ModelConfig, dtype: str = "float32") -> dict[str, np.ndarray]:
    """HF tensor dict (names under model.) of a pure-dict param tree."""
    out = {}
    np_dtype = jnp.dtype(dtype)
    for name, (path, shape) in _hf_layout(cfg).items():
        node = tree
        for key in path:
            node = node[key]
        w = _to_hf(path, np.asarray(node, np.float32), cfg)
        assert w.shape == shape, (name, w.shape, shape)
        out["model." + name] = np.ascontiguousarray(w).astype(np_dtype)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = np.asarray(tree["lm_head"], np.float32).astype(np_dtype)
    return out


def export(
    out_dir: str,
    params,
    cfg: ModelConfig,
    *,
    lora: Mapping | None = None,
    lora_scale: float = 1.0,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 4 << 30,
    hf_config: dict | None = None,
) -> list[str]:
    """Writes config.json + safetensors (sharded above max_shard_bytes, with an index).

    params: an nnx.State (or pure dict) of Transformer(cfg); lora: optional delta tree
    merged into the weights with lora_scale (= alpha / r). Returns the files written.
    """
    st, _ = _safetensors()
    tree = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    tree = jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), tree)
    tensors = tree_to_hf(merge_lora(tree, lora, lora_scale), cfg, dtype)
    os.makedirs(out_dir, exist_ok=True)
    hf = dict(hf_config) if hf_config is not None else hf_config_from(cfg)
    hf["torch_dtype"] = dtype
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(hf, f, indent=2)
    shards, current, size = [], {}, 0
    for name, w in tensors.items():
        if current and size + w.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = w
        size += w.nbytes
    shards.append(current)
    meta = {"format": "pt"}
    if len(shards) == 1:
        st.save_file(shards[0], os.path.join(out_dir, SINGLE_FILE), metadata=meta)
        return [CONFIG_FILE, SINGLE_FILE]
    files, weight_map = [], {}
    for j, shard in enumerate(shards):
        fname = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        st.save_file(shard, os.path.join(out_dir, fname), metadata=meta)
        files.append(fname)
        weight_map.update({name: fname for name in shard})
    total = sum(w.nbytes for w in tensors.values())
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [CONFIG_FILE, INDEX_FILE] + files


# ------------------------------------------------------------------------ PEFT adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_HF_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def lora_to_peft(lora: Mapping, dtype: str = "float32") -> dict[str, np.ndarray]:
    """A LoRA delta tree as peft tensors: lora_A.weight [r, in] = A^T and lora_B.weight
    [out, r] = B^T (input and output dims flattened as in the HF weights), so that
    B_hf A_hf = (A B)^T, the delta of the [out, in] HF weight."""
    out = {}
    np_dtype = jnp.dtype(dtype)
    for i, maps in lora.items():
        for name, ab in maps.items():
            a = np.asarray(jax.device_get(ab["a"]), np.float32)
            b = np.asarray(jax.device_get(ab["b"]), np.float32)
            r = a.shape[-1]
            prefix = f"base_model.model.model.layers.{int(i)}.{_HF_MODULES[name]}"
            out[prefix + ".lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T, np_dtype)
            out[prefix + ".lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T, np_dtype)
    return out


def export_lora_adapter(
    out_dir: str,
    lora: Mapping,
    *,
    rank: int,
    alpha: float,
    base_model: str = "",
    dtype: str = "float32",
) -> list[str]:
    """Writes phi as a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors)
    that peft.PeftModel.from_pretrained loads onto the exported base (W + B A * alpha/r,
    peft's scaling without rslora). Returns the files written."""
    st, _ = _safetensors()
    names = sorted({name for maps in lora.values() for name in maps})
    layers = sorted(int(i) for i in lora)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": 0.0,
        "target_modules": sorted(_HF_MODULES[n].split(".")[-1] for n in names),
        "layers_to_transform": layers,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    st.save_file(
        lora_to_peft(lora, dtype), os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"}
    )
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def num_bytes(cfg: ModelConfig, dtype: str = "bfloat16") -> int:
    """Bytes of the exported weights (for shard planning)."""
    n = sum(math.prod(s) for _, s in _hf_layout(cfg).values())
    if not cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.d_model
    return n * jnp.dtype(dtype).itemsize
