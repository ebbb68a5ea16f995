"""The sparsity sweep of the experiment: the naive sparse actor's mismatch against the
dense policy per sparse.budget, on the SFT warm start, without training
(`python -m dsparse_jax.harness.experiment sweep`; docs/experiments.md)."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.config.validate import validate
from dsparse_jax.model.transformer import sparse_layers
from dsparse_jax.report.metrics import MetricsWriter
from dsparse_jax.train import context, recompute, rollouts, sft
from dsparse_jax.train.rl_state import RL_DATA_OFFSET


def measure_sweep(
    config, sft_dir: str | None, budgets: list[int], prompts: int, batches_n: int, greedy: bool
) -> dict:
    """Mismatch of the naive sparse actor (theta from the SFT warm start, no adapter) vs
    the dense policy, per sparse.budget, without training: the sparse actor samples
    `prompts` x rl.samples_per_prompt completions of the RL prompt stream (batches_n
    batches; the first includes the compile and is not timed) and recompute.of_rollout
    measures the exact per-token mismatch of its teacher-forced twin (the recorded pages)
    vs the dense policy. A dense rollout of the same prompts is the reference."""
    validate(config)
    ctx = context.build(config)
    if sft_dir is None:  # sft.enabled=False: the initial (e.g. pretrained) weights
        params, sft_acc = ctx.init_params, None
    else:
        writer = MetricsWriter(sft_dir, tensorboard=False)
        try:
            params, sft_acc = sft.warm_start(ctx, sft_dir, writer)
        finally:
            writer.close()
    c = config.rl
    scfg = rollouts.sampling_config(ctx, c.temperature, c.samples_per_prompt)
    n_bins = max(1, math.ceil(scfg.max_new_tokens / config.metrics.position_bin))
    total_pages = ctx.seq_width // ctx.spec.page_size
    rows = []
    for budget in [None] + budgets:
        if budget is None:
            spec, twin = ctx.spec, None
        else:
            sp = dataclasses.replace(ctx.rollout_spec.sparse, budget=budget)
            spec = twin = dataclasses.replace(ctx.rollout_spec, sparse=sp)
        settings = recompute.Settings(
            c.temperature, ctx.spec, twin, bin_width=config.metrics.position_bin, num_bins=n_bins
        )
        per_batch, times, toks, rewards = [], [], [], []
        for b in range(batches_n):
            probs = ctx.task.problems("train", RL_DATA_OFFSET + b * prompts, prompts, config.seed)
            key = jax.random.fold_in(jax.random.key(config.seed + 11), b)
            rolled = rollouts.roll_out(ctx, params, probs, key, scfg, spec)
            r = rolled.rollout
            ncomp = np.asarray(r.completion_lengths)
            if b > 0:  # the first batch includes the compile
                times.append(rolled.seconds)
                toks.append(float(ncomp.sum()))
            rewards.append(np.asarray(rolled.scored.rewards))
            rec = recompute.of_rollout(ctx.graphdef, params, None, r, settings)
            m = recompute.flatten_metrics(jax.device_get(rec["metrics"]))
            m["response_length_mean"] = float(ncomp.mean())
            per_batch.append(m)
        keys = sorted(set().union(*per_batch))
        row = {}
        for k in keys:  # unweighted mean over batches of finite values
            vals = [m[k] for m in per_batch if k in m and math.isfinite(m[k])]
            row[k] = float(np.mean(vals)) if vals else float("nan")
        allr = np.concatenate(rewards)
        row.update(
            budget=budget,
            reward=float(allr.mean()),
            accuracy=float((allr == 1.0).mean()),
            rollout_tokens_per_s=float(sum(toks) / sum(times)) if times else None,
            pages_read=budget if budget is not None else total_pages,
            page_fraction=(min(budget, total_pages) / total_pages) if budget else 1.0,
        )
        if greedy:
            row["greedy_accuracy"] = ctx.evaluator.greedy(params, spec=spec)
        rows.append(row)
        print(
            f"[sweep] budget {budget or 'dense'}: "
            + " ".join(
                f"{k} {row[k]:.4g}"
                for k in ("kl_exact", "alpha_mean", "alpha_p5", "reward", "greedy_accuracy")
                if isinstance(row.get(k), float)
            ),
            flush=True,
        )
    return {
        "sft_greedy_accuracy": sft_acc,
        "total_pages": total_pages,
        "page_size": ctx.spec.page_size,
        "seq_width": ctx.seq_width,
        "sparse_layers": sparse_layers(
            ctx.model_cfg, AttentionSpec(sparse=SparseSpec(dense_layers=config.sparse.dense_layers))
        ),
        "dense_layers": config.sparse.dense_layers,
        "policy": config.sparse.policy,
        "prompts": prompts,
        "samples_per_prompt": c.samples_per_prompt,
        "batches": batches_n,
        "temperature": c.temperature,
        "bin_width": config.metrics.position_bin,
        "rows": rows,
    }


def longest_bin(row: dict, name: str = "alpha_p5"):
    """(bin index, value) of `name` in the last completion-position bin with tokens."""
    best = None
    i = 0
    while f"tokens_bin{i}" in row:
        v = row.get(f"{name}_bin{i}")
        if row[f"tokens_bin{i}"] > 0 and isinstance(v, float) and math.isfinite(v):
            best = (i, v)
        i += 1
    return best


def suggest_budget(result: dict, kl_threshold: float) -> int | None:
    """The largest (least sparse) budget whose naive sparse actor is measurably off-policy:
    mean exact KL(sparse || dense) per token >= kl_threshold."""
    ok = [
        r["budget"]
        for r in result["rows"]
        if r["budget"] is not None and r.get("kl_exact", 0.0) >= kl_threshold
    ]
    return max(ok) if ok else None


def sweep_markdown(result: dict) -> str:
    def f(v, p=4):
        return "-" if v is None or (isinstance(v, float) and v != v) else f"{v:.{p}g}"

    lines = [
        f"Naive sparse actor (SFT warm start, no adapter, policy `{result['policy']}`, layers "
        f"{result['sparse_layers']} sparse) vs the dense policy, measured on "
        f"{result['prompts']} RL prompts x {result['samples_per_prompt']} samples x "
        f"{result['batches']} batches at temperature {result['temperature']}; the sequence "
        f"buffer is {result['seq_width']} tokens = {result['total_pages']} pages of "
        f"{result['page_size']}. SFT held-out greedy accuracy "
        f"{f(result['sft_greedy_accuracy'], 3)}.",
        "",
        "| budget (pages) | pages read / buffer | KL(sparse‖dense) exact | k3 KL | mean α "
        "| p5 α | p5 α, longest bin | sampled reward | greedy acc. (actor) | rollout tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        lb = longest_bin(r)
        lines.append(
            f"| {r['budget'] if r['budget'] is not None else 'dense'} "
            f"| {f(r['page_fraction'], 2)} | {f(r.get('kl_exact'))} | {f(r.get('kl_k3'))} "
            f"| {f(r.get('alpha_mean'))} | {f(r.get('alpha_p5'))} "
            f"| {f(lb[1]) + f' (bin {lb[0]})' if lb else '-'} | {f(r['reward'], 3)} "
            f"| {f(r.get('greedy_accuracy'), 3)} | {f(r.get('rollout_tokens_per_s'), 4)} |"
        )
    s = result.get("suggested_budget")
    lines += [
        "",
        f"Suggested budget (largest with exact KL >= {result['kl_threshold']:g}): "
        + (
            f"**{s}** (pass `--config.sparse.budget={s}`)"
            if s is not None
            else "none of the budgets measured"
        ),
    ]
    return "\n".join(lines) + "\n"
