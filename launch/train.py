"""Main job: SFT warm start (cached), then RL. See configs/gemma_math.py.

The program is dsparse_jax/commands/train.py (installed: the dsparse-train command).
"""

from dsparse_jax.commands.train import console, main  # noqa: F401 -- main: tests load it

if __name__ == "__main__":
    console()
