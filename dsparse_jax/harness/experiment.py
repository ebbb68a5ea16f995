"""The paper-replication experiment (issue 7): every rollout mode from ONE shared SFT warm
start, the same seeds and step budget, each run resumable in its own workdir; the
sparsity-level sweep; the report (docs/results.md). Usage: docs/experiments.md.

  python -m dsparse_jax.harness.experiment run --expdir=runs/exp [--quick] [--seeds=0,1]
      [--steps=N] [--variants=dense,sparse,...] [--config=...] [--config.rl.learning_rate=1e-4]
  python -m dsparse_jax.harness.experiment sweep --expdir=runs/exp [--budgets=3,4,6,8]
  python -m dsparse_jax.harness.experiment report --expdir=runs/exp [--out=docs/results.md]
  python -m dsparse_jax.harness.experiment status --expdir=runs/exp [...]  (the plan, no runs)

`--config.a.b=v` overrides apply to every run and the SFT warm start (an experiment
directory started with the earlier `launch/experiment.py ... --set a.b=v` resumes with
`--config.a.b=v`: experiment.json and experiment_run.json keep the same overrides).

`run` first trains the SFT warm start once in <expdir>/sft_base (a child process:
`launch/train.py --sft_only`, the main job's own entry point), then
gives every run a copy of it as <workdir>/sft (sft.warm_start reuses it), then launches
each run as `python launch/train.py --config=... --workdir=<expdir>/<variant>_s<seed>
--config.x=y ...`. Rerunning the same command resumes: a finished run is skipped, an
unfinished one continues from its newest checkpoint (launch/train.py resumes by itself).
Runs that fail are reported at the end (exit status 1) and do not stop the others.

The parent process never imports jax except in `sweep` (after the SFT child has exited),
so the runs own the accelerator.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.harness import ROOT, results
from dsparse_jax.harness.variants import ALIASES, DESCRIPTIONS, MAIN, VARIANTS
from dsparse_jax.reliability.files import write_json_atomic
from dsparse_jax.report.metrics import read_metrics

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "gemma_math.py")
TRAIN = os.path.join(ROOT, "launch", "train.py")  # the main job's entry point: every run

# Every run (below the quick preset and --config.a.b=v): completion-position bins of 16 tokens for
# the mismatch metrics (the config's 256 is meant for long generations; the embedded
# task's completions are 28-82 tokens, which would all fall into one bin).
BASE = {"metrics.position_bin": 16}

# --quick: a 2-core CPU budget of <= 20 minutes for the main comparison (2 seeds): the
# default task and SFT warm start (so a quick run can reuse a full run's sft_base), the
# sparsity level of the documented sweep (budget 4 of 9 pages: sink + 2 recent + 1 chosen),
# 20 RL steps, evaluation on 64 problems every 5 steps with mean@2, no TensorBoard. Any of
# these can be overridden with --config.a.b=v.
QUICK = {
    "sparse.budget": 4,
    "rl.num_steps": 20,
    "eval.num_problems": 64,
    "eval.every": 5,
    "eval.mean_at_k": 2,
    "checkpoint.every": 5,
    "log.tensorboard": False,
}
QUICK_VARIANTS = MAIN
SFT_KEYS = ("seed", "model.", "task.", "sft.", "data.", "tokenizer.", "attention.")
DEFAULT_BUDGETS = "3,4,5,6,8,10"


# ---------------------------------------------------------------------------------- config
def fmt_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def override_args(overrides: dict) -> list[str]:
    return [f"--config.{k}={fmt_value(v)}" for k, v in overrides.items()]


def resolve_variants(spec: str | None, quick: bool) -> list[str]:
    if not spec:
        return list(QUICK_VARIANTS if quick else VARIANTS)
    if spec == "all":
        return list(VARIANTS)
    out = []
    for name in spec.split(","):
        name = ALIASES.get(name.strip(), name.strip())
        if name not in VARIANTS:
            raise UserError(
                f"unknown variant {name!r}; known: {', '.join(VARIANTS)} "
                f"(aliases {', '.join(ALIASES)})"
            )
        if name not in out:
            out.append(name)
    return out


def common_overrides(args) -> dict:
    """BASE < quick preset < --config.a.b=v (args.overrides) < --steps (the same for every
    run)."""
    out = dict(BASE)
    if args.quick:
        out.update(QUICK)
    for key in args.overrides:
        if any(key == k for v in VARIANTS.values() for k in v):
            raise UserError(f"--config.{key}: this field defines the variants; use --variants")
        if key == "seed":
            raise UserError("--config.seed: use --seeds")
    out.update(args.overrides)
    if args.steps is not None:
        out["rl.num_steps"] = args.steps
    return out


def run_overrides(config_path: str, common: dict, variant: str, seed: int) -> dict:
    out = dict(common)
    out["seed"] = seed
    v = dict(VARIANTS[variant])
    if v.get("rl.samples_generated") == "2n":
        n = cli.load_config(config_path, out).rl.samples_per_prompt
        v["rl.samples_generated"] = 2 * n
    out.update(v)
    return out


def run_name(variant: str, seed: int) -> str:
    return f"{variant}_s{seed}"


def plan_runs(variants: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """Every variant at the first seed first (a partial sweep covers every mode), then the
    main comparison's other seeds."""
    runs = [(v, seeds[0]) for v in variants]
    for s in seeds[1:]:
        runs += [(v, s) for v in variants if v in MAIN]
    return runs


