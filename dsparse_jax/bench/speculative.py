"""Speculative rollout benchmark: plain dense sampling against each drafter, in one process.

  python -m dsparse_jax.bench.speculative --quick                      # smoke test, ~1 minute
  python -m dsparse_jax.bench.speculative --gen=1024,4096 > bench.json # random weights, B = 32
  python -m dsparse_jax.bench.speculative --workdir=runs/mini_longchain \\
      --phi_workdir=runs/exp_mini/distillsparse_s0 --gen=0             # trained, the chain task

Part 1 (--gen, random weights of --preset, mini by default, in --dtype; attention
implementation --impl, xla by default): B = --batch rows (--samples per prompt) of random
prompts, EOS disabled so every row generates exactly N tokens, at
temperature --temperature. Rows: plain dense `Sampler`, then `SpeculativeSampler` with
each drafter: sparse_self (theta + phi = 0 on the sparse attention of --budget pages) and
history (no bank: the row's own context and its siblings).

draft_head: the learned head (model/draft_head.py), first trained (--head_steps Adam
steps, excluded from the timing) on --head_rows plain rollouts of other random prompts of
the same length, as RL trains it on the policy's rollouts.

Part 2 (--workdir, a run of the long-chain task): theta of the run's SFT warm start (or
newest RL checkpoint), prompts of its training set, the task's own completion budget with
EOS (tokens/s counts the tokens generated). Rows: plain, sparse_self with phi = 0,
history in each --history mode (rl.history_draft: latest, counts, tree; its depth k and
tree width) over --epochs passes over the same prompts (epoch 1: an empty bank, then the
bank holds the earlier epochs' rollouts; verified_tokens: tokens per verify), draft_head (trained on rollouts of other training prompts). With --phi_workdir (a DistillSparse run), also theta and phi
of its newest RL checkpoint: plain and sparse_self with that phi against phi = 0 on the
same theta (does distillation raise acceptance?).

Every row: one ahead-of-time compile (compile_s, excluded), then --reps timed calls
(block_until_ready; the median is reported) with the same key, so every drafter emits the
same number of tokens as the plain sampler only in expectation (the outputs are exact
samples, not the same samples). ratio = tokens/s over the plain row's of the same part.
Acceptance length = tokens emitted per verify (bonus / replacement included). Part 1 also
times the pieces of one iteration at the middle of the generation (`step_costs`): a plain
dense decode step, a sparse draft step and a dense (k + 1)-token verify; a speculative
iteration costs k draft steps + one verify and yields acceptance-length tokens.
JSON to stdout (and --out), progress to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import files
from dsparse_jax.sampling.history import HistoryBank, prompt_key
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig, buffer_length
from dsparse_jax.sampling.speculative import (
    HISTORY_DRAFTS,
    SpeculativeConfig,
    SpeculativeSampler,
    acceptance_summary,
)


def log(msg: str) -> None:
    print(f"[bench_speculative] {msg}", file=sys.stderr, flush=True)


def _run(fn, reps: int):
    """(median seconds, last output) of reps calls."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def measure(
    name,
    graphdef,
    params,
    prompts,
    lengths,
    scfg,
    reps,
    speculative_cfg=None,
    spec=None,
    lora=None,
    lora_scale=1.0,
    history=None,
    head=None,
    seed=0,
):
    """One row: compile ahead of time, then time the calls (key `seed`). head: (graphdef,
    state) of the learned draft head (draft_head)."""
    key = jax.random.key(seed)
    prompts, lengths = jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32)
    if speculative_cfg is None:
        sampler, kw = Sampler(graphdef), dict(cfg=scfg, spec=spec.dense())
    else:
        sampler = SpeculativeSampler(graphdef)
        kw = dict(
            cfg=scfg,
            speculative_cfg=speculative_cfg,
            draft_spec=spec,
            lora=lora,
            lora_scale=lora_scale,
            history=history,
            head=head,
        )
    t0 = time.perf_counter()
    sampler.lower(params, prompts, lengths, key, **kw).compile()  # the calls reuse it
    compile_s = time.perf_counter() - t0
    secs, out = _run(lambda: sampler(params, prompts, lengths, key, **kw), reps)
    rollout = out if speculative_cfg is None else out[0]
    tokens = int(np.asarray(rollout.completion_lengths).sum())
    row = {
        "name": name,
        "compile_s": round(compile_s, 2),
        "seconds": round(secs, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / secs, 1),
    }
    if speculative_cfg is not None:
        m = jax.device_get(acceptance_summary(out[1], speculative_cfg.draft_tokens))
        row.update({k: round(float(v), 4) for k, v in m.items()})
    log(json.dumps(row))
    return row, rollout


