"""Architecture families as data: what differs between Gemma 2/3, Qwen2.5, Qwen3 and Llama 3.

One Transformer (model/transformer.py) reads these properties; a ModelConfig names its
family. Sizes and per-model values (rope bases, soft-cap values, sliding windows, a tied
or untied output head: Qwen3-4B and Llama 3.2 1B tie it, Qwen3-8B and Llama 3.1 8B do not)
live in the ModelConfig; here are the conventions a family fixes.

  family   norm     act        embed*sqrt(D)  post-norms  qkv bias  qk-norm  soft-caps  local layers  rope scaling
  gemma2   1 + w    gelu_tanh  yes            yes         no        no       yes        yes           linear
  gemma3   1 + w    gelu_tanh  yes            yes         no        yes      yes        yes           linear
  qwen2    w        silu       no             no          yes       no       no         no            linear
  qwen3    w        silu       no             no          no        yes      no         no            linear
  llama    w        silu       no             no          no        no       no         no            linear, llama3
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    norm_offset: float  # RMSNorm multiplies by (norm_offset + w); w starts at 1 - norm_offset
    activation: str  # the gated MLP's: gelu_tanh | silu
    embed_scale: bool  # token embeddings times sqrt(d_model)
    post_norms: bool  # RMSNorm on the attention and MLP outputs before the residual add
    qkv_bias: bool  # q, k, v projections have biases
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    softcaps: bool  # attention / final logit soft-capping allowed
    local_layers: bool  # sliding-window layers allowed
    tied: bool  # tie_word_embeddings when a config.json leaves it out (transformers')
    rope_types: tuple[str, ...]  # RoPE scalings the family's checkpoints use


_GEMMA = dict(
    norm_offset=1.0,
    activation="gelu_tanh",
    embed_scale=True,
    post_norms=True,
    qkv_bias=False,
    softcaps=True,
    local_layers=True,
    tied=True,
    rope_types=("linear",),
)
_DECODER = dict(  # the Llama-style decoder Qwen and Llama share
    norm_offset=0.0,
    activation="silu",
    embed_scale=False,
    post_norms=False,
    softcaps=False,
    local_layers=False,
)

FAMILIES = {
    f.name: f
    for f in (
        Family("gemma2", qk_norm=False, **_GEMMA),
        Family("gemma3", qk_norm=True, **_GEMMA),
        Family(
            "qwen2", qkv_bias=True, qk_norm=False, tied=False, rope_types=("linear",), **_DECODER
        ),
        Family(
            "qwen3", qkv_bias=False, qk_norm=True, tied=True, rope_types=("linear",), **_DECODER
        ),
        Family(
            "llama",
            qkv_bias=False,
            qk_norm=False,
            tied=False,
            rope_types=("linear", "llama3"),
            **_DECODER,
        ),
    )
}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; choose from {sorted(FAMILIES)}")
    return FAMILIES[name]
