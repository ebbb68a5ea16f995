"""Offline probe of the quality head's signal (docs/pruning.md): can a head on the policy's
hidden state at a checkpoint predict the final reward, given plenty of data?

  python -m dsparse_jax.harness.prune_head_probe --workdir=runs/prune_exp/dense [--batches=6]

Samples `--batches` x rl.prompts_per_step prompts x 16 rows from the run's newest policy
at rl.temperature, with pruning checkpoints at 24, 48 and 72 completion tokens that
keep all but one row per checkpoint and run that one on as a label row (so every row
completes and is featurised at every checkpoint). Trains the head (rl.prune.head_*
shape, 400 Adam steps) on the rows of 2/3 of the prompts and reports its AUC on the
rest, per checkpoint; prints JSON.
"""

import json
import os

from dsparse_jax.config import cli


def main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.prune_head_probe",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--workdir", required=True, help="a run directory")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--steps", type=int, default=400, help="Adam steps of the head")
    args = p.parse_args(argv)
    if not os.path.isdir(args.workdir):
        raise cli.UserError(f"--workdir: no such directory {args.workdir!r}")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsparse_jax.config.validate import validate
    from dsparse_jax.model import quality_head
    from dsparse_jax.rl.pruning_metrics import weighted_auc
    from dsparse_jax.sampling.pruning import PruneConfig
    from dsparse_jax.train import context, quality, rollouts, trained

    config = trained.workdir_config(args.workdir)
    validate(config)
    ctx = context.build(config)
    t = trained.load(ctx, args.workdir)
    c = config.rl
    positions = (24, 48, 72)
    prune = PruneConfig(positions=positions, sizes=(15, 14, 13), label_rows=1, layer=-1)
    scfg = rollouts.sampling_config(ctx, c.temperature, 16)
    hcfg = quality_head.QualityHeadConfig(ctx.model_cfg.d_model, hidden=c.prune.head_hidden)
    dummy = quality_head.init_quality_head(hcfg, jax.random.key(0))
    feats, labels, prompt_ids = [], [], []
    for i in range(args.batches):
        probs = ctx.task.problems(
            "train", 20_000_000 + i * c.prompts_per_step, c.prompts_per_step, 0
        )
        key = jax.random.key(100 + i)
        rolled = rollouts.roll_out(
            ctx, t.params, probs, key, scfg, ctx.spec, prune=prune, head=dummy, where="probe"
        )
        feats.append(np.asarray(rolled.prune.feats))
        labels.append(np.asarray(rolled.scored.rewards) >= 1.0)
        prompt_ids.append(i * c.prompts_per_step + np.arange(len(probs)).repeat(16))
    ctx.rewarder.close()
    f, y, pid = np.concatenate(feats), np.concatenate(labels), np.concatenate(prompt_ids)
    train = pid % 3 != 0
    out = {"rows": int(len(y)), "positive_rate": float(y.mean()), "auc_test": {}}
    tx = quality.make_tx(c.prune.head_learning_rate)
    for ci, pos in enumerate(positions):
        head, opt = quality.init(hcfg, tx, jax.random.key(1))
        x = jnp.asarray(f[train, ci])
        yy = jnp.asarray(y[train].astype(np.float32))
        head, opt, _, loss = quality.quality_head_update(
            head, opt, x, yy, jnp.ones_like(yy), tx=tx, steps=args.steps
        )
        s = np.asarray(quality_head.quality_probs(head, jnp.asarray(f[~train, ci])))
        s_tr = np.asarray(quality_head.quality_probs(head, x))
        out["auc_test"][pos] = weighted_auc(s, y[~train])
        out.setdefault("auc_train", {})[pos] = weighted_auc(s_tr, y[train])
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    cli.run(main)
