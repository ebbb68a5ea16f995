"""Model shapes: one frozen dataclass, with presets for the tiny CPU model and real Gemmas.

Only shapes and architecture switches live here (the conventions of each architecture
family are model/families.py); weights are loaded elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from dsparse_jax.model.families import FAMILIES, Family

LayerKind = Literal["global", "local"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer of one family (model/families.py)."""

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    # Layer pattern, repeated to num_layers: e.g. ("local", "global") is Gemma 2,
    # ("local",) * 5 + ("global",) is Gemma 3.
    layer_pattern: tuple[LayerKind, ...] = ("global",)
    sliding_window: int | None = None  # window of "local" layers (tokens)
    rope_base_global: float = 10_000.0
    rope_base_local: float = 10_000.0
    rope_scale_global: float = 1.0  # position interpolation factor (Gemma 3 4B: 8.0)
    query_scale: float | None = None  # multiplies q; None -> head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: 50.0
    final_softcap: float | None = None  # Gemma 2: 30.0
    qk_norm: bool = False  # Gemma 3, Qwen3
    norm_eps: float = 1e-6
    # gemma2 | gemma3 | qwen2 | qwen3 | llama; "" (the presets): Gemma, 3 if qk_norm else 2.
    family: str = ""
    tie_embeddings: bool = True  # logits through the embedding; False: its own lm_head
    # "linear": positions divided by rope_scale_global; "llama3": Llama 3.1's per-frequency
    # scaling by rope_scale_global with the three fields below (global layers).
    rope_type: str = "linear"
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    param_dtype: str = "float32"
    dtype: str = "float32"  # compute dtype

    def __post_init__(self):
        for name in (
            "vocab_size",
            "d_model",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if not self.layer_pattern or any(k not in ("global", "local") for k in self.layer_pattern):
            raise ValueError(
                f"ModelConfig.layer_pattern must use 'global'/'local': {self.layer_pattern}"
            )
        if "local" in self.layer_pattern and not self.sliding_window:
            raise ValueError(
                "ModelConfig.sliding_window is required when layer_pattern has 'local'"
            )
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"ModelConfig.{name} must be float32 or bfloat16")
        if self.family and self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family {self.family!r} is not one of {sorted(FAMILIES)}")
        arch = self.arch
        if self.family and self.qk_norm != arch.qk_norm:
            raise ValueError(f"ModelConfig.qk_norm must be {arch.qk_norm} for family {arch.name}")
        if not arch.softcaps and (self.attn_softcap or self.final_softcap):
            raise ValueError(f"ModelConfig.attn_softcap/final_softcap: family {arch.name} has none")
        if not arch.local_layers and "local" in self.layer_pattern:
            raise ValueError(
                f"ModelConfig.layer_pattern: family {arch.name} has no sliding-window layers"
            )
        if self.rope_type not in arch.rope_types:
            raise ValueError(
                f"ModelConfig.rope_type {self.rope_type!r}: family {arch.name} uses "
                f"{list(arch.rope_types)}"
            )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def layer_kind(self, i: int) -> LayerKind:
        return self.layer_pattern[i % len(self.layer_pattern)]

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.layer_kind(i) == "local" else None

    @property
    def arch(self) -> Family:
        """The family's conventions (the presets: Gemma 3 if qk_norm, else Gemma 2)."""
        return FAMILIES[self.family or ("gemma3" if self.qk_norm else "gemma2")]

    def layer_rope(self, i: int) -> tuple[float, float, tuple[float, float, int] | None]:
        """(base, scale factor, llama3's (low, high, original length) or None) of layer i's
        RoPE."""
        if self.layer_kind(i) == "local":
            return self.rope_base_local, 1.0, None
        llama3 = None
        if self.rope_type == "llama3":
            llama3 = (
                self.rope_low_freq_factor,
                self.rope_high_freq_factor,
                self.rope_original_max_len,
            )
        return self.rope_base_global, self.rope_scale_global, llama3

    @property
    def scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def tiny(vocab_size: int = 64) -> ModelConfig:
    """The CPU default: ~3M parameters, Gemma 2/3 features all switched on."""
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=192,
        num_layers=6,
        num_heads=4,
        num_kv_heads=1,
        head_dim=48,
        mlp_dim=768,
        layer_pattern=("local", "global"),
        sliding_window=64,
        rope_base_global=10_000.0,
        rope_base_local=10_000.0,
        attn_softcap=50.0,
        final_softcap=30.0,
        qk_norm=True,
    )