# ------------------------------------------------------------------------------- run state
def _read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_state(workdir: str, num_steps: int) -> tuple[str, int]:
    """('done' | 'partial' | 'new', last RL step logged). Done: summary.json written (the
    run's last act) after RL reached num_steps with the final evaluation logged."""
    records = read_metrics(workdir)
    rl_steps = [r["step"] for r in records if r["phase"] == "rl"]
    eval_steps = [r["step"] for r in records if r["phase"] == "eval"]
    last = max(rl_steps, default=0)
    if (
        os.path.exists(os.path.join(workdir, "summary.json"))
        and last >= num_steps
        and max(eval_steps, default=-1) >= num_steps
    ):
        return "done", last
    return ("partial" if records else "new"), last


def _check_same(path: str, key: str, current: dict, what: str) -> None:
    """A workdir started with other settings is not silently mixed with these."""
    old = _read_json(path)
    if old is None:
        return
    before = {k: fmt_value(v) for k, v in old.get(key, {}).items() if k != "rl.num_steps"}
    now = {k: fmt_value(v) for k, v in current.items() if k != "rl.num_steps"}
    if before != now:
        diff = sorted(set(before.items()) ^ set(now.items()))
        raise UserError(
            f"{what} was started with other settings (differences: {diff}); "
            f"use another --expdir or delete {os.path.dirname(path)}"
        )


# ------------------------------------------------------------------------------ processes
def _child_env(args) -> dict:
    env = dict(os.environ)
    if args.compile_cache and "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(args.compile_cache)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _launch(cmd: list[str], log_path: str, env: dict, verbose: bool) -> tuple[int, float]:
    """Runs cmd with stdout+stderr appended to log_path (and echoed with --verbose)."""
    t0 = time.time()
    with open(log_path, "a") as log:
        log.write(
            f"\n=== {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(cmd)}\n"
        )
        log.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1
        )
        try:
            for line in proc.stdout:
                log.write(line)
                if verbose:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            rc = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the run (it resumes later)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    return rc, time.time() - t0


