"""Test setup: CPU only, f32, 8 host devices for the mesh tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS",
    # 8 host devices for mesh tests; -O0 in the XLA backend halves compile time of tiny tests.
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
)

import jax  # noqa: E402

# f32 matmuls at full precision on every backend: on a GPU, XLA's default for f32 is TF32
# (10-bit mantissa), which put the plain-JAX references 4.6e-4 off the ieee Triton kernel
# on the H200 (docs/kernels.md). A no-op on CPU.
jax.config.update("jax_default_matmul_precision", "highest")