def mini(vocab_size: int = 64) -> ModelConfig:
    """A miniature of the paper's regime (Qwen3: all layers global, GQA): 6 global layers,
    2 KV heads with 2 query heads each, ~1.6M parameters. With sparse.dense_layers=2, 4
    layers x 2 KV heads choose their pages independently at every decode step."""
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=128,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=512,
        layer_pattern=("global",),
        # Qwen3's rope_theta. With base 1e4 and head_dim 32 the model did not learn the
        # lookups 200-550 tokens back (docs/miniature.md).
        rope_base_global=1_000_000.0,
        qk_norm=True,  # as Qwen3; no soft-capping (Qwen3 has none)
    )


def gemma2_2b() -> ModelConfig:
    return ModelConfig(
        vocab_size=256_000,
        d_model=2304,
        num_layers=26,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        mlp_dim=9216,
        layer_pattern=("local", "global"),
        sliding_window=4096,
        query_scale=256**-0.5,
        attn_softcap=50.0,
        final_softcap=30.0,
        qk_norm=False,
        family="gemma2",
    )


def gemma3_1b() -> ModelConfig:
    return ModelConfig(
        vocab_size=262_144,
        d_model=1152,
        num_layers=26,
        num_heads=4,
        num_kv_heads=1,
        head_dim=256,
        mlp_dim=6912,
        layer_pattern=("local",) * 5 + ("global",),
        sliding_window=512,
        rope_base_local=10_000.0,
        rope_base_global=1_000_000.0,
        query_scale=256**-0.5,
        qk_norm=True,
        family="gemma3",
    )


def gemma3_4b() -> ModelConfig:
    return ModelConfig(
        vocab_size=262_144,
        d_model=2560,
        num_layers=34,
        num_heads=8,
        num_kv_heads=4,
        head_dim=256,
        mlp_dim=10240,
        layer_pattern=("local",) * 5 + ("global",),
        sliding_window=1024,
        rope_base_local=10_000.0,
        rope_base_global=1_000_000.0,
        rope_scale_global=8.0,
        query_scale=256**-0.5,
        qk_norm=True,
        family="gemma3",
    )


def _qwen3(d_model: int, num_layers: int, num_heads: int, mlp_dim: int) -> ModelConfig:
    """Qwen3 (base and instruct share shapes): head_dim 128, 8 KV heads, rope 1e6, tied
    head below 8B."""
    return ModelConfig(
        vocab_size=151_936,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=mlp_dim,
        rope_base_global=1_000_000.0,
        qk_norm=True,
        family="qwen3",
        tie_embeddings=True,
    )


def qwen3_1_7b() -> ModelConfig:
    return _qwen3(2048, 28, 16, 6144)


def qwen3_4b() -> ModelConfig:
    """The paper's model (Qwen3-4B-Base): 36 layers, 32 query and 8 KV heads of 128."""
    return _qwen3(2560, 36, 32, 9728)


def qwen2_5_1_5b() -> ModelConfig:
    return ModelConfig(
        vocab_size=151_936,
        d_model=1536,
        num_layers=28,
        num_heads=12,
        num_kv_heads=2,
        head_dim=128,
        mlp_dim=8960,
        rope_base_global=1_000_000.0,
        family="qwen2",
        tie_embeddings=True,
    )


def _llama3(d_model, num_layers, mlp_dim, head_dim, factor, tied) -> ModelConfig:
    return ModelConfig(
        vocab_size=128_256,
        d_model=d_model,
        num_layers=num_layers,
        num_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        mlp_dim=mlp_dim,
        rope_base_global=500_000.0,
        rope_scale_global=factor,
        rope_type="llama3",
        norm_eps=1e-5,
        family="llama",
        tie_embeddings=tied,
    )


def llama3_2_1b() -> ModelConfig:
    return _llama3(2048, 16, 8192, 64, factor=32.0, tied=True)


def llama3_1_8b() -> ModelConfig:
    return _llama3(4096, 32, 14336, 128, factor=8.0, tied=False)


def tiny_of(family: str, vocab_size: int) -> ModelConfig:
    """A tiny random model (~0.2M parameters plus the embedding) of any family, for smoke
    tests of the real-data path on CPU: 2 global layers, 4 query and 2 KV heads of 16."""
    arch = FAMILIES[family]
    return ModelConfig(
        vocab_size=vocab_size,
        d_model=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=128,
        rope_base_global=10_000.0,
        qk_norm=arch.qk_norm,
        family=family,
        tie_embeddings=arch.tied,
    )


PRESETS = {
    "tiny": tiny,
    "mini": mini,
    "gemma2_2b": gemma2_2b,
    "gemma3_1b": gemma3_1b,
    "gemma3_4b": gemma3_4b,
    "qwen2_5_1_5b": qwen2_5_1_5b,
    "qwen3_1_7b": qwen3_1_7b,
    "qwen3_4b": qwen3_4b,
    "llama3_2_1b": llama3_2_1b,
    "llama3_1_8b": llama3_1_8b,
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset with field overrides (e.g. vocab_size, dtype)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]().replace(**overrides)
