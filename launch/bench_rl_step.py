"""One full RL step per rollout mode, in one process, with a phase breakdown, at several
generation lengths (task.num_terms: ~11 completion tokens per term).

  python launch/bench_rl_step.py --terms=4,8,16 --modes=dense,distillsparse --steps=3 \
      [--attention=old,new] [--config=configs/gemma_math.py --config.sparse.budget=6 ...]

Per (length, mode, attention path): one untimed step (compiles), then the median over
--steps timed steps of each phase (train/phases.py): rollout, score (rewards), select
(the oversampling filter), recompute (dense teacher-forced forward, plus the actor's twin
and the mismatch metrics in sparse modes), update_theta, update_phi (the sparse + LoRA
teacher-forced forward and backward, and the phi optimizer step). Weights are the fresh random init unless
--params_from names a run directory with a finished SFT warm start (<dir>/sft): a
random model often emits EOS after a few dozen tokens, so the timing benchmark uses
--ignore_eos (default): every completion runs to the full generation budget, as in
rollout benchmarks that fix the output length (rewards, and hence the gradients, are then
mostly zero; the work per phase is the same). Prints a table and writes JSON to --out.
"""

import contextlib
import copy
import dataclasses
import json
import os
import statistics
import sys

from absl import flags, logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsparse_jax.config import cli  # noqa: E402
from dsparse_jax.errors import UserError  # noqa: E402

_TERMS = flags.DEFINE_list("terms", ["4", "8", "16"], "task.num_terms values (lengths).")
_MODES = flags.DEFINE_list("modes", ["dense", "distillsparse"], "rl.rollout_mode values.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per (length, mode), after 1 warmup.")
_OUT = flags.DEFINE_string("out", "bench_rl_step.json", "JSON results path.")
_PARAMS_FROM = flags.DEFINE_string(
    "params_from", None, "Run dir whose SFT checkpoint (<dir>/sft) gives theta."
)
_ATTENTION = flags.DEFINE_list(
    "attention",
    ["new"],
    "Teacher-forced attention paths to compare: new (causal block skip; the sparse twin "
    "as decode steps past the prompt) | old (the full [T, T] masked paths they replaced).",
)
_IGNORE_EOS = flags.DEFINE_bool(
    "ignore_eos", True, "Generate the full budget (EOS never ends a completion)."
)

PHASES = (  # train/phases.py: time_<phase> of every phase, and their sum
    "time_rollout",
    "time_score",
    "time_select",
    "time_recompute",
    "time_update_theta",
    "time_update_phi",
    "time_step",
)


def _sft_params(ctx, workdir):
    from dsparse_jax.reliability import checkpoints
    from dsparse_jax.train import sft

    tx = sft._optimizer(ctx.config.sft)
    ckpt = checkpoints.Checkpointer(workdir, "sft", keep=2)
    step = ckpt.latest_step()
    if step is None:
        raise UserError(f"--params_from: no SFT checkpoint under {workdir}/sft")
    import jax

    tree = ckpt.restore(
        step,
        checkpoints.to_saveable(
            ctx.init_params, tx.init(ctx.init_params), rng=jax.random.key(0), step=0
        ),
    )
    ckpt.close()
    return checkpoints.from_saveable(tree, ctx.init_params, tx.init(ctx.init_params))[0]


