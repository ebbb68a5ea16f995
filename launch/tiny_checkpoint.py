"""Build a tiny random checkpoint of any family with a tokenizer fitted to your data, so
that the real-data pipeline runs end to end on a laptop CPU in minutes.

The program is dsparse_jax/commands/tiny_checkpoint.py (installed: the dsparse-tiny-checkpoint command).
"""

from dsparse_jax.commands.tiny_checkpoint import console, main  # noqa: F401 -- main: tests load it

if __name__ == "__main__":
    console()