def _tail(path: str, n: int = 25) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def ensure_sft_base(args, common: dict, seed: int) -> str | None:
    """Trains (or resumes, or reuses) the shared SFT warm start in <expdir>/sft_base (None
    when the config disables SFT, e.g. real data from a pretrained checkpoint)."""
    base = os.path.join(args.expdir, "sft_base")
    os.makedirs(base, exist_ok=True)
    if not cli.load_config(args.config, common).sft.get("enabled", True):
        print(
            "[experiment] sft.enabled=False: no SFT warm start (RL starts from the "
            "initial weights)",
            flush=True,
        )
        return None
    sft_over = {k: v for k, v in common.items() if k.startswith(SFT_KEYS)}
    sft_over["seed"] = seed
    meta_path = os.path.join(base, "experiment_sft.json")
    _check_same(meta_path, "overrides", sft_over, "the SFT warm start in " + base)
    if os.path.exists(os.path.join(base, "sft", "DONE.json")):
        print(f"[experiment] SFT warm start: reusing {base}/sft", flush=True)
        return base
    meta = _read_json(meta_path) or {
        "overrides": {k: fmt_value(v) for k, v in sft_over.items()},
        "attempts": [],
    }
    cmd = [
        sys.executable,
        TRAIN,
        f"--config={args.config}",
        f"--workdir={base}",
        "--sft_only",
        *override_args(sft_over),
    ]
    print(f"[experiment] SFT warm start in {base} (log {base}/train.log)", flush=True)
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rc, wall = _launch(cmd, os.path.join(base, "train.log"), _child_env(args), args.verbose)
    meta["attempts"].append({"start": started, "wall_s": wall, "rc": rc})
    write_json_atomic(meta_path, meta, indent=2)
    if rc != 0 or not os.path.exists(os.path.join(base, "sft", "DONE.json")):
        raise SystemExit(
            f"[experiment] SFT warm start failed (rc {rc}):\n"
            + _tail(os.path.join(base, "train.log"))
        )
    print(f"[experiment] SFT warm start done in {wall:.0f}s", flush=True)
    return base


