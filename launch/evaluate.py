"""Evaluate a trained policy without training: greedy accuracy, mean@k, maj@k and pass@k
of the dense policy and of the sparse actor, on the run's eval data or any data source.

The program is dsparse_jax/commands/evaluate.py (installed: the dsparse-evaluate command).
"""

from dsparse_jax.commands.evaluate import console, main  # noqa: F401 -- main: tests load it

if __name__ == "__main__":
    console()
