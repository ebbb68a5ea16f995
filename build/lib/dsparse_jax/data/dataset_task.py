"""A dataset's problems as a Task (data/task.py): reshuffled every epoch, fixed widths."""

from __future__ import annotations

import dataclasses

import numpy as np

from dsparse_jax.data.sources import ChatTokenizer, SourceConfig, load_problems
from dsparse_jax.data.task import Problem


class DatasetTask:
    """Dataset problems for the RL loop: reshuffled every epoch, fixed prompt width."""

    def __init__(
        self,
        train: list[Problem],
        eval_: list[Problem],
        max_prompt_tokens: int,
        max_new_tokens: int,
        name: str = "data",
    ):
        if not train or not eval_:
            raise ValueError("DatasetTask needs train and eval problems")
        self.train, self.eval, self.name = train, eval_, name
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self._perm = (None, None)

    def prompt_buffer(self) -> int:
        return self.max_prompt_tokens

    def completion_budget(self) -> int:
        return self.max_new_tokens

    def describe(self) -> str:
        return f"{self.name}: {len(self.train)} train / {len(self.eval)} eval problems"

    def with_terms(self, num_terms: int):
        raise ValueError("a curriculum needs the synthetic chain task (data.source synthetic:)")

    def _order(self, epoch: int, seed: int) -> np.ndarray:
        if self._perm[0] != (epoch, seed):
            rng = np.random.default_rng(np.random.SeedSequence([seed, 7, epoch]))
            self._perm = ((epoch, seed), rng.permutation(len(self.train)))
        return self._perm[1]

    def problems(self, split: str, start: int, count: int, seed: int) -> list[Problem]:
        if split == "eval":
            return [self.eval[i % len(self.eval)] for i in range(start, start + count)]
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        n = len(self.train)
        return [self.train[self._order(i // n, seed)[i % n]] for i in range(start, start + count)]


def build_task(
    uri: str,
    eval_uri: str,
    cfg: SourceConfig,
    tok: ChatTokenizer,
    num_eval: int,
    max_new_tokens: int,
    seed: int,
    eval_split: str = "test",
) -> DatasetTask:
    """A DatasetTask: eval from `eval_uri`, or (empty) the first num_eval of a seeded
    shuffle of the train source, held out from training."""
    train, _ = load_problems(uri, cfg, tok)
    if eval_uri:
        eval_cfg = dataclasses.replace(cfg, split=eval_split)
        eval_, _ = load_problems(eval_uri, eval_cfg, tok)
        eval_ = eval_[:num_eval]
    else:
        if len(train) <= num_eval:
            raise ValueError(
                f"{uri}: {len(train)} problems cannot hold out {num_eval} "
                "for eval; set data.eval_source or a smaller eval.num_problems"
            )
        order = np.random.default_rng(np.random.SeedSequence([seed, 11])).permutation(len(train))
        eval_ = [train[i] for i in order[:num_eval]]
        train = [train[i] for i in order[num_eval:]]
    return DatasetTask(train, eval_, cfg.max_prompt_tokens, max_new_tokens, name=uri)