def with_ratios(rows):
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["ratio"] = round(r["tokens_per_s"] / base, 3)
    return rows


def step_costs(model, spec, batch, context, k, reps):
    """Seconds per call at `context` cached tokens (random prompt, dense prefill): a plain
    dense decode step, a sparse(+phi) draft step, and a dense verify of k + 1 tokens
    (Transformer.extend): the pieces of one speculative iteration."""
    dense = spec.dense()
    size = buffer_length(context, k + 2, spec.page_size)
    tokens = jax.random.randint(jax.random.key(1), (batch, context), 2, model.cfg.vocab_size)
    lengths = jnp.full((batch,), context, jnp.int32)
    caches = model.init_cache(batch, size, spec)
    _, caches = jax.jit(lambda t, c: model.prefill(t, lengths, c, spec))(tokens, caches)
    pos = lengths
    # Caches donated and threaded through the calls: updated in place, as in the loops.
    calls = {
        "plain_step_s": lambda c: model.decode(tokens[:, -1], pos, c, dense)[:2],
        "draft_step_s": lambda c: model.decode(tokens[:, -1], pos, c, spec)[:2],
        "verify_s": lambda c: model.extend(tokens[:, -k - 1 :], pos, c, dense),
    }
    out = {"context": context}
    for name, fn in calls.items():
        out[name], caches = _time_donated(fn, jax.tree.map(jnp.copy, caches), reps)
    log(json.dumps(out))
    return out


def _time_donated(fn, cache, reps: int):
    """(median seconds, cache) of `reps` calls of jit(fn) (cache -> (out, cache), the cache
    donated and threaded through the calls) after one untimed call."""
    fn = jax.jit(fn, donate_argnums=0)
    cache = jax.block_until_ready(fn(cache))[1]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache = jax.block_until_ready(fn(cache))[1]
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)), 5), cache


def train_head(
    graphdef, params, model_cfg, prompts, lengths, scfg, steps: int, dense_spec, seed: int = 1
):
    """A draft head trained on the policy's own plain rollouts of `prompts` (other prompts
    than the timed ones): `steps` Adam steps (lr 1e-3) of its soft cross-entropy. Returns
    ((graphdef, state), its metrics)."""
    from dsparse_jax.model import draft_head
    from dsparse_jax.train import draft_head as draft_head_train

    t0 = time.perf_counter()
    rows = Sampler(graphdef)(params, prompts, lengths, jax.random.key(seed), scfg, dense_spec)
    layers = draft_head.default_layers(model_cfg.num_layers)
    hg, hs = draft_head.create(model_cfg, draft_head.DraftHeadConfig(layers), jax.random.key(seed))
    tx = draft_head_train.make_tx(1e-3, 1.0)
    hs, _, m = draft_head_train.draft_head_update(
        hs,
        tx.init(hs),
        {"tokens": rows.tokens, "mask": rows.completion_mask},
        params,
        graphdef=graphdef,
        head_graphdef=hg,
        layers=layers,
        tx=tx,
        steps=steps,
        temperature=scfg.temperature or 1.0,
    )
    m = {k: round(float(v), 4) for k, v in jax.device_get(m).items()}
    m.update(
        rows=int(rows.tokens.shape[0]), steps=steps, seconds=round(time.perf_counter() - t0, 1)
    )
    log(f"draft head trained: {json.dumps(m)}")
    return (hg, hs), m