class _NoEos:
    """The run's tokenizer with an EOS id no token has: rollouts run to the budget."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_id = -1

    def __getattr__(self, name):
        return getattr(self._tok, name)


@contextlib.contextmanager
def _attention_paths(which: str):
    """new: this tree's teacher-forced attention. old: the full [T, T] masked paths the
    new ones replaced and are tested equal to (tests/test_model.py, test_sparse_attention):
    no causal block skip (dense._full_attention) and the sparse twin over the whole
    sequence's [B, K, T, T] allowed mask (PageRecord.dense_prefix=None). Caches are
    cleared on entry and exit: the paths are chosen at trace time."""
    import jax

    from dsparse_jax.attention import dense
    from dsparse_jax.sampling import sampler

    if which not in ("new", "old"):
        raise UserError(f"--attention: unknown path {which!r} (new | old)")
    block, pages = dense.CAUSAL_BLOCK, sampler.Rollout.pages
    jax.clear_caches()
    if which == "old":
        dense.CAUSAL_BLOCK = 1 << 30
        sampler.Rollout.pages = lambda r: (
            None
            if pages(r) is None
            else {i: dataclasses.replace(x, dense_prefix=None) for i, x in pages(r).items()}
        )
    try:
        yield
    finally:
        dense.CAUSAL_BLOCK, sampler.Rollout.pages = block, pages
        jax.clear_caches()


def main(config):
    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp

    from dsparse_jax.config.validate import validate
    from dsparse_jax.train import context, rl_loop

    results = []
    for terms in map(int, _TERMS.value):
        base = copy.deepcopy(config)
        base.task.num_terms = terms
        if not base.task.repeat_terms:
            base.task.num_vars = max(base.task.num_vars, terms)
        ctx = context.build(base)
        params0 = _sft_params(ctx, _PARAMS_FROM.value) if _PARAMS_FROM.value else ctx.init_params
        budget = ctx.task.completion_budget()
        row = {}
        for mode, path in [(m, a) for a in _ATTENTION.value for m in _MODES.value]:
            c = copy.deepcopy(base)
            c.rl.rollout_mode = mode
            validate(c)
            tok = _NoEos(ctx.tok) if _IGNORE_EOS.value else ctx.tok
            run = context.RunContext(**{**ctx.__dict__, "config": c, "tok": tok})
            setup = rl_loop.make_setup(run)
            st = rl_loop.init_state(run, setup, jax.tree.map(jnp.copy, params0))
            rng = jax.random.key(0)
            timed = []
            with _attention_paths(path):
                for step in range(_STEPS.value + 1):
                    rng, k = jax.random.split(rng)
                    st, m = rl_loop.rl_step(run, setup, st, k, step)
                    if step:
                        timed.append(m)
            med = {p: statistics.median(t.get(p, 0.0) for t in timed) for p in PHASES}
            med["response_length_mean"] = statistics.mean(t["response_length_mean"] for t in timed)
            med.update(
                mode=mode,
                attention=path,
                num_terms=terms,
                completion_budget=budget,
                batch_rows=c.rl.prompts_per_step * c.rl.samples_per_prompt,
                ignore_eos=_IGNORE_EOS.value,
            )
            name = mode if path == "new" else f"{mode} ({path} attention)"
            row[name] = med
            results.append(med)
            print(
                f"[bench] terms {terms} (budget {budget} tokens) {name}: "
                + " ".join(f"{p[5:]} {med[p]:.3f}s" for p in PHASES)
                + f" | mean length {med['response_length_mean']:.1f}",
                flush=True,
            )
        for mode in _MODES.value:
            old, new = row.get(f"{mode} (old attention)"), row.get(mode)
            if old and new:
                print(
                    f"[bench] terms {terms}: {mode} new vs old attention: step "
                    f"{old['time_step'] / new['time_step']:.2f}x faster; "
                    + " ".join(
                        f"{p[5:]} {old[p] / max(new[p], 1e-9):.2f}x"
                        for p in ("time_recompute", "time_update_theta", "time_update_phi")
                    ),
                    flush=True,
                )
        if "dense" in row:  # the new attention paths
            d = row["dense"]
            print(
                f"[bench] terms {terms}: dense rollout share "
                f"{d['time_rollout'] / d['time_step']:.1%}",
                flush=True,
            )
            for mode, r in row.items():
                if mode != "dense" and r["attention"] == "new":
                    distill_cost = r["time_update_phi"]
                    print(
                        f"[bench] terms {terms}: {mode} speedup vs dense "
                        f"{d['time_step'] / r['time_step']:.2f}x; rollout "
                        f"{d['time_rollout'] / max(r['time_rollout'], 1e-9):.2f}x; "
                        f"distillation phases / dense update "
                        f"{distill_cost / max(d['time_update_theta'], 1e-9):.2f}",
                        flush=True,
                    )
    with open(_OUT.value, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[bench] wrote {_OUT.value}", flush=True)


def _entry(argv: list[str]) -> int:
    """--config=FILE and --config.a.b=v (config/cli.py), the other flags by absl."""
    path, overrides, rest = cli.split_config_args(argv)
    if "--help" in rest or "-h" in rest:
        print(__doc__ + "\n" + flags.FLAGS.main_module_help())
        return 0
    try:
        flags.FLAGS([sys.argv[0], *rest])
    except flags.Error as e:
        raise UserError(str(e)) from None
    main(cli.load_config(path or "configs/gemma_math.py", overrides))
    return 0


if __name__ == "__main__":
    cli.run(_entry)
