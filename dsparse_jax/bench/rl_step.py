"""One full RL step per rollout mode, in one process, with a phase breakdown, at several
generation lengths (task.num_terms: ~11 completion tokens per term).

  python -m dsparse_jax.bench.rl_step --terms=4,8,16 --modes=dense,distillsparse --steps=3 \
      [--config=configs/gemma_math.py --config.sparse.budget=6 ...]

  python -m dsparse_jax.bench.rl_step --modes=distillsparse --vary=distill.row_stride=1,2 ...

Per (length, mode[, value of the --vary field]): one untimed step (compiles), then the
median over --steps timed steps of each phase (train/phases.py): rollout, score (rewards), select
(the oversampling filter), recompute (dense teacher-forced forward, plus the actor's twin
and the mismatch metrics in sparse modes), update_theta, update_phi (the sparse + LoRA
teacher-forced forward and backward, and the phi optimizer step). Weights are the fresh random init unless
--params_from names a run directory with a finished SFT warm start (<dir>/sft): a
random model often emits EOS after a few dozen tokens, so the timing benchmark uses
--ignore_eos=true (default): every completion runs to the full generation budget, as in
rollout benchmarks that fix the output length (rewards, and hence the gradients, are then
mostly zero; the work per phase is the same). --vary=FIELD=A,B runs every mode at each
value of one config field (any but the mode; each row's run context is built from its
own config), side by side in the process, and prints each phase's time at every value
over its time at the first. Prints a table and writes JSON to --out.
"""

import argparse
import copy
import dataclasses
import itertools
import statistics

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import files

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
    from dsparse_jax.train import sft

    restored = sft.restore(ctx, workdir)
    if restored is None:
        raise UserError(f"--params_from: no SFT checkpoint under {workdir}/sft")
    return restored[0]


class _NoEos:
    """The run's tokenizer with an EOS id no token has and no other stop tokens: rollouts
    run to the budget."""

    def __init__(self, tok):
        self._tok = tok
        self.eos_id = -1
        self.stop_ids = frozenset({-1})

    def __getattr__(self, name):
        return getattr(self._tok, name)


