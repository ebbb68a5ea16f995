"""Export a trained run as Hugging Face files.

The program is dsparse_jax/commands/export.py (installed: the dsparse-export command).
"""

from dsparse_jax.commands.export import console, main  # noqa: F401 -- main: tests load it

if __name__ == "__main__":
    console()
