"""The device memory plan of the paper's setting on three machines (docs/scaling.md,
"Device memory"), from train/memory_plan.py's estimate: nothing is allocated or compiled.

    python -m dsparse_jax.harness.memory_table

The setting (stated in docs/scaling.md): Qwen3-4B-Base shapes (36 global layers, d_model
2560, 32 query and 8 KV heads of 128, MLP 9728, vocabulary 151936, tied embeddings,
qk-norm, no soft-caps), bf16 weights and compute, AdamW (optax: its states in the
parameters' dtype), DistillSparse (phi: LoRA rank 8 on all seven maps, trained, f32),
prompts of 1024 tokens and 16384 generated, page 16, a sparse budget of 128 pages (2048
tokens; the first 2 layers dense), 32 prompts x M = 16 samples, n = 8 kept, 4 minibatches
of 64 rows, microbatches of one row per device. Each machine's mesh splits the weights
over fsdp.
"""

from __future__ import annotations

import jax

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.errors import UserError
from dsparse_jax.model.config import ModelConfig
from dsparse_jax.model.lora import LoRAConfig, lora_shapes
from dsparse_jax.train import memory_plan as mp
from dsparse_jax.train import steps

QWEN3_4B = ModelConfig(
    vocab_size=151_936,
    d_model=2560,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=9728,
    layer_pattern=("global",),
    rope_base_global=1_000_000.0,
    qk_norm=True,
    param_dtype="bfloat16",
    dtype="bfloat16",
)

# (name, memory per device in GB, mesh (data, fsdp, tensor))
DEVICES = (
    ("1 x H100 (80 GB)", 80, (1, 1, 1)),
    ("2 x H200 (141 GB each)", 141, (1, 2, 1)),
    ("v5p-8 (4 chips x 95 GB)", 95, (1, 4, 1)),
)
KEPT_ROWS, MINIBATCHES = 32 * 8, 4


def paper_settings(mesh, max_new_tokens: int = 16_384, prompts: int = 32) -> mp.Settings:
    shards = mesh[0] * mesh[1]
    return mp.Settings(
        model=QWEN3_4B,
        prompts=prompts,
        samples=16,
        kept=8,
        prompt_width=1024,
        max_new_tokens=max_new_tokens,
        page_size=16,
        sparse=SparseSpec(budget=128, dense_layers=2),
        lora=LoRAConfig(rank=8),
        phi_trained=True,
        minibatches=MINIBATCHES,
        microbatches=max(1, prompts * 8 // MINIBATCHES // shards),
        mesh=mesh,
    )


def _trees():
    """theta's and phi's abstract parameters and AdamW states (the run's optimizer)."""
    tx = steps.make_optimizer(
        1e-6, warmup_steps=1, total_steps=100, weight_decay=0.0, max_grad_norm=1.0
    )
    params = mp.abstract_params(QWEN3_4B)
    lora = lora_shapes(QWEN3_4B, LoRAConfig(rank=8))
    return params, jax.eval_shape(tx.init, params), lora, jax.eval_shape(tx.init, lora)


def _fits(s: mp.Settings, trees, memory: int, phase: str) -> bool:
    """Whether `phase` fits with the rollout in its most chunks (its smallest peak)."""
    _, peaks = mp.estimate(s, *trees, chunks=mp.chunk_counts(s)[-1])
    return peaks[phase] <= mp.HEADROOM * memory


def longest_fit(mesh, memory: int, trees, phase: str) -> int:
    """The longest generation (a multiple of 1024 tokens) at which `phase` fits, the rest
    as the paper's (0: none)."""
    fits = [k for k in range(1, 17) if _fits(paper_settings(mesh, 1024 * k), trees, memory, phase)]
    return 1024 * max(fits, default=0)


def main() -> None:
    trees = _trees()
    for name, gb, mesh in DEVICES:
        memory, source = int(gb * mp.GB), f"({name})"
        s = paper_settings(mesh)
        print(f"## {name}, mesh {'x'.join(map(str, mesh))}")
        try:
            print(f"[memory] {mp.plan(s, *trees, memory, source).line()}")
        except UserError as e:  # the line at the most chunks, then the run's error
            most = mp.chunk_counts(s)[-1]
            parts, peaks = mp.estimate(s, *trees, chunks=most)
            limit = int(mp.HEADROOM * memory)
            print(f"[memory] {mp.Plan(s, most, limit, memory, source, parts, peaks).line()}")
            print(f"error: {e}")
        dense = AttentionSpec(page_size=s.page_size)
        print(
            f"per row: KV cache {mp.fmt(mp.cache_row_bytes(s, s.width))}, rollout outputs "
            f"{mp.fmt(mp.output_row_bytes(s))}, activations of theta's update "
            f"{mp.fmt(mp.activation_bytes(s, 1, dense))}, of phi's "
            f"{mp.fmt(mp.activation_bytes(s, 1, s.spec))}"
        )
        most = max(
            (
                p
                for p in range(1, 33)
                if 32 % p == 0 and _fits(paper_settings(mesh, prompts=p), trees, memory, "rollout")
            ),
            default=0,
        )
        print(f"most prompts per step whose rollout fits at 16384 tokens: {most}")
        longest = {p: longest_fit(mesh, memory, trees, p) for p in ("rollout", "update", "phi")}
        print(
            "longest generation that fits (tokens): "
            + ", ".join(f"{phase} {n}" for phase, n in longest.items())
            + "\n"
        )


if __name__ == "__main__":
    main()
