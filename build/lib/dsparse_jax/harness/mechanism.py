"""Mechanism diagnostics of sparse rollouts on the chain task (docs/results.md).

  python -m dsparse_jax.harness.mechanism lookups --config=configs/mini_longchain.py \\
      --workdir=runs/mini_longchain --budgets=6,8,12
  python -m dsparse_jax.harness.mechanism distill --config=configs/mini_longchain.py \\
      --workdir=runs/mini_longchain --budget=8 --kls=k3,exact_reverse --lrs=1e-3,1e-2 \\
      --steps=100

  python -m dsparse_jax.harness.mechanism selection --config=configs/mini_longchain.py \\
      --workdir=runs/mini_longchain --budget=8 --groups=4:5,4:8,2:8

All start from the run's SFT warm start (<workdir>/sft, made by
`launch/train.py --sft_only`) and write JSON to --out (default <workdir>/mechanism/),
rewritten after every budget or (KL kind, learning rate) run ("complete": false until
the last), so a long run that stops keeps what it measured.

lookups (a): the naive sparse actor (theta, no adapter) samples rl.samples_per_prompt
  completions of --prompts RL prompts per budget. For every lookup step (the value token
  of a term line) and every sparse layer and KV head: was the page holding the
  definition read? The exact per-token KL(sparse || dense) and acceptance alpha of the
  sampled token, split by hit and miss, at vote steps (a soft aggregate of every earlier
  sign) and at all other tokens (harness/lookups.py).
distill (b, c): theta frozen, phi (LoRA, zero at the start) trained with
  distill.loss=kl_only for --steps steps per (KL kind, LoRA learning rate) on a fixed
  replay of --replay recorded rollout batches of the naive sparse actor (tokens and
  pages). Every --every steps: the exact KL in-sample (the twin with phi on the replay's
  own recorded pages) and on fresh rollouts of the sparse + phi actor. At the end (c):
  the fresh rollouts replayed through the phi-less actor's decode loop (forced tokens),
  giving the pages theta alone would have read on the same prefixes: the overlap of the
  two page sets, the lookup hit rates of each, and the KL of the phi actor on theta's
  pages vs on its own.
selection: two-level page selection (sparse.group_pages G, candidate_groups C; "G:C" per
  --groups entry) against the flat one. The naive sparse actor (flat selection) samples
  rollouts; each is replayed through the two-level actor's decode loop (forced tokens),
  so both select pages on the same prefixes: the fraction of the flat pages the two
  levels also read, the lookup hit rates of each, and the exact KL(sparse || dense) on
  those tokens with each page set.
"""

import os
import time

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError
from dsparse_jax.reliability import files
from dsparse_jax.rl.modes import kl_kinds_for

DEFAULT_CONFIG = "configs/mini_longchain.py"


