"""Main job: SFT warm start (cached), then RL. See configs/gemma_math.py.

  python launch/train.py --config=configs/gemma_math.py [--workdir=runs/gemma_math]
      [--config.rl.learning_rate=3e-4 ...] [--sft_only]

Writes <workdir>/metrics.jsonl, <workdir>/tb (TensorBoard), <workdir>/sft and
<workdir>/checkpoints (orbax). Rerunning the same command resumes.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gemma_math.py", "Path to a config file with get_config().", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default runs/<config.name>).")
_SFT_ONLY = flags.DEFINE_bool(
    "sft_only", False, "Stop after the SFT warm start (<workdir>/sft), before RL."
)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from dsparse_jax.train import run  # after flag parsing: imports jax

    config = _CONFIG.value
    workdir = _WORKDIR.value or os.path.join("runs", config.name)
    run.main(config, workdir, sft_only=_SFT_ONLY.value)


if __name__ == "__main__":
    app.run(main)