def parse_args(argv: list[str]):
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.bench.rl_step", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--terms", type=cli.comma_list(int), default=[4, 8, 16], help="task.num_terms")
    p.add_argument(
        "--modes", type=cli.comma_list(), default=["dense", "distillsparse"], help="rl.rollout_mode"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per (length, mode)")
    p.add_argument("--out", default="bench_rl_step.json", help="JSON results path")
    p.add_argument("--params_from", default=None, help="run dir whose SFT (<dir>/sft) is theta")
    p.add_argument(
        "--ignore_eos",
        type=cli.boolean,
        nargs="?",
        const=True,
        default=True,
        help="generate the full budget (EOS never ends a completion)",
    )
    p.add_argument(
        "--vary",
        type=_vary,
        default=None,
        help="FIELD=A,B: run every mode at each value of one config field (distill.row_stride=1,2)",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: at least 1 timed step, got {args.steps}")
    return args


def _vary(text: str) -> tuple[str, list[str]]:
    """'distill.row_stride=1,2' -> ('distill.row_stride', ['1', '2'])."""
    field, _, values = text.partition("=")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not field or not items:
        raise argparse.ArgumentTypeError(f"expected FIELD=A,B, got {text!r}")
    if field.strip() == "rl.rollout_mode":
        raise argparse.ArgumentTypeError("the rollout mode is varied with --modes")
    return field.strip(), list(dict.fromkeys(items))


def _label(mode: str, field: str | None, value: str | None) -> str:
    """A row's name: the mode, and the --vary field's value when one is varied."""
    return f"{mode} {field}={value}" if field else mode


def _row_config(config, terms: int, mode: str, field: str | None, value: str | None):
    """The config of one (length, mode, value) row: config with task.num_terms, the
    rollout mode and the --vary field set (a UserError names a bad field or value)."""
    c = copy.deepcopy(config)
    c.task.num_terms = terms
    if not c.task.repeat_terms:
        c.task.num_vars = max(c.task.num_vars, terms)
    c.rl.rollout_mode = mode
    if field:
        cli.apply_override(c, field, value)
    return c


def _medians(timed: list[dict]) -> dict:
    """Median of each phase over the timed steps, the mean completion length, and the
    tokens phi trained on (distill.row_stride) where phi trains."""
    med = {p: statistics.median(t.get(p, 0.0) for t in timed) for p in PHASES}
    med["response_length_mean"] = statistics.mean(t["response_length_mean"] for t in timed)
    if "phi_num_tokens" in timed[0]:
        med["phi_num_tokens"] = statistics.mean(t["phi_num_tokens"] for t in timed)
    return med


def _print_against_dense(terms: int, rows: dict, field: str | None, value: str | None) -> None:
    """Each row's step and rollout against the dense row measured at the same value."""
    d = rows.get("dense")
    if d is None:
        return
    print(
        f"[bench] terms {terms}: dense rollout share {d['time_rollout'] / d['time_step']:.1%}",
        flush=True,
    )
    for mode, r in rows.items():
        if mode != "dense":
            print(
                f"[bench] terms {terms}: {_label(mode, field, value)} speedup vs dense "
                f"{d['time_step'] / r['time_step']:.2f}x; rollout "
                f"{d['time_rollout'] / max(r['time_rollout'], 1e-9):.2f}x; "
                f"distillation phases / dense update "
                f"{r['time_update_phi'] / max(d['time_update_theta'], 1e-9):.2f}",
                flush=True,
            )


def bench(config, args):
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp

    from dsparse_jax.config.validate import validate
    from dsparse_jax.train import context, phases, rl_state, trainables

    field, values = args.vary or (None, [None])
    configs = {}  # every row's config checked before the first compile
    for terms, mode, value in itertools.product(args.terms, args.modes, values):
        c = configs[terms, mode, value] = _row_config(config, terms, mode, field, value)
        validate(c)
    results = []
    for terms in args.terms:
        by_value = {}  # value -> mode -> medians
        for value in values:
            rows = by_value[value] = {}
            for mode in args.modes:
                c = configs[terms, mode, value]
                # Built from the row's own config: the varied field may shape the model,
                # the sparse spec or LoRA, which the context derives once.
                ctx = context.build(c)
                params0 = (
                    _sft_params(ctx, args.params_from) if args.params_from else ctx.init_params
                )
                tok = _NoEos(ctx.tok) if args.ignore_eos else ctx.tok
                run = dataclasses.replace(ctx, tok=tok)
                setup = rl_state.make_setup(run)
                st = trainables.init_state(run, setup, jax.tree.map(jnp.copy, params0))
                rng = jax.random.key(0)
                timed = []
                for step in range(args.steps + 1):
                    rng, k = jax.random.split(rng)
                    st, m = phases.rl_step(run, setup, st, k, step)
                    if step:
                        timed.append(m)
                med = _medians(timed)
                budget = ctx.task.completion_budget()
                med.update(
                    mode=mode,
                    **({field: value} if field else {}),
                    num_terms=terms,
                    completion_budget=budget,
                    batch_rows=c.rl.prompts_per_step * c.rl.samples_per_prompt,
                    ignore_eos=args.ignore_eos,
                )
                rows[mode] = med
                results.append(med)
                print(
                    f"[bench] terms {terms} (budget {budget} tokens) {_label(mode, field, value)}: "
                    + " ".join(f"{p[5:]} {med[p]:.3f}s" for p in PHASES)
                    + f" | mean length {med['response_length_mean']:.1f}",
                    flush=True,
                )
            _print_against_dense(terms, rows, field, value)
        for value in values[1:]:
            for mode in args.modes:
                first, r = by_value[values[0]][mode], by_value[value][mode]
                r["ratio_to_first"] = {
                    p: r[p] / first[p] for p in PHASES if first[p] > 0 and r[p] > 0
                }
                print(
                    f"[bench] terms {terms}: {_label(mode, field, value)} / ={values[0]}: "
                    + " ".join(f"{p[5:]} {x:.2f}x" for p, x in r["ratio_to_first"].items()),
                    flush=True,
                )
    files.write_json_atomic(args.out, results, indent=2)
    print(f"[bench] wrote {args.out}", flush=True)


def main(argv: list[str]) -> int:
    path, overrides, rest = cli.split_config_args(argv)
    args = parse_args(rest)
    bench(cli.load_config(path or "configs/gemma_math.py", overrides), args)
    return 0


if __name__ == "__main__":
    cli.run(main)
