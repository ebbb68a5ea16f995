"""The paper-reproduction harness, outside the library's core (the core never imports it):
the experiment (every variant from one SFT warm start, resumable; the sparsity sweep), its
report and figures, the mechanism diagnostics, the speculative and pruning tables. Run
from the source tree as `python -m dsparse_jax.harness.<module>` (docs/experiments.md)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The source tree: configs/, docs/ and launch/train.py, which the experiment's runs are."""
