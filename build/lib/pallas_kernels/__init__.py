"""Accelerator kernels beside the plain-JAX references they match (docs/kernels.md).

  sparse_decode  Pallas TPU block-sparse decode attention (scalar-prefetched page ids)
  sparse_train   Pallas TPU block-sparse training attention, forward + backward
  triton_decode  jax-triton split-K block-sparse decode attention (GPU)

Modules are imported on demand by dsparse_jax.model.attention_dispatch; triton / jax_triton
are imported only when a Triton kernel is launched.
"""
