"""The Pallas TPU kernels lower to Mosaic on this CPU host, at realistic shapes.

`jax.jit(f).trace(*ShapeDtypeStructs).lower(lowering_platforms=("tpu",))` runs the
Pallas -> Mosaic lowering (block shapes, SMEM index maps, DMAs, the ops used) without a
TPU and without executing or compiling anything; only libtpu's own compile is left out.
Every kernel (sparse decode: BlockSpec and multi-page DMA; training forward, dQ, dK/dV),
head_dim 128 and 256, bf16, GQA 2-8, budgets 16-64 pages, T up to 8k; then the whole
sampler (prefill + decode loop) and one GRPO update with attention.impl=pallas_tpu on a
Gemma-3-1B-shaped model (fewer layers), traced for TPU (spec.lowering_for). A shape the
kernels cannot run fails config validation, naming the field.
"""

import jax
import jax.numpy as jnp
import pytest

from dsparse_jax.attention.spec import AttentionSpec, LayerInfo, SparseSpec, lowering_for
from pallas_kernels import paged_decode, sparse_decode, sparse_train

sds = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
LAYER = LayerInfo(index=1, window=None, softcap=50.0, scale=256**-0.5)


def mosaic_calls(fn, *shapes) -> int:
    """Lowers fn for TPU; returns the number of Mosaic custom calls in the module."""
    with lowering_for("tpu"):
        lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("tpu",))
    return lowered.as_text().count("tpu_custom_call")


def decode_shapes(b, kv, g, h, s, p):
    return (
        sds((b, kv * g, h), BF16),
        sds((b, kv, s, h), BF16),
        sds((b, kv, s, h), BF16),
        sds((b,), jnp.int32),
        sds((b, kv, p), jnp.int32),
    )


@pytest.mark.parametrize("h,g,budget", [(128, 2, 16), (256, 4, 32), (256, 8, 64), (128, 8, 64)])
def test_decode_kernels_lower(h, g, budget):
    shapes = decode_shapes(4, 2, g, h, 8192, budget)
    for pages in (1, 8, budget):  # the DMA kernel: pages per copy group
        dma = lambda *a, pages=pages: paged_decode.sparse_decode_attention(
            *a, LAYER, 16, pages_per_step=pages, interpret=False
        )
        assert mosaic_calls(dma, *shapes) == 1
    for pages in (1, 8):  # the BlockSpec kernel: pages per grid step
        blocks = lambda *a, pages=pages: sparse_decode.sparse_decode_attention(
            *a, LAYER, 16, pages_per_step=pages, interpret=False
        )
        assert mosaic_calls(blocks, *shapes) == 1


def training_loss_grads(layer, page):
    """The gradients of a sum over the training kernel's output by q, k and v."""

    def loss_grads(q, k, v, ids, sq):
        f = lambda q, k, v: (
            sparse_train.sparse_sequence_attention(q, k, v, layer, ids, sq, page, interpret=False)
            .astype(jnp.float32)
            .sum()
        )
        return jax.grad(f, (0, 1, 2))(q, k, v)

    return loss_grads


def training_shapes(b, t, kv, g, h, budget):
    return (
        sds((b, t, kv * g, h), BF16),
        sds((b, t, kv, h), BF16),
        sds((b, t, kv, h), BF16),
        sds((b, t, kv, budget), jnp.int32),
        sds((b, t), bool),
    )


@pytest.mark.parametrize(
    "h,g,budget,t", [(256, 4, 64, 8192), (128, 8, 16, 8192), (256, 2, 32, 2048)]
)
def test_training_kernel_forward_and_gradients_lower(h, g, budget, t):
    shapes = training_shapes(1, t, 2, g, h, budget)
    assert mosaic_calls(training_loss_grads(LAYER, 16), *shapes) == 3  # forward, dQ, dK/dV


def gemma_like(num_layers=6):
    """Gemma 3 1B's attention and widths (head_dim 256, 4 query heads, 1 KV head, 5 local
    : 1 global) in bf16, with fewer layers and a small vocabulary: lowering cost only."""
    from flax import nnx

    from dsparse_jax.model import config as C
    from dsparse_jax.model.transformer import Transformer

    cfg = C.gemma3_1b().replace(
        num_layers=num_layers, vocab_size=4096, dtype="bfloat16", param_dtype="bfloat16"
    )
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0))))
    return cfg, graphdef, jax.tree.map(lambda x: sds(x.shape, x.dtype), state)


SPEC = AttentionSpec(
    impl="pallas_tpu", page_size=16, sparse=SparseSpec("centroid", budget=32, dense_layers=0)
)


def test_sampler_lowers_with_pallas_tpu():
    """The whole rollout program (prefill, the decode while_loop with page selection and
    the DMA decode kernel in its sparse global layer) lowers for TPU."""
    from dsparse_jax.sampling.sampler import Sampler, SamplingConfig

    cfg, graphdef, state = gemma_like()
    sampler = Sampler(graphdef)
    b, prompt = 4, 1024
    key = jax.eval_shape(lambda: jax.random.key(0))
    with lowering_for("tpu"):
        lowered = sampler._jitted.trace(
            state,
            sds((b, prompt), jnp.int32),
            sds((b,), jnp.int32),
            key,
            None,
            None,
            cfg=SamplingConfig(max_new_tokens=1024, eos_id=1, pad_id=0),
            spec=SPEC,
            lora_scale=1.0,
        ).lower(lowering_platforms=("tpu",))
    assert lowered.as_text().count("tpu_custom_call") == 1  # one global layer, one step body


