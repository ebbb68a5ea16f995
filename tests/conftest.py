"""Test setup: CPU only, f32, 8 host devices for the mesh tests, one compilation cache."""

import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault(
    "XLA_FLAGS",
    # 8 host devices for mesh tests; -O0 in the XLA backend halves compile time of tiny tests.
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0",
)
# One persistent compilation cache per test run, made by the process pytest starts and
# inherited by the xdist workers and every launch/*.py subprocess they run: an end-to-end
# test whose runs compile the same programs (a resume, a second command of the same
# script) compiles them once. Entries are keyed by a hash of the program, its compile
# options and the XLA flags, so a hit is the same executable.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="dsparse_jax_jit_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

# In the test processes themselves only compiles of a second or more are written (jax's
# default): most of their thousands of small programs are never compiled twice.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
# f32 matmuls at full precision on every backend: on a GPU, XLA's default for f32 is TF32
# (10-bit mantissa), which put the plain-JAX references 4.6e-4 off the ieee Triton kernel
# on the H200 (docs/kernels.md). A no-op on CPU.
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionfinish(session):
    """The process that made the cache removes it (the workers end before it does)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
