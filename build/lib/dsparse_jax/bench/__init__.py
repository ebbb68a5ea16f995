"""Benchmarks, outside the library's core (the core never imports them): rollout throughput
and decode steps, speculative drafters, decode kernels, one RL step's phases, the page
gather's slices. Run as `python -m dsparse_jax.bench.<module>` (docs/benchmarks.md); each
times attention through the model's dispatcher (model/attention_dispatch.py)."""
