"""Build a tiny random checkpoint of any family with a tokenizer fitted to your data, so
that the real-data pipeline runs end to end on a laptop CPU in minutes.

  python launch/tiny_checkpoint.py --family=qwen3 --data=jsonl:my_data.jsonl --out=DIR
      [--vocab_size=512] [--seed=0]

--family: gemma2 | gemma3 | qwen2 | qwen3 | llama. --data: any data source train.py
reads (jsonl:, parquet: (verl's layout too), hf_disk:, tfds:). DIR gets config.json,
model.safetensors, the family's tokenizer files with its chat template, and
generation_config.json; then train on it with configs/tiny_real_data.py (the command is
printed). The weights are random: it tests the plumbing, not the method. Same error
convention as train.py.
"""

import json

from dsparse_jax.config import cli


def main(argv: list[str]) -> int:
    p = cli.ArgumentParser(prog="tiny_checkpoint.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, help="gemma2 | gemma3 | qwen2 | qwen3 | llama")
    p.add_argument("--data", required=True, help="a data source, e.g. jsonl:my_data.jsonl")
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--vocab_size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from dsparse_jax.data.sources import parse_uri
    from dsparse_jax.data.tokenizers.fit import FAMILIES

    if args.family not in FAMILIES:
        raise cli.UserError(f"--family: {args.family!r} is not one of {', '.join(FAMILIES)}")
    if args.vocab_size < 300:
        raise cli.UserError(
            f"--vocab_size: at least 300 (bytes and specials), got {args.vocab_size}"
        )
    try:
        parse_uri(args.data)
    except ValueError as e:
        raise cli.UserError(f"--data: {e}") from None
    from dsparse_jax.train import tiny_checkpoint

    try:
        summary = tiny_checkpoint.build(
            args.out, args.family, args.data, args.vocab_size, args.seed
        )
    except (FileNotFoundError, ValueError) as e:
        raise cli.UserError(f"--data: {e}") from None
    print(json.dumps(summary))
    print(
        "[tiny_checkpoint] next: python launch/train.py --config=configs/tiny_real_data.py "
        f"--workdir=runs/tiny_{args.family} --config.model.checkpoint_dir={args.out} "
        f"--config.data.source={args.data}"
    )
    return 0


def console() -> None:
    """The dsparse-tiny-checkpoint console command."""
    cli.run(main)
