"""Export a trained run as Hugging Face files.

  python launch/export.py --workdir=runs/gemma_math [--step=N] --out=DIR [--dtype=float32]

Writes, from the run's RL checkpoint (the newest, or --step; without RL checkpoints, the
SFT warm start):

  DIR/config.json, DIR/model.safetensors   theta, the dense policy, as a causal LM of its
                                           family (sharded above 4 GiB, with an index)
  DIR/tokenizer.json, tokenizer_config.json, the run's tokenizer for transformers'
  DIR/special_tokens_map.json,             AutoTokenizer, with its chat template and stop
  DIR/generation_config.json,              tokens: a checkpoint's tokenizer.json files
  DIR/tokenizer.model (SentencePiece)      copied, a SentencePiece model converted (fast
                                           and slow; needs requirements-hf.txt)
  DIR/phi_adapter/adapter_config.json,     phi, the sparse actor's LoRA, as a PEFT
  DIR/phi_adapter/adapter_model.safetensors adapter for the base in DIR (modes with phi)
  DIR/draft_head/draft_head.safetensors,   the learned draft head (rl.draft=draft_head
  DIR/draft_head/draft_head.json           runs), this project's layout:
                                           dsparse_jax.model.draft_head.load_exported
  DIR/export.json                          what was exported, from where

Load with transformers.AutoModelForCausalLM.from_pretrained(DIR) and
peft.PeftModel.from_pretrained(model, DIR/phi_adapter). Same error convention as
train.py.
"""

import json
import os
import sys

from dsparse_jax.config import cli

ADAPTER_DIR = "phi_adapter"
DRAFT_HEAD_DIR = "draft_head"


def main(argv: list[str]) -> int:
    _, overrides, rest = cli.split_config_args(argv)
    p = cli.ArgumentParser(prog="export.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", required=True, help="a run directory (launch/train.py)")
    p.add_argument("--step", type=int, default=None, help="this checkpoint step")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the model's)")
    args = p.parse_args(rest)
    if not os.path.isdir(args.workdir):
        raise cli.UserError(f"--workdir: no such directory {args.workdir!r}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise cli.UserError(f"--out: {args.out!r} exists and is not a directory")
    if args.dtype not in (None, "float32", "bfloat16"):
        raise cli.UserError(f"--dtype: must be float32 or bfloat16, got {args.dtype!r}")
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    from dsparse_jax.config.validate import validate
    from dsparse_jax.model import hf_checkpoint
    from dsparse_jax.train import context, trained

    config = trained.workdir_config(args.workdir)
    for dotted, text in overrides.items():
        cli.apply_override(config, dotted, text)
    validate(config)
    ctx = context.build(config)
    ctx.rewarder.close()  # not needed here
    t = trained.load(ctx, args.workdir, args.step)
    dtype = args.dtype or ctx.model_cfg.param_dtype
    hf = hf_checkpoint.hf_config_from(ctx.model_cfg)
    hf.update(pad_token_id=ctx.tok.pad_id, eos_token_id=ctx.tok.eos_id, bos_token_id=ctx.tok.bos_id)
    files = hf_checkpoint.export(args.out, t.params, ctx.model_cfg, dtype=dtype, hf_config=hf)
    try:
        files += ctx.tok.save_hf(args.out)
    except ImportError as e:  # transformers missing: one line naming requirements-hf.txt
        raise cli.UserError(f"the tokenizer: {e}") from e
    if t.lora is not None:
        adapter = hf_checkpoint.export_lora_adapter(
            os.path.join(args.out, ADAPTER_DIR),
            t.lora,
            rank=ctx.lora_cfg.rank,
            alpha=ctx.lora_cfg.alpha,
            base_model=os.path.abspath(args.out),
            dtype=dtype,
        )
        files += [os.path.join(ADAPTER_DIR, f) for f in adapter]
    if t.draft_head is not None:
        from dsparse_jax.model import draft_head

        head_files = draft_head.export(
            os.path.join(args.out, DRAFT_HEAD_DIR),
            t.draft_head,
            t.setup.drafting.head.layers,
            dtype,
        )
        files += [os.path.join(DRAFT_HEAD_DIR, f) for f in head_files]
    caveats = hf_checkpoint.transformers_caveats(ctx.model_cfg)
    for c in caveats:
        print(f"[export] WARNING: {c}", file=sys.stderr)
    manifest = {
        "workdir": os.path.abspath(args.workdir),
        "source": t.source,
        "rollout_mode": config.rl.rollout_mode,
        "dtype": dtype,
        "files": files,
        "phi_adapter": ADAPTER_DIR if t.lora is not None else None,
        "draft_head": DRAFT_HEAD_DIR if t.draft_head is not None else None,
        "sparse": dict(config.sparse) if t.setup.mode.actor_sparse else None,
        "transformers_caveats": caveats,
    }
    with open(os.path.join(args.out, "export.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    print(f"[export] {t.source} of {args.workdir} -> {args.out}: {', '.join(files)}")
    return 0


def console() -> None:
    """The dsparse-export console command."""
    cli.run(main)
