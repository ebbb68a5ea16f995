"""The shipped configs (installed as dsparse_jax.configs): configs/<name>.py, --config=<name>."""