def give_sft(base: str | None, workdir: str) -> None:
    """<workdir>/sft = a copy of the shared warm start (sft.warm_start reuses it)."""
    if base is None:
        return
    dst = os.path.join(workdir, "sft")
    if os.path.exists(os.path.join(dst, "DONE.json")):
        return
    if os.path.exists(dst):  # a copy cut short by a kill
        shutil.rmtree(dst)
    tmp = dst + ".copying"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    shutil.copytree(os.path.join(base, "sft"), tmp, copy_function=_link_or_copy)
    os.replace(tmp, dst)


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (no disk for large models; the run only reads its warm start), else copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def cmd_run(args) -> int:
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [0, 1]
    variants = resolve_variants(args.variants, args.quick)
    common = common_overrides(args)
    if args.budget_from_sweep:
        sweep = _read_json(os.path.join(args.expdir, "sweep", "sweep.json"))
        if not sweep or sweep.get("suggested_budget") is None:
            raise UserError(
                f"--budget_from_sweep: no suggested budget in "
                f"{args.expdir}/sweep/sweep.json (run `sweep` first)"
            )
        if "sparse.budget" in args.overrides:
            raise UserError("--budget_from_sweep and --config.sparse.budget: choose one")
        common["sparse.budget"] = sweep["suggested_budget"]
        print(f"[experiment] sparse.budget={sweep['suggested_budget']} from the sweep", flush=True)
    cfg = cli.load_config(args.config, common)  # fails early on a bad override
    num_steps = cfg.rl.num_steps
    runs = plan_runs(variants, seeds)
    states = {}
    for v, s in runs:
        wd = os.path.join(args.expdir, run_name(v, s))
        states[(v, s)] = run_state(wd, num_steps) if os.path.isdir(wd) else ("new", 0)
    print(
        f"[experiment] {len(runs)} runs, {num_steps} RL steps each, expdir {args.expdir}",
        flush=True,
    )
    for (v, s), (state, last) in states.items():
        print(
            f"  {run_name(v, s):24s} {state}" + (f" (step {last})" if state == "partial" else ""),
            flush=True,
        )
    if args.dry_run:
        return 0

    t_start = time.time()
    os.makedirs(args.expdir, exist_ok=True)
    exp_path = os.path.join(args.expdir, "experiment.json")
    exp = _read_json(exp_path) or {}
    exp.update(
        {
            "config": os.path.abspath(args.config),
            "quick": args.quick,
            "common_overrides": {k: fmt_value(v) for k, v in common.items()},
            "seeds": seeds,
            "variants": variants,
            "num_steps": num_steps,
            "runs": sorted(set(exp.get("runs", [])) | {run_name(v, s) for v, s in runs}),
        }
    )
    write_json_atomic(exp_path, exp, indent=2)
    base = ensure_sft_base(args, common, seeds[0])
    env = _child_env(args)
    failed = []
    for i, (v, s) in enumerate(runs):
        name = run_name(v, s)
        wd = os.path.join(args.expdir, name)
        over = run_overrides(args.config, common, v, s)
        meta_path = os.path.join(wd, "experiment_run.json")
        if os.path.isdir(wd):
            _check_same(meta_path, "overrides", over, f"run {name}")
            state, last = run_state(wd, num_steps)
            if state == "done":
                print(f"[experiment] {i + 1}/{len(runs)} {name}: finished, skipped", flush=True)
                continue
        os.makedirs(wd, exist_ok=True)
        meta = _read_json(meta_path) or {"variant": v, "seed": s, "attempts": []}
        meta.update(
            variant=v,
            seed=s,
            description=DESCRIPTIONS[v],
            overrides={k: fmt_value(x) for k, x in over.items()},
        )
        write_json_atomic(meta_path, meta, indent=2)
        give_sft(base, wd)
        state, last = run_state(wd, num_steps)
        print(
            f"[experiment] {i + 1}/{len(runs)} {name}: "
            + (f"resuming (step {last})" if state == "partial" else "starting")
            + f", log {wd}/train.log",
            flush=True,
        )
        cmd = [
            sys.executable,
            TRAIN,
            f"--config={args.config}",
            f"--workdir={wd}",
            *override_args(over),
        ]
        started = datetime.datetime.now().isoformat(timespec="seconds")
        t_run = time.time()
        try:
            rc, wall = _launch(cmd, os.path.join(wd, "train.log"), env, args.verbose)
        except KeyboardInterrupt:
            meta["attempts"].append(
                {"start": started, "rc": "interrupted", "wall_s": time.time() - t_run}
            )
            write_json_atomic(meta_path, meta, indent=2)
            print(
                f"\n[experiment] interrupted during {name}; rerun the same command to resume",
                flush=True,
            )
            return 130
        meta["attempts"].append({"start": started, "wall_s": wall, "rc": rc})
        write_json_atomic(meta_path, meta, indent=2)
        state, last = run_state(wd, num_steps)
        if rc != 0 or state != "done":
            failed.append(name)
            print(
                f"[experiment] {name} FAILED (rc {rc}, {state} at step {last}) after "
                f"{wall:.0f}s; last lines of {wd}/train.log:\n{_tail(wd + '/train.log')}",
                flush=True,
            )
        else:
            print(f"[experiment] {name} done in {wall:.0f}s", flush=True)
    print(f"[experiment] this invocation took {time.time() - t_start:.0f}s", flush=True)
    if args.report:
        results.write_report(args.expdir, args.out, args.fig_dir)
    if failed:
        print(f"[experiment] failed runs: {', '.join(failed)}", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------------- sweep
def cmd_sweep(args) -> int:
    from dsparse_jax.harness import sweep  # imports jax: only here (the runs own the device)

    budgets = [int(b) for b in args.budgets.split(",")]
    seed = int(args.seeds.split(",")[0]) if args.seeds else 0
    common = common_overrides(args)
    base = ensure_sft_base(args, common, seed)
    if args.compile_cache and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(args.compile_cache)
    config = cli.load_config(args.config, {**common, "seed": seed})
    c = config.rl
    prompts = args.prompts or c.prompts_per_step
    result = sweep.measure_sweep(config, base, budgets, prompts, args.batches, not args.no_greedy)
    result["kl_threshold"] = args.kl_threshold
    result["suggested_budget"] = sweep.suggest_budget(result, args.kl_threshold)
    result["overrides"] = {k: fmt_value(v) for k, v in common.items()}
    out = os.path.join(args.expdir, "sweep")
    os.makedirs(out, exist_ok=True)
    write_json_atomic(os.path.join(out, "sweep.json"), result, indent=2)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(sweep.sweep_markdown(result))
    print(sweep.sweep_markdown(result), flush=True)
    print(f"[sweep] wrote {out}/sweep.json and sweep.md", flush=True)
    return 0


# ------------------------------------------------------------------------------------ CLI
CONFIG_HELP = (
    "--config=FILE (default configs/gemma_math.py) and --config.a.b=VALUE (repeatable): the "
    "config of every run and of the SFT warm start; the fields that define the variants and "
    "the seed are refused (--variants, --seeds)."
)


def _common_args(p: argparse.ArgumentParser) -> None:
    p.epilog = CONFIG_HELP
    p.add_argument("--expdir", required=True, help="experiment directory")
    p.add_argument(
        "--quick",
        action="store_true",
        help="the quick preset (QUICK in this file; docs/experiments.md)",
    )
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (rl.num_steps)")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma list (default 0,1): the main comparison (dense, sparse, "
        "distillsparse) runs every seed, the other variants the first",
    )
    p.add_argument(
        "--compile_cache",
        default=None,
        help="JAX persistent compilation cache shared by the runs "
        "(default <expdir>/jax_cache; '' disables)",
    )
    p.add_argument("--verbose", action="store_true", help="echo the runs' output")


