"""Main job: SFT warm start (cached), then RL. See configs/gemma_math.py.

  python launch/train.py --config=configs/gemma_math.py [--workdir=runs/gemma_math]
      [--config.rl.learning_rate=3e-4 ...] [--sft_only] [--verbose]

Writes <workdir>/metrics.jsonl, <workdir>/tb (TensorBoard), <workdir>/sft and
<workdir>/checkpoints (orbax). Rerunning the same command resumes. A bad invocation (an
unknown key, a bad value, a missing file, an unusable workdir, an incompatible checkpoint)
prints one line `error: ...` and exits with status 2; --verbose adds the traceback
(docs/reliability.md).
"""

import os

from dsparse_jax.config import cli

DEFAULT_CONFIG = "configs/gemma_math.py"


def main(argv: list[str]) -> int:
    path, overrides, rest = cli.split_config_args(argv)
    p = cli.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default=None, help="run directory (default runs/<config.name>)")
    p.add_argument("--sft_only", action="store_true", help="stop after the SFT warm start")
    args = p.parse_args(rest)
    config = cli.load_config(path or DEFAULT_CONFIG, overrides)
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from dsparse_jax.train import run  # imports jax

    run.main(config, args.workdir or os.path.join("runs", config.name), sft_only=args.sft_only)
    return 0


def console() -> None:
    """The dsparse-train console command."""
    cli.run(main)