class Lab:
    """The run's context, SFT weights and the jitted measurements, built once."""

    def __init__(self, config, workdir: str):
        import jax

        from dsparse_jax.config.validate import validate
        from dsparse_jax.harness import lookups
        from dsparse_jax.report.metrics import MetricsWriter
        from dsparse_jax.train import context, recompute, sft

        if not os.path.exists(os.path.join(workdir, "sft", "DONE.json")):
            raise UserError(
                f"--workdir: {workdir} has no finished SFT warm start (sft/DONE.json); run "
                f"launch/train.py --config=... --workdir={workdir} --sft_only first"
            )
        validate(config)
        self.config, self.ctx = config, context.build(config)
        writer = MetricsWriter(workdir, tensorboard=False)
        try:
            self.params, self.sft_accuracy = sft.warm_start(self.ctx, workdir, writer)
        finally:
            writer.close()
        self.chars = lookups.token_chars(self.ctx.tok)

        def per_token(params, lora, tokens, pages, *, twin_spec, lora_scale):
            """Per-token alpha and exact KL(sparse || dense) (kl_rev) of the rollout's
            tokens: the RL step's recompute on one chunk."""
            return recompute.token_stats(
                params,
                lora,
                tokens,
                pages,
                graphdef=self.ctx.graphdef,
                temperature=config.rl.temperature,
                dense_spec=self.ctx.spec,
                twin_spec=twin_spec,
                lora_scale=lora_scale,
            )

        self.per_token = jax.jit(per_token, static_argnames=("twin_spec", "lora_scale"))

    def spec(self, budget: int):
        import dataclasses

        sp = dataclasses.replace(self.ctx.rollout_spec.sparse, budget=budget)
        return dataclasses.replace(self.ctx.rollout_spec, sparse=sp)

    def rollout(self, spec, index: int, count: int, key, lora=None, lora_scale=1.0, forced=None):
        """The scored rollout (train/rollouts.py; its rollout on the host) of RL prompts
        index.. x rl.samples_per_prompt, or of the `forced` rows (one per sample)."""
        import dataclasses

        import jax

        from dsparse_jax.train import rollouts
        from dsparse_jax.train.rl_state import RL_DATA_OFFSET

        probs = self.ctx.task.problems("train", RL_DATA_OFFSET + index, count, self.config.seed)
        n = self.config.rl.samples_per_prompt
        if forced is not None:  # one row per sample: each prompt repeated
            n, probs = 1, [p for p in probs for _ in range(forced.shape[0] // count)]
        scfg = rollouts.sampling_config(self.ctx, self.config.rl.temperature, n)
        rolled = rollouts.roll_out(
            self.ctx, self.params, probs, key, scfg, spec, lora, lora_scale, forced=forced
        )
        return dataclasses.replace(rolled, rollout=jax.device_get(rolled.rollout))

    def analyse(self, r, spec, lora=None, lora_scale=1.0) -> tuple[dict, list, dict]:
        """(summary, steps, hits) of a rollout: the KL/alpha splits by hit and miss."""
        import numpy as np

        from dsparse_jax.harness import lookups

        tok = self.per_token(
            self.params, lora, r.tokens, r.pages(), twin_spec=spec, lora_scale=lora_scale
        )
        kl, alpha = np.asarray(tok["kl_rev"]), np.asarray(tok["alpha"])
        found = []
        for b in range(r.tokens.shape[0]):
            length = int(r.prompt_lengths[b] + r.completion_lengths[b])
            text = lookups.row_text(r.tokens[b], length, self.chars)
            found += lookups.find_steps(b, text, int(r.prompt_lengths[b]))
        page_ids = {i: np.asarray(x) for i, x in r.page_ids.items()}
        hit = lookups.hits(found, page_ids, spec.page_size)
        out = lookups.summarize(found, hit, kl, alpha, np.asarray(r.completion_mask))
        mask = np.asarray(r.completion_mask) > 0
        out["kl_mean"] = float(kl[mask].mean())
        out["alpha_mean"] = float(alpha[mask].mean())
        return out, found, hit


def cmd_lookups(lab: Lab, args, save) -> dict:
    import jax
    import numpy as np

    from dsparse_jax.model.transformer import sparse_layers

    rows = []
    result = {
        "sparse_layers": sparse_layers(lab.ctx.model_cfg, lab.spec(args.budgets[0])),
        "kv_heads": lab.ctx.model_cfg.num_kv_heads,
        "seq_pages": lab.ctx.seq_width // lab.ctx.spec.page_size,
        "sft_greedy_accuracy": lab.sft_accuracy,
        "prompts": args.prompts,
        "samples_per_prompt": lab.config.rl.samples_per_prompt,
        "rows": rows,
    }
    for budget in args.budgets:
        spec = lab.spec(budget)
        t = time.time()
        rolled = lab.rollout(spec, 0, args.prompts, jax.random.key(lab.config.seed + 21))
        r, rewards = rolled.rollout, rolled.scored.rewards
        out, _, _ = lab.analyse(r, spec)
        out.update(budget=budget, reward=float(np.mean(rewards)), seconds=time.time() - t)
        out["completion_tokens_mean"] = float(np.mean(r.completion_lengths))
        print(f"[lookups] budget {budget}: " + _brief(out), flush=True)
        rows.append(out)
        save(result)
    return result


def _brief(out: dict) -> str:
    keys = (
        "hit_rate_all",
        "kl_mean",
        "kl_lookup_all_hit",
        "kl_lookup_any_miss",
        "kl_vote",
        "kl_other",
        "correct_lookup_all_hit",
        "correct_lookup_any_miss",
        "reward",
    )
    return " ".join(f"{k} {_fmt(out.get(k))}" for k in keys if k in out)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def cmd_distill(lab: Lab, args, save) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from dsparse_jax.model.lora import init_lora
    from dsparse_jax.rl import objectives
    from dsparse_jax.train import distill, rl_state

    spec = lab.spec(args.budget)
    c = lab.config
    replay = []
    for i in range(args.replay):  # the naive sparse actor's rollouts, with their pages
        r = lab.rollout(spec, i * args.prompts, args.prompts, jax.random.key(100 + i)).rollout
        replay.append(
            {
                "tokens": r.tokens,
                "mask": r.completion_mask,
                "adv": np.zeros(r.tokens.shape[0], np.float32),
                "rollout_logp": r.logprobs,
                "pages": r.pages(),
            }
        )
    fresh_index = args.replay * args.prompts  # fresh prompts: past the replay's
    runs = []
    result = {
        "budget": args.budget,
        "prompts": args.prompts,
        "replay_batches": args.replay,
        "steps": args.steps,
        "runs": runs,
        "settings": dataclasses.asdict(lab.ctx.lora_cfg),
    }
    for kl in args.kls:
        for lr in args.lrs:
            settings = distill.DistillSettings(
                spec=spec,
                lora_scale=lab.ctx.lora_cfg.scale,
                temperature=c.rl.temperature,
                loss="kl_only",
                kl=kl,
                kl_coef=1.0,
                loss_agg=objectives.loss_agg(c.rl.loss_agg, c.rl.policy_loss),
                microbatches=max(1, replay[0]["tokens"].shape[0] // 16),  # 16 rows at once
            )
            lcfg = c.lora.copy_and_resolve_references()
            lcfg.learning_rate = lr
            tx = rl_state.optimizer_from(lcfg, 1, args.steps)  # a step: one update
            lora = init_lora(lab.ctx.model_cfg, lab.ctx.lora_cfg, jax.random.key(c.seed + 3))
            opt = tx.init(lora)
            if not settings.exact:  # k-estimators need the dense teacher's log-probs
                for mb in replay:
                    mb["teacher_logp"] = _dense_logp(lab, mb["tokens"])
            curve, t0 = [], time.time()
            for step in range(args.steps + 1):
                if step % args.every == 0 or step == args.steps:
                    point = _kl_point(lab, spec, lora, replay[0], fresh_index, args.prompts)
                    point.update(step=step, seconds=time.time() - t0)
                    curve.append(point)
                    print(
                        f"[distill] kl={kl} lr={lr:g} step {step}: "
                        + " ".join(
                            f"{k} {_fmt(point[k])}"
                            for k in ("kl_in_sample", "kl_fresh", "hit_rate_fresh")
                        ),
                        flush=True,
                    )
                if step == args.steps:
                    break
                mb = replay[step % len(replay)]
                lora, opt, _ = distill.phi_update(
                    lora,
                    opt,
                    mb,
                    lab.params,
                    lab.params if settings.exact else None,
                    graphdef=lab.ctx.graphdef,
                    tx=tx,
                    settings=settings,
                )
            runs.append(
                {
                    "kl": kl,
                    "lr": lr,
                    "curve": curve,
                    "selection": _selection_effect(lab, spec, lora, fresh_index, args.prompts),
                }
            )
            print(f"[distill] kl={kl} lr={lr:g} selection: {runs[-1]['selection']}", flush=True)
            save(result)
    return result


def _dense_logp(lab: Lab, tokens):
    from dsparse_jax.train.recompute import token_logprobs

    logp, _ = token_logprobs(
        lab.ctx.graphdef, lab.params, tokens, temperature=lab.config.rl.temperature
    )
    return logp


def _kl_point(lab: Lab, spec, lora, replay_mb, fresh_index: int, prompts: int) -> dict:
    """Exact KL(sparse + phi || dense): on the replay's first batch (its recorded pages)
    and on fresh rollouts of the sparse + phi actor (their own pages)."""
    import jax
    import numpy as np

    scale = lab.ctx.lora_cfg.scale
    tok = lab.per_token(
        lab.params,
        lora,
        replay_mb["tokens"],
        replay_mb["pages"],
        twin_spec=spec,
        lora_scale=scale,
    )
    mask = np.asarray(replay_mb["mask"]) > 0
    kl_in = float(np.asarray(tok["kl_rev"])[mask].mean())
    key = jax.random.key(7)  # the same fresh prompts and key at every point
    r = lab.rollout(spec, fresh_index, prompts, key, lora, scale).rollout
    out, _, _ = lab.analyse(r, spec, lora, scale)
    return {
        "kl_in_sample": kl_in,
        "kl_fresh": out["kl_mean"],
        "alpha_fresh": out["alpha_mean"],
        "hit_rate_fresh": out["hit_rate_all"],
        "kl_lookup_fresh": out.get("kl_lookup_all_hit"),
    }


def _selection_effect(lab: Lab, spec, lora, fresh_index: int, count: int) -> dict:
    """(c): fresh rollouts of the phi actor, replayed through the phi-less actor's decode
    loop: how much the page sets overlap, the lookup hit rates with each, and the phi
    actor's exact KL on theta's pages vs on its own."""
    import jax
    import numpy as np

    from dsparse_jax.harness import lookups

    scale = lab.ctx.lora_cfg.scale
    r_phi = lab.rollout(spec, fresh_index, count, jax.random.key(8), lora, scale).rollout
    forced = np.asarray(r_phi.tokens)
    r_theta = lab.rollout(spec, fresh_index, count, jax.random.key(8), forced=forced).rollout
    assert np.array_equal(r_theta.tokens, r_phi.tokens)
    mask = np.asarray(r_phi.completion_mask) > 0
    own, steps, hit_phi = lab.analyse(r_phi, spec, lora, scale)
    theta_pages = r_phi.replace(page_ids=r_theta.page_ids)
    on_theta, _, _ = lab.analyse(theta_pages, spec, lora, scale)
    theta_ids = {i: np.asarray(x) for i, x in r_theta.page_ids.items()}
    hit_theta = lookups.hits(steps, theta_ids, spec.page_size)
    return {
        "page_overlap": _page_overlap(r_phi.page_ids, r_theta.page_ids, mask),
        "hit_rate_phi_pages": _all_hit(hit_phi),
        "hit_rate_theta_pages": _all_hit(hit_theta),
        "kl_phi_on_own_pages": own["kl_mean"],
        "kl_phi_on_theta_pages": on_theta["kl_mean"],
    }


def _page_overlap(ids_a: dict, ids_b: dict, mask) -> float:
    """Fraction of the pages in ids_a (per sparse layer [B, S, K, P]) also in ids_b, over
    the completion positions in mask."""
    import numpy as np

    overlap = []
    for i, a_all in ids_a.items():
        a, b = np.asarray(a_all)[mask], np.asarray(ids_b[i])[mask]  # [N, K, P]
        same = (a[..., :, None] == b[..., None, :]).any(-1) & (a >= 0)
        overlap.append(same.sum() / max((a >= 0).sum(), 1))
    return float(np.mean(overlap))


def _all_hit(hits: dict) -> float:
    """Fraction of lookup steps whose definition page every sparse layer and head read."""
    import numpy as np

    return float(np.mean(np.all([x.all(1) for x in hits.values()], axis=0)))


def cmd_selection(lab: Lab, args, save) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from dsparse_jax.harness import lookups

    flat = lab.spec(args.budget)
    two_level = {}  # "G:C" -> spec, every entry checked before the first rollout
    for entry in args.groups:
        try:
            g, c = (int(x) for x in entry.split(":"))
            sp = dataclasses.replace(flat.sparse, group_pages=g, candidate_groups=c)
        except ValueError as e:
            raise UserError(f"--groups: {entry!r}: {e}") from None
        two_level[entry] = dataclasses.replace(flat, sparse=sp)
    r = lab.rollout(flat, 0, args.prompts, jax.random.key(lab.config.seed + 31)).rollout
    mask = np.asarray(r.completion_mask) > 0
    base, steps, hit_flat = lab.analyse(r, flat)
    rows = []
    result = {
        "budget": args.budget,
        "prompts": args.prompts,
        "seq_pages": lab.ctx.seq_width // flat.page_size,
        "flat": {"kl_mean": base["kl_mean"], "hit_rate": _all_hit(hit_flat)},
        "rows": rows,
    }
    for entry, two in two_level.items():
        r_two = lab.rollout(two, 0, args.prompts, jax.random.key(0), forced=r.tokens).rollout
        assert np.array_equal(r_two.tokens, r.tokens)
        on_two, _, _ = lab.analyse(r.replace(page_ids=r_two.page_ids), two)
        ids_two = {i: np.asarray(x) for i, x in r_two.page_ids.items()}
        row = {
            "group_pages": two.sparse.group_pages,
            "candidate_groups": two.sparse.candidate_groups,
            "page_overlap": _page_overlap(r.page_ids, r_two.page_ids, mask),
            "kl_mean": on_two["kl_mean"],
            "hit_rate": _all_hit(lookups.hits(steps, ids_two, flat.page_size)),
        }
        print(f"[selection] {entry}: {row}", flush=True)
        rows.append(row)
        save(result)
    return result


def main(argv: list[str]) -> int:
    path, overrides, rest = cli.split_config_args(argv)
    p = cli.ArgumentParser(
        prog="python -m dsparse_jax.harness.mechanism", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("command", choices=("lookups", "distill", "selection"))
    p.add_argument("--workdir", required=True, help="run directory with a finished SFT")
    p.add_argument("--out", default=None, help="JSON output (default <workdir>/mechanism/)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout batch")
    p.add_argument("--budgets", type=cli.comma_list(int), default=[6, 8, 12], help="lookups")
    p.add_argument("--budget", type=int, default=8, help="distill, selection: the budget")
    p.add_argument(
        "--groups",
        type=cli.comma_list(),
        default=["4:5", "4:8", "2:8"],
        help="selection: group_pages:candidate_groups per two-level setting",
    )
    p.add_argument("--kls", type=cli.comma_list(), default=["k3", "exact_reverse"])
    p.add_argument("--lrs", type=cli.comma_list(float), default=[1e-3, 1e-2], help="phi's")
    p.add_argument("--steps", type=int, default=100, help="phi steps per (kl, lr)")
    p.add_argument("--every", type=int, default=20, help="steps between KL measurements")
    p.add_argument("--replay", type=int, default=4, help="recorded rollout batches")
    args = p.parse_args(rest)
    usable = kl_kinds_for("actor")  # the replay holds the actor's own samples
    if any(k not in usable for k in args.kls):
        p.error(f"--kls: each must be one of {usable} (rl/modes.DISTILL_KL), got {args.kls}")
    config = cli.load_config(path or DEFAULT_CONFIG, overrides)
    lab = Lab(config, args.workdir)
    out = args.out or os.path.join(args.workdir, "mechanism", f"{args.command}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    command = {"lookups": cmd_lookups, "distill": cmd_distill, "selection": cmd_selection}[
        args.command
    ]

    def save(result: dict, done: bool = False):
        """Write the JSON so far (after every budget or (kl, lr) run: a crash keeps them)."""
        result.update(command=args.command, config=path or DEFAULT_CONFIG, overrides=overrides)
        result["complete"] = done
        files.write_json_atomic(out, result, indent=1)

    save(command(lab, args, save), done=True)
    print(f"[mechanism] wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