def build_parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.experiment",
        description=__doc__.split("\n\n")[0],
        epilog=CONFIG_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run (or resume) the variants")
    _common_args(r)
    r.add_argument(
        "--variants",
        default=None,
        help=f"comma list or 'all' (default: all; with --quick {','.join(MAIN)}); "
        f"known: {', '.join(VARIANTS)}",
    )
    r.add_argument("--dry_run", action="store_true", help="print the plan and run states only")
    r.add_argument(
        "--budget_from_sweep",
        action="store_true",
        help="sparse.budget = the suggested budget of <expdir>/sweep/sweep.json",
    )
    r.add_argument("--report", action="store_true", help="write the report afterwards")
    r.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    r.add_argument("--fig_dir", default=None, help="default <dir of --out>/results")
    st = sub.add_parser("status", help="the plan and each run's state (run --dry_run)")
    _common_args(st)
    st.add_argument("--variants", default=None)
    st.add_argument("--budget_from_sweep", action="store_true")
    s = sub.add_parser("sweep", help="sparsity-level sweep on the SFT warm start")
    _common_args(s)
    s.add_argument("--budgets", default=DEFAULT_BUDGETS, help="sparse.budget values (pages)")
    s.add_argument(
        "--prompts", type=int, default=0, help="prompts per batch (default rl.prompts_per_step)"
    )
    s.add_argument(
        "--batches",
        type=int,
        default=2,
        help="batches per budget; the first (compile) is not timed, so 1 batch gives no tokens/s",
    )
    s.add_argument(
        "--kl_threshold",
        type=float,
        default=0.01,
        help="'measurably off-policy': mean exact KL per token at least this",
    )
    s.add_argument(
        "--no_greedy",
        action="store_true",
        help="skip the actor's held-out greedy accuracy per budget",
    )
    rep = sub.add_parser("report", help="write docs/results.md and the figures")
    rep.add_argument("--expdir", required=True, help="an experiment directory, or several: a,b")
    rep.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    rep.add_argument("--fig_dir", default=None, help="default <dir of --out>/results")
    return p


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    path, overrides, argv = cli.split_config_args(argv)
    if "--set" in argv or any(a.startswith("--set=") for a in argv):
        raise UserError("--set KEY=VALUE is now --config.KEY=VALUE (as in launch/train.py)")
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # `experiment --expdir=...` = run
    args = build_parser().parse_args(argv)
    args.config, args.overrides = path or DEFAULT_CONFIG, overrides
    if args.command == "report":
        results.write_report(args.expdir, args.out, args.fig_dir)
        return 0
    if args.compile_cache is None:
        args.compile_cache = os.path.join(args.expdir, "jax_cache")
    signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill` stops the current run too
    if args.command == "status":
        args.dry_run, args.report = True, False
        return cmd_run(args)
    try:
        return cmd_sweep(args) if args.command == "sweep" else cmd_run(args)
    except KeyboardInterrupt:
        print("\n[experiment] interrupted; rerun the same command to resume", flush=True)
        return 130


if __name__ == "__main__":
    cli.run(main)
