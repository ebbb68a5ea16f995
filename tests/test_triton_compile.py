"""The Triton decode kernel compiles to sm_90 (H100/H200) cubins on this CPU host.

triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32)) runs Triton's whole
pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas) without a GPU, for the launch
configurations the dispatch produces (triton_decode.launch_config): bf16 and fp32,
head_dim 64-256, G 1-8, budgets 16-128 pages. Shared memory, registers per thread and
stack bytes are printed (pytest -s) and checked against the sm_90 limits. Skipped
without triton.
"""

import importlib.util
import json

import jax.numpy as jnp
import pytest

from dsparse_jax.attention.spec import LayerInfo
from pallas_kernels import triton_decode

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs the triton package (requirements.txt pins the wheel; no GPU needed)",
)

SM90_SHARED_BYTES = 232448  # 227 KiB: the most shared memory one block can have on sm_90
SM90_REGISTERS = 255  # per thread

# (dtype, head_dim, G, budget pages, batch, KV heads, softcap)
LAUNCHES = [
    (jnp.bfloat16, 64, 1, 16, 8, 8, None),
    (jnp.bfloat16, 128, 4, 64, 8, 8, 50.0),
    (jnp.bfloat16, 256, 4, 32, 16, 1, None),  # Gemma 3 1B: 4 query heads, 1 KV head
    (jnp.bfloat16, 128, 4, 32, 8, 8, None),  # Qwen3-4B (configs/qwen3_4b_math.py): 32 on 8
    (jnp.bfloat16, 256, 8, 128, 2, 4, 50.0),
    (jnp.float32, 128, 2, 32, 8, 8, None),
    (jnp.float32, 256, 8, 16, 64, 8, 50.0),
]


@pytest.mark.parametrize("dtype,h,g,budget,b,kv,cap", LAUNCHES)
def test_triton_decode_compiles_for_sm90(dtype, h, g, budget, b, kv, cap):
    layer = LayerInfo(index=1, window=None, softcap=cap, scale=h**-0.5)
    cfg, res = triton_decode.compile_for_gpu(b, kv, g, h, 32768, budget, 16, layer, dtype)
    launch = {"dtype": jnp.dtype(dtype).name, "head_dim": h, "G": g, "budget": budget}
    print(json.dumps(launch | {"grid": cfg.grid, "block_n": cfg.block_n} | res))
    assert 0 < res["shared_bytes"] <= SM90_SHARED_BYTES
    if res["registers"] is not None:  # cuobjdump ships with triton's wheel
        assert 0 < res["registers"] <= SM90_REGISTERS
