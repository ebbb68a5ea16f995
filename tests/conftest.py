"""Test setup: CPU only, f32, 8 host devices for the mesh tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS",
    # 8 host devices for mesh tests; -O0 in the XLA backend halves compile time of tiny tests.
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
)