def part_random(args, spec):
    from flax import nnx

    from dsparse_jax.model.config import preset
    from dsparse_jax.model.transformer import Transformer

    cfg = preset(args.preset, dtype=args.dtype, param_dtype=args.dtype)
    model = Transformer(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    p = args.batch // args.samples
    prompts = rng.integers(2, cfg.vocab_size, (p, args.prompt_len))
    lengths = np.full(p, args.prompt_len)
    out = []
    for gen in args.gen:
        scfg = SamplingConfig(
            gen, -1, 0, temperature=args.temperature, samples_per_prompt=args.samples
        )
        rows = [measure("plain", graphdef, params, prompts, lengths, scfg, args.reps, spec=spec)[0]]
        head = head_metrics = None
        if "draft_head" in args.drafts:  # trained first, on rollouts of other prompts
            hp = rng.integers(2, cfg.vocab_size, (args.head_rows, args.prompt_len))
            head_cfg = dataclasses.replace(scfg, samples_per_prompt=1)
            head, head_metrics = train_head(
                graphdef,
                params,
                cfg,
                hp,
                np.full(args.head_rows, args.prompt_len),
                head_cfg,
                args.head_steps,
                spec.dense(),
            )
        for draft in args.drafts:
            sc = SpeculativeConfig(draft=draft, draft_tokens=args.k, ngram=args.ngram)
            dspec = spec if draft == "sparse_self" else spec.dense()
            rows.append(
                measure(
                    draft,
                    graphdef,
                    params,
                    prompts,
                    lengths,
                    scfg,
                    args.reps,
                    sc,
                    dspec,
                    head=head if draft == "draft_head" else None,
                )[0]
            )
        costs = step_costs(model, spec, args.batch, args.prompt_len + gen // 2, args.k, 5)
        if head is not None:
            costs.update(head_step_costs(model, head, args.batch, args.prompt_len + gen // 2, 5))
        part = {"generated_tokens": gen, "rows": with_ratios(rows), "step_costs": costs}
        if head_metrics is not None:
            part["draft_head_training"] = head_metrics
        out.append(part)
    return out


def head_step_costs(model, head, batch, context, reps):
    """Seconds per draft step of the learned head at `context` cached tokens (its cache
    only: one block, plus the unembedding)."""
    from flax import nnx

    hg, hs = head
    h = nnx.merge(hg, hs)
    cache = h.init_cache(batch, buffer_length(context, 2, 16))
    g = jnp.zeros((batch, 1, model.cfg.d_model), jnp.float32)
    tok = jnp.full((batch, 1), 2, jnp.int32)
    pos = jnp.full((batch,), context, jnp.int32)

    def step(c):
        out, c = h(g, model.embed_tokens(tok), "decode", cache=c, pos_B=pos)
        return h.logits(out[:, 0], model.unembedding()), c

    out = {"head_draft_step_s": _time_donated(step, cache, reps)[0]}
    log(json.dumps(out))
    return out


def part_trained(args, spec):
    from dsparse_jax.data import batches
    from dsparse_jax.train import context, rollouts, trained

    config = trained.workdir_config(args.workdir)
    config.rl.samples_per_prompt = args.samples
    config.rl.samples_generated = 0
    ctx = context.build(config)
    base = trained.load(ctx, args.workdir)
    p = args.batch // args.samples
    problems = ctx.task.problems("train", 0, p, config.seed)
    width = ctx.task.prompt_buffer()
    prompts, lengths = batches.encode_prompts(ctx.tok, problems, width)
    gen = ctx.task.completion_budget()
    scfg = rollouts.sampling_config(ctx, args.temperature, args.samples)
    spec = dataclasses.replace(ctx.rollout_spec, impl="xla")
    common = (ctx.graphdef, base.params, prompts, lengths, scfg, args.reps)
    rows = [measure("plain", *common, spec=spec)[0]]
    rows.append(
        measure("sparse_self (phi=0)", *common, SpeculativeConfig("sparse_self", args.k), spec)[0]
    )
    dense = spec.dense()
    for mode, k, tree_width in args.history:  # each from an empty bank, over the epochs
        bank = HistoryBank(p, args.history_per_prompt, buffer_length(width, gen, spec.page_size))
        slots = bank.slots([prompt_key(x[:n]) for x, n in zip(prompts, lengths)])
        hist_cfg = SpeculativeConfig(
            "history", k, ngram=args.ngram, history_draft=mode, tree_width=tree_width
        )
        shape = f"k={k}" + (f" x {tree_width}" if mode == "tree" else "")
        for epoch in range(1, args.epochs + 1):  # a fresh key per epoch: new samples
            row, r = measure(
                f"history {mode} {shape} (epoch {epoch})",
                *common,
                hist_cfg,
                dense,
                history=bank.rows(slots, bank.tokens.shape[2]),
                seed=epoch,
            )
            row["verified_tokens"] = 1 + k * (tree_width if mode == "tree" else 1)
            rows.append(row)
            bank.add(slots, r.tokens, r.lengths, args.samples)
    out = {"workdir": args.workdir, "theta": base.source, "generated_tokens_max": gen}
    if "draft_head" in args.drafts:  # trained on rollouts of other training prompts
        hp, hl = batches.encode_prompts(
            ctx.tok, ctx.task.problems("train", p, args.head_rows, config.seed), width
        )
        head_cfg = dataclasses.replace(scfg, samples_per_prompt=1)
        head, out["draft_head_training"] = train_head(
            ctx.graphdef, base.params, ctx.model_cfg, hp, hl, head_cfg, args.head_steps, dense
        )
        rows.append(
            measure(
                "draft_head", *common, SpeculativeConfig("draft_head", args.k), dense, head=head
            )[0]
        )
    out["rows"] = with_ratios(rows)
    if args.phi_workdir:
        tuned = trained.load(ctx, args.phi_workdir)
        if tuned.lora is None:
            raise UserError(
                f"--phi_workdir: {args.phi_workdir} has no phi (not a distillsparse run)"
            )
        common = (ctx.graphdef, tuned.params, prompts, lengths, scfg, args.reps)
        scale = ctx.lora_cfg.scale
        zero = jax.tree.map(jnp.zeros_like, tuned.lora)
        sc = SpeculativeConfig("sparse_self", args.k)
        phi_rows = [measure("plain (rl theta)", *common, spec=spec)[0]]
        phi_rows.append(measure("sparse_self (phi=0)", *common, sc, spec, zero, scale)[0])
        phi_rows.append(
            measure("sparse_self (trained phi)", *common, sc, spec, tuned.lora, scale)[0]
        )
        out["phi"] = {
            "workdir": args.phi_workdir,
            "theta": tuned.source,
            "rows": with_ratios(phi_rows),
        }
    ctx.rewarder.close()
    return out


def history_row(text: str) -> tuple[str, int, int]:
    """--history's entries: latest:4, counts:4, tree:4x2 -> (mode, k, tree width)."""
    try:
        mode, shape = text.split(":")
        k, _, w = shape.partition("x")
        row = (mode, int(k), int(w or 1))
    except ValueError:
        raise UserError(f"--history: {text!r} is not mode:k or tree:kxwidth") from None
    if mode not in HISTORY_DRAFTS or row[1] < 1 or row[2] < 1:
        raise UserError(f"--history: {text!r}: mode one of {tuple(HISTORY_DRAFTS)}, k, width >= 1")
    return row


def main(argv: list[str]) -> int:
    ap = cli.ArgumentParser(
        prog="python -m dsparse_jax.bench.speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny smoke run")
    ap.add_argument("--preset", default="mini")
    ap.add_argument("--gen", default="1024,4096", help="part 1 generation lengths (0: skip)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt_len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify")
    ap.add_argument("--ngram", type=int, default=4)
    ap.add_argument("--budget", type=int, default=8, help="sparse_self pages per step")
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--drafts", default="sparse_self,history,draft_head")
    ap.add_argument("--head_rows", type=int, default=8, help="draft_head: training rollouts")
    ap.add_argument("--head_steps", type=int, default=300, help="draft_head: Adam steps")
    ap.add_argument("--history_per_prompt", type=int, default=8)
    ap.add_argument(
        "--history",
        default="latest:4,counts:4,tree:4x2,tree:2x2",
        help="part 2: history drafts, mode:k or tree:kxwidth (rl.history_draft)",
    )
    ap.add_argument("--epochs", type=int, default=3, help="part 2: passes over the prompts")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--workdir", default="", help="part 2: a long-chain run (SFT or RL)")
    ap.add_argument("--phi_workdir", default="", help="part 2: a distillsparse run's phi")
    ap.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="part 1 model dtype"
    )
    ap.add_argument("--impl", default="xla", help="attention.impl (auto: the platform's kernel)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    args.gen = [int(x) for x in args.gen.split(",") if int(x) > 0]
    args.drafts = args.drafts.split(",")
    args.history = [history_row(x) for x in args.history.split(",") if x]
    if args.quick:
        args.gen, args.batch, args.samples, args.prompt_len = [64], 8, 2, 16
    spec = AttentionSpec(
        impl=args.impl,
        page_size=args.page_size,
        sparse=SparseSpec(budget=args.budget, dense_layers=2),
    )
    result = {
        "host": platform.node(),
        "backend": jax.default_backend(),
        "batch": args.batch,
        "samples_per_prompt": args.samples,
        "draft_tokens": args.k,
        "temperature": args.temperature,
        "budget_pages": args.budget,
        "dtype": args.dtype,
        "impl": args.impl,
    }
    if args.gen:
        result["random"] = part_random(args, spec)
    if args.workdir:
        result["trained"] = part_trained(args, spec)
    files.emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    cli.run(main)
