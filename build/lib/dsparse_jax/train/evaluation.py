"""Held-out evaluation: greedy accuracy, mean@k, maj@k and pass@k on the task's eval split.

A completion is correct when its reward is >= 1 (graders.is_correct). Over k samples per
problem: mean@k is the mean correctness, pass@k the fraction of problems with a correct
sample, maj@k the fraction whose most frequent extracted answer (graders.answer_key; ties:
the first seen) is a correct one; with a rollout quality head (rl.prune), qmaj@k weighs
each sample's vote by the head's P(correct) (docs/pruning.md)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.data.rewards import graders
from dsparse_jax.data.rewards.rewarder import Rewarder
from dsparse_jax.data.task import Problem, Task
from dsparse_jax.data.tokenizers.base import Tokenizer
from dsparse_jax.model import quality_head
from dsparse_jax.report.metrics import Progress
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig
from dsparse_jax.train import rollouts

# An evaluation running longer than this prints a progress line per batch (unless the
# caller counts batches itself with on_batch).
PROGRESS_AFTER_S = 5.0


class Evaluator:
    """Greedy accuracy (and optionally mean@k) on a fixed set of eval problems.

    `spec` (default: the one given at construction, dense) and `lora` select the policy:
    the dense policy (theta, dense attention) or a sparse rollout policy (sparse spec,
    optionally with a LoRA delta tree)."""

    def __init__(
        self,
        sampler: Sampler,
        tok: Tokenizer,
        task: Task,
        problems: list[Problem],
        spec: AttentionSpec = AttentionSpec(),
        batch_size: int = 64,
        rewarder: Rewarder | None = None,
    ):
        self.sampler, self.tok, self.task, self.problems = sampler, tok, task, problems
        self.spec = spec
        self.rewarder = rewarder or Rewarder()
        self.batch_size = min(batch_size, len(problems))

    def num_batches(self) -> int:
        return -(-len(self.problems) // self.batch_size)

    def samples(
        self,
        params,
        cfg: SamplingConfig,
        key,
        lora=None,
        lora_scale=1.0,
        spec: AttentionSpec | None = None,
        on_batch=None,
        weigh=None,
    ):
        """(completions [P][k], rewards [P, k]) of cfg.samples_per_prompt samples of
        every eval problem; on_batch() is called after each batch (progress; without it
        an evaluation longer than PROGRESS_AFTER_S prints its own). weigh: rollout ->
        numpy [rows], then also (..., weights [P, k])."""
        spec = self.spec if spec is None else spec
        progress = None
        if on_batch is None:
            progress = Progress(
                f"eval {len(self.problems)} problems x {cfg.samples_per_prompt}",
                self.num_batches(),
                after_s=PROGRESS_AFTER_S,
            )
            done = itertools.count(1)
            on_batch = lambda: progress.update(next(done), {})  # noqa: E731
        texts, reward_rows, weight_rows = [], [], []
        for start in range(0, len(self.problems), self.batch_size):
            chunk = self.problems[start : start + self.batch_size]
            pad = self.batch_size - len(chunk)  # keep one static batch shape
            key, sub = jax.random.split(key)
            rolled = rollouts.roll_out(
                self,
                params,
                chunk + chunk[:1] * pad,
                sub,
                cfg,
                spec,
                lora,
                lora_scale,
                where="eval",
            )
            t = rolled.texts
            k = len(t) // (len(chunk) + pad)
            reward_rows.append(rolled.scored.rewards.reshape(len(chunk) + pad, k)[: len(chunk)])
            if weigh is not None:
                w = np.asarray(weigh(rolled.rollout)).reshape(len(chunk) + pad, k)
                weight_rows.append(w[: len(chunk)])
            texts += [t[i * k : (i + 1) * k] for i in range(len(chunk))]
            on_batch()
        if progress is not None:
            progress.close()
        if weigh is not None:
            return texts, np.concatenate(reward_rows), np.concatenate(weight_rows)
        return texts, np.concatenate(reward_rows)

    def _accuracy(self, params, cfg: SamplingConfig, key, lora=None, lora_scale=1.0, spec=None):
        _, r = self.samples(params, cfg, key, lora, lora_scale, spec)
        return float(np.mean(graders.is_correct(r)))

    def sampling_config(self, temperature: float, k: int = 1) -> SamplingConfig:
        return rollouts.sampling_config(self, temperature, k)

    def report(
        self,
        params,
        k: int,
        temperature: float,
        key,
        lora=None,
        lora_scale=1.0,
        spec: AttentionSpec | None = None,
        on_batch=None,
        head=None,
        head_layer: int = -1,
        head_position: int = 0,
        keep: int = 0,
    ) -> dict:
        """greedy_accuracy, and with k > 0 mean@k, maj@k and pass@k of one policy; with a
        quality head also qmaj@k (votes weighted by the head's score of each sample's
        first head_position completion tokens, read at head_layer). keep = N: also
        "samples", the completions of the first N problems with their prompts, reference
        answers and rewards (greedy, then the k samples)."""
        kw = dict(lora=lora, lora_scale=lora_scale, spec=spec, on_batch=on_batch)
        g_texts, greedy = self.samples(params, self.sampling_config(0.0), jax.random.key(0), **kw)
        out = {"greedy_accuracy": float(np.mean(graders.is_correct(greedy)))}
        kept = self._kept(g_texts, greedy, keep, "greedy")
        if k:
            scfg = self.sampling_config(temperature, k)
            weights = None
            if head is not None:
                spec_ = self.spec if spec is None else spec
                weigh = functools.partial(
                    self.quality_scores,
                    params,
                    head,
                    layer=head_layer,
                    position=head_position,
                    spec=spec_,
                    lora=lora,
                    lora_scale=lora_scale,
                )
                texts, r, weights = self.samples(params, scfg, key, weigh=weigh, **kw)
            else:
                texts, r = self.samples(params, scfg, key, **kw)
            answers = [
                [graders.answer_key(p, t) for t in row] for p, row in zip(self.problems, texts)
            ]
            correct = graders.is_correct(r)
            out.update(
                {
                    f"mean_at_{k}": mean_at_k(correct),
                    f"maj_at_{k}": maj_at_k(answers, correct),
                    f"pass_at_{k}": pass_at_k(correct),
                }
            )
            if weights is not None:
                out[f"qmaj_at_{k}"] = maj_at_k(answers, correct, weights)
            kept += self._kept(texts, r, keep, f"sample_t{temperature:g}")
        if keep:
            out["samples"] = kept
        return out

    def _kept(self, texts_PxK, rewards_PxK, n: int, how: str) -> list[dict]:
        """The completions of the first n problems as records (report's keep)."""
        return [
            {
                "problem": i,
                "decoding": how,
                "prompt": p.prompt,
                "reference": p.ground_truth or p.answer,
                "completion": t,
                "reward": float(r),
            }
            for i, p in enumerate(self.problems[:n])
            for t, r in zip(texts_PxK[i], np.asarray(rewards_PxK)[i])
        ]

    def quality_scores(
        self, params, head, rollout, *, layer, position, spec, lora=None, lora_scale=1.0
    ):
        """The quality head's P(correct) of each row [B]: its features are layer `layer`'s
        output at the row's last fed token of its first `position` completion tokens (the
        whole completion if shorter), as the sampler records them at a checkpoint."""
        fn = _quality_scores_fn(self.sampler.graphdef, layer, spec, lora_scale)
        return np.asarray(
            fn(
                params,
                lora,
                head,
                rollout.tokens,
                rollout.prompt_lengths,
                rollout.completion_lengths,
                rollout.pages(),
                position,
            )
        )

    def greedy(self, params, lora=None, lora_scale=1.0, spec: AttentionSpec | None = None) -> float:
        return float(np.mean(self.greedy_correct(params, lora, lora_scale, spec)))

    def greedy_correct(
        self, params, lora=None, lora_scale=1.0, spec: AttentionSpec | None = None
    ) -> np.ndarray:
        """bool [P]: whether the greedy completion of each eval problem is correct (the
        per-problem outcomes a bootstrap over problems resamples)."""
        cfg = self.sampling_config(0.0)
        _, r = self.samples(params, cfg, jax.random.key(0), lora, lora_scale, spec)
        return graders.is_correct(r)[:, 0]

    def mean_at_k(
        self,
        params,
        k: int,
        temperature: float,
        key,
        lora=None,
        lora_scale=1.0,
        spec: AttentionSpec | None = None,
    ) -> float:
        cfg = self.sampling_config(temperature, k)
        return self._accuracy(params, cfg, key, lora, lora_scale, spec)


def mean_at_k(correct_PxK) -> float:
    return float(np.mean(correct_PxK))


def pass_at_k(correct_PxK) -> float:
    """The fraction of problems with at least one correct sample of their k."""
    return float(np.mean(np.asarray(correct_PxK).any(axis=1)))


@functools.lru_cache(maxsize=None)
def _quality_scores_fn(graphdef, layer: int, spec, lora_scale: float):
    @jax.jit
    def fn(params, lora, head, tokens, prompt_len, ncomp, pages, position):
        model = nnx.merge(graphdef, params)
        _, hidden = model.forward(
            tokens, spec, pages=pages, lora=lora, lora_scale=lora_scale, hidden_at=layer
        )
        last = prompt_len + jnp.minimum(position, ncomp) - 1
        feats = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return quality_head.quality_probs(head, feats)

    return fn


def maj_at_k(answers_PxK: list[list[str | None]], correct_PxK, weights_PxK=None) -> float:
    """The fraction of problems whose most voted answer (None: no answer, never voted;
    ties: the first seen) belongs to a correct sample; each vote counts 1, or its weight
    (weights_PxK: quality-weighted voting)."""
    hits = []
    w_rows = np.ones(np.shape(correct_PxK)) if weights_PxK is None else np.asarray(weights_PxK)
    for answers, correct, ws in zip(answers_PxK, np.asarray(correct_PxK), w_rows):
        counts: dict[str, float] = {}
        for a, w in zip(answers, ws):
            if a is not None:
                counts[a] = counts.get(a, 0) + float(w)
        if not counts:
            hits.append(False)
            continue
        top = max(counts, key=counts.get)  # dicts keep insertion order: ties -> first seen
        hits.append(bool(correct[answers.index(top)]))
    return float(np.mean(hits))
