"""The device memory plan of the paper's setting on three machines (docs/scaling.md,
"Device memory"), from train/memory_plan.py's estimate: nothing is allocated or compiled.

    python -m dsparse_jax.harness.memory_table

The setting is configs/qwen3_4b_math.py's (stated in docs/scaling.md): Qwen3-4B-Base
shapes (its preset), bf16 weights and compute, AdamW (optax: its states in the parameters'
dtype), DistillSparse (phi: LoRA on all seven maps, trained, f32), its prompt width,
generation length, page, sparse budget and dense layers, prompts x M samples, n kept,
minibatches, and microbatches of one row per device. Each machine's mesh splits the
weights over fsdp.
"""

from __future__ import annotations

import os

import jax

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.config import cli, schema
from dsparse_jax.errors import UserError
from dsparse_jax.model.config import preset
from dsparse_jax.model.lora import LoRAConfig, lora_shapes
from dsparse_jax.train import memory_plan as mp
from dsparse_jax.train import steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = cli.load_config(os.path.join(ROOT, "configs", "qwen3_4b_math.py"))
QWEN3_4B = preset(CONFIG.model.preset, **schema.model_overrides(CONFIG.model))

# (name, memory per device in GB, mesh (data, fsdp, tensor))
DEVICES = (
    ("1 x H100 (80 GB)", 80, (1, 1, 1)),
    ("2 x H200 (141 GB each)", 141, (1, 2, 1)),
    ("v5p-8 (4 chips x 95 GB)", 95, (1, 4, 1)),
)


def paper_settings(mesh, max_new_tokens: int | None = None, prompts: int | None = None):
    """configs/qwen3_4b_math.py's Settings on `mesh`, optionally shorter or fewer prompts."""
    c, shards = CONFIG, mesh[0] * mesh[1]
    prompts = prompts or c.rl.prompts_per_step
    kept = prompts * c.rl.samples_per_prompt
    return mp.Settings(
        model=QWEN3_4B,
        prompts=prompts,
        samples=c.rl.samples_generated,
        kept=c.rl.samples_per_prompt,
        prompt_width=c.data.max_prompt_tokens,
        max_new_tokens=max_new_tokens or c.data.max_new_tokens,
        page_size=c.attention.page_size,
        sparse=SparseSpec(budget=c.sparse.budget, dense_layers=c.sparse.dense_layers),
        lora=LoRAConfig(rank=c.lora.rank),
        phi_trained=True,
        minibatches=c.rl.minibatches,
        microbatches=max(1, kept // c.rl.minibatches // shards),
        mesh=mesh,
    )


def _trees():
    """theta's and phi's abstract parameters and AdamW states (the run's optimizer)."""
    tx = steps.make_optimizer(
        1e-6, warmup_steps=1, total_steps=100, weight_decay=0.0, max_grad_norm=1.0
    )
    params = mp.abstract_params(QWEN3_4B)
    lora = lora_shapes(QWEN3_4B, LoRAConfig(rank=CONFIG.lora.rank))
    return params, jax.eval_shape(tx.init, params), lora, jax.eval_shape(tx.init, lora)


def _fits(s: mp.Settings, trees, memory: int, phase: str) -> bool:
    """Whether `phase` fits with the rollout in its most chunks (its smallest peak)."""
    _, peaks = mp.estimate(s, *trees, chunks=mp.chunk_counts(s)[-1])
    return peaks[phase] <= mp.HEADROOM * memory


def longest_fit(mesh, memory: int, trees, phase: str) -> int:
    """The longest generation (a multiple of 1024 tokens) at which `phase` fits, the rest
    as the paper's (0: none)."""
    top = CONFIG.data.max_new_tokens // 1024
    fits = [
        k for k in range(1, top + 1) if _fits(paper_settings(mesh, 1024 * k), trees, memory, phase)
    ]
    return 1024 * max(fits, default=0)


def main() -> None:
    trees, P = _trees(), CONFIG.rl.prompts_per_step  # noqa: N806
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
                for p in range(1, P + 1)
                if P % p == 0 and _fits(paper_settings(mesh, prompts=p), trees, memory, "rollout")
            ),
            default=0,
        )
        print(f"most prompts per step whose rollout fits at {s.max_new_tokens} tokens: {most}")
        longest = {p: longest_fit(mesh, memory, trees, p) for p in ("rollout", "update", "phi")}
        print(
            "longest generation that fits (tokens): "
            + ", ".join(f"{phase} {n}" for phase, n in longest.items())
            + "\n"
        )


if __name__ == "__main__":
    main()