def test_grpo_update_lowers_with_pallas_tpu():
    """One GRPO update whose trainer is sparse on the rollout's record (sparse_train mode):
    the training kernel's forward, dQ and dK/dV in the global layer, for TPU."""
    import optax

    from dsparse_jax.attention.selection import PageRecord
    from dsparse_jax.train import steps
    from dsparse_jax.train.grpo import GRPOSettings, grpo_update

    cfg, graphdef, state = gemma_like()
    tx = steps.make_optimizer(
        1e-5, warmup_steps=1, total_steps=10, weight_decay=0.0, max_grad_norm=1.0
    )
    opt_state = jax.eval_shape(tx.init, state)
    b, t, p = 2, 2048, SPEC.sparse.max_pages
    batch = {
        "tokens": sds((b, t), jnp.int32),
        "mask": sds((b, t), jnp.float32),
        "old_logp": sds((b, t), jnp.float32),
        "adv": sds((b,), jnp.float32),
        "pages": {
            5: PageRecord(sds((b, t, 1, p), jnp.int32), sds((b, t), bool), dense_prefix=1024)
        },
    }
    settings = GRPOSettings(spec=SPEC)
    assert isinstance(tx, optax.GradientTransformation)
    fn = lambda st, os, mb: grpo_update(st, os, mb, graphdef=graphdef, tx=tx, settings=settings)
    assert mosaic_calls(fn, state, opt_state, batch) == 3


def qwen3_4b_attention():
    """(ModelConfig, AttentionSpec, generation length) of configs/qwen3_4b_math.py: head_dim
    128, 32 query heads on 8 KV heads (GQA 4), its page and budget."""
    import os

    from dsparse_jax.config import schema
    from dsparse_jax.config.cli import load_config
    from dsparse_jax.model.config import preset

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = load_config(os.path.join(root, "configs", "qwen3_4b_math.py"))
    cfg = preset(c.model.preset, **schema.model_overrides(c.model))
    sparse = SparseSpec("centroid", budget=c.sparse.budget, dense_layers=c.sparse.dense_layers)
    spec = AttentionSpec(impl="pallas_tpu", page_size=c.attention.page_size, sparse=sparse)
    return cfg, spec, c.data.max_new_tokens + c.data.max_prompt_tokens


def test_qwen3_4b_config_kernels_lower():
    """The paper's config (configs/qwen3_4b_math.py): the decode kernels over its whole KV
    cache and the training kernel (forward, dQ, dK/dV) over its full sequence lower."""
    cfg, spec, seq = qwen3_4b_attention()
    assert (cfg.head_dim, cfg.group_size, spec.sparse.budget, seq) == (128, 4, 32, 17408)
    layer = LayerInfo(index=2, window=None, softcap=cfg.attn_softcap, scale=cfg.scale)
    shapes = decode_shapes(4, cfg.num_kv_heads, cfg.group_size, cfg.head_dim, seq, 32)
    for kernel in (paged_decode, sparse_decode):
        fn = lambda *a, kernel=kernel: kernel.sparse_decode_attention(
            *a, layer, spec.page_size, pages_per_step=8, interpret=False
        )
        assert mosaic_calls(fn, *shapes) == 1
    kv, h, budget = cfg.num_kv_heads, cfg.head_dim, spec.sparse.budget
    assert (
        mosaic_calls(
            training_loss_grads(layer, spec.page_size),
            *training_shapes(1, seq, kv, cfg.group_size, h, budget),
        )
        == 3
    )


def test_config_rejects_page_sizes_the_kernels_cannot_tile():
    """attention.impl=pallas_tpu with a page that is not a whole number of sublane tiles
    (16 rows in bf16, 8 in f32) fails validation with one line naming the field; the
    kernel raises the same rule when lowered for TPU."""
    from dsparse_jax.config import schema, validate

    c = schema.defaults()
    c.attention.impl = "pallas_tpu"
    c.model.dtype = "bfloat16"
    c.attention.page_size = 8
    with pytest.raises(validate.ConfigError, match=r"^config\.attention\.page_size: .*16") as e:
        validate.validate(c)
    assert "\n" not in str(e.value)
    c.model.dtype = "float32"
    validate.validate(c)  # 8 rows of f32 are one tile
    c.attention.impl = "xla"
    c.model.dtype = "bfloat16"
    validate.validate(c)  # the XLA reference has no such rule
    with pytest.raises(ValueError, match="multiple of 16"):
        mosaic_calls(
            lambda *a: paged_decode.sparse_decode_attention(*a, LAYER, 8, interpret=False),
            *decode_shapes(1, 1, 2, 128, 256, 4),
        )
