"""Turning task problems into the fixed-shape int32 arrays the jitted steps take."""

from __future__ import annotations

import numpy as np

from dsparse_jax.data.task import Problem, Task
from dsparse_jax.data.tokenizers.base import Tokenizer


def sequence_buffer(task: Task, page_size: int) -> int:
    """Static width of prompt + completion, rounded up to whole pages."""
    total = task.prompt_buffer() + task.completion_budget()
    return -(-total // page_size) * page_size


def encode_prompts(tok: Tokenizer, problems: list[Problem], width: int):
    """(prompts int32 [B, width] right-padded, with BOS; lengths int32 [B])."""
    return tok.encode_batch([p.prompt for p in problems], add_bos=True, pad_to=width)


def encode_sft(tok: Tokenizer, problems: list[Problem], width: int):
    """Teacher-forcing batch: tokens [B, width] = BOS prompt solution EOS (right-padded)
    and loss_mask [B, width] = 1 on the solution and EOS tokens (the targets)."""
    tokens = np.full((len(problems), width), tok.pad_id, np.int32)
    mask = np.zeros((len(problems), width), np.float32)
    for i, p in enumerate(problems):
        prompt = tok.encode(p.prompt, add_bos=True)
        target = tok.encode(p.solution, add_eos=True)
        seq = prompt + target
        if len(seq) > width:
            raise ValueError(f"problem {i}: {len(seq)} tokens exceed the buffer {width}")
        tokens[i, : len(seq)] = seq
        mask[i, len(prompt) : len(seq)] = 1.0
    return tokens, mask
