"""A rollout of a prompt set: its SamplingConfig, the sampler call and its scores.

The recipe every prompt-set rollout outside the RL step follows (the evaluator, the
experiment's sweep, the mechanism diagnostics, the benchmarks on a run): encode the
problems' prompts, sample under a given attention spec, theta and phi, grade the
completions. `ctx` is a RunContext, or anything with its `sampler`, `tok`, `task` and
`rewarder` (the Evaluator).
"""

from __future__ import annotations

import dataclasses
import time

import jax

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.data import batches
from dsparse_jax.data.rewards.rewarder import Rewarder, Scored
from dsparse_jax.data.tokenizers.base import Tokenizer
from dsparse_jax.sampling.pruning import PruneConfig
from dsparse_jax.sampling.sampler import PruneRecord, Rollout, SamplingConfig, completion_view


def sampling_config(
    ctx, temperature: float, samples: int = 1, grow_buffer_from: int = 0
) -> SamplingConfig:
    """The SamplingConfig of the run's task: its completion budget, the tokenizer's EOS, its
    other stop tokens and pad, `samples` per prompt at `temperature` (0: greedy)."""
    return SamplingConfig(
        max_new_tokens=ctx.task.completion_budget(),
        eos_id=ctx.tok.eos_id,
        pad_id=ctx.tok.pad_id,
        temperature=temperature,
        samples_per_prompt=samples,
        grow_buffer_from=grow_buffer_from,
        stop_ids=tuple(sorted(ctx.tok.stop_ids - {ctx.tok.eos_id})),
    )


def decode_completions(tok: Tokenizer, rollout) -> list[str]:
    return [tok.decode(row) for row in completion_view(rollout, tok.pad_id)]


def score(
    tok: Tokenizer, rollout, problems: list, rewarder: Rewarder, where: str = ""
) -> tuple[Scored, list[str]]:
    """Rewards of a rollout whose rows are `problems` repeated samples_per_prompt times,
    and the completions' text."""
    texts = decode_completions(tok, rollout)
    reps = len(texts) // len(problems)
    rows = [p for p in problems for _ in range(reps)]
    return rewarder.score(rows, texts, where), texts


@dataclasses.dataclass(frozen=True)
class Rolled:
    """A prompt set's rollout and its scores."""

    problems: list  # one per prompt
    rollout: Rollout  # a prompt's rows contiguous
    scored: Scored  # rewards [rows], errors, metrics
    texts: list[str]  # each row's completion
    seconds: float  # the sampler call, until its tokens are ready (a first call compiles)
    prune: PruneRecord | None = None  # with prune=


def roll_out(
    ctx,
    params,
    problems: list,
    key,
    cfg: SamplingConfig,
    spec: AttentionSpec,
    lora=None,
    lora_scale: float = 1.0,
    *,
    forced=None,
    prune: PruneConfig | None = None,
    head=None,
    where: str = "",
) -> Rolled:
    """`problems` x cfg.samples_per_prompt completions of theta (`params`) + phi (`lora`)
    under `spec`, scored. forced: tokens to replay, one row per problem (Sampler's
    forced_BxS); prune, head: online pruning (Sampler's)."""
    prompts, lengths = batches.encode_prompts(ctx.tok, problems, ctx.task.prompt_buffer())
    t0 = time.perf_counter()
    out = ctx.sampler(
        params,
        prompts,
        lengths,
        key,
        cfg,
        spec,
        lora,
        lora_scale,
        forced_BxS=forced,
        prune=prune,
        head=head,
    )
    rollout, record = out if prune is not None else (out, None)
    jax.block_until_ready(rollout.tokens)
    seconds = time.perf_counter() - t0
    scored, texts = score(ctx.tok, rollout, problems, ctx.rewarder, where)
    return Rolled(problems, rollout, scored, texts, seconds, record)
