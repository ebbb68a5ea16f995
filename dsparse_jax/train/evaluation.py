"""Held-out evaluation: greedy accuracy and mean@k on the task's eval split."""

from __future__ import annotations

import jax
import numpy as np

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.data import batches, rewards
from dsparse_jax.data.math_task import ChainTaskConfig, Problem
from dsparse_jax.data.tokenizer import Tokenizer
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig, completion_view


def decode_completions(tok: Tokenizer, rollout) -> list[str]:
    return [tok.decode(row) for row in completion_view(rollout, tok.pad_id)]


def score(
    tok: Tokenizer, rollout, problems: list[Problem], rewarder: rewards.Rewarder, where: str = ""
) -> tuple[rewards.Scored, list[str]]:
    """Rewards of a rollout whose rows are `problems` repeated samples_per_prompt times,
    and the completions' text."""
    texts = decode_completions(tok, rollout)
    reps = len(texts) // len(problems)
    rows = [p for p in problems for _ in range(reps)]
    return rewarder.score(rows, texts, where), texts


class Evaluator:
    """Greedy accuracy (and optionally mean@k) on a fixed set of eval problems.

    `spec` (default: the one given at construction, dense) and `lora` select the policy:
    the dense policy (theta, dense attention) or a sparse rollout policy (sparse spec,
    optionally with a LoRA delta tree)."""

    def __init__(
        self,
        sampler: Sampler,
        tok: Tokenizer,
        task: ChainTaskConfig,
        problems: list[Problem],
        spec: AttentionSpec = AttentionSpec(),
        batch_size: int = 64,
        rewarder: rewards.Rewarder | None = None,
    ):
        self.sampler, self.tok, self.problems, self.spec = sampler, tok, problems, spec
        self.rewarder = rewarder or rewards.Rewarder()
        self.batch_size = min(batch_size, len(problems))
        self.max_new = batches.completion_budget(task)
        self.prompt_width = batches.prompt_buffer(task)

    def _accuracy(
        self,
        params,
        cfg: SamplingConfig,
        key,
        lora=None,
        lora_scale=1.0,
        spec: AttentionSpec | None = None,
    ):
        spec = self.spec if spec is None else spec
        correct = []
        for start in range(0, len(self.problems), self.batch_size):
            chunk = self.problems[start : start + self.batch_size]
            pad = self.batch_size - len(chunk)  # keep one static batch shape
            prompts, lengths = batches.encode_prompts(
                self.tok, chunk + chunk[:1] * pad, self.prompt_width
            )
            key, sub = jax.random.split(key)
            rollout = self.sampler(params, prompts, lengths, sub, cfg, spec, lora, lora_scale)
            scored, _ = score(self.tok, rollout, chunk + chunk[:1] * pad, self.rewarder, "eval")
            correct.append(scored.rewards.reshape(len(chunk) + pad, -1)[: len(chunk)])
        return float(np.mean(rewards.is_correct(np.concatenate(correct))))

    def greedy(self, params, lora=None, lora_scale=1.0, spec: AttentionSpec | None = None) -> float:
        cfg = SamplingConfig(
            max_new_tokens=self.max_new,
            eos_id=self.tok.eos_id,
            pad_id=self.tok.pad_id,
            temperature=0.0,
        )
        return self._accuracy(params, cfg, jax.random.key(0), lora, lora_scale, spec)

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
        cfg = SamplingConfig(
            max_new_tokens=self.max_new,
            eos_id=self.tok.eos_id,
            pad_id=self.tok.pad_id,
            temperature=temperature,
            samples_per_prompt=k,
        )
        return self._accuracy(params, cfg, key, lora, lora_scale, spec)
