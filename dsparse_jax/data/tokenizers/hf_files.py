"""Hugging Face tokenizer files: what a checkpoint's tokenizer directory holds and the stop
tokens of its generation_config.json.

A checkpoint (Qwen2.5, Qwen3, Llama 3, Gemma) ships tokenizer.json (the `tokenizers`
model), tokenizer_config.json (special tokens, `chat_template`; newer ones put the
template in chat_template.jinja) and generation_config.json (`eos_token_id`: an int or a
list, the tokens that end a completion). transformers and tokenizers (requirements-hf.txt)
are imported only here and in hf.py, when a function needs them.
"""

from __future__ import annotations

import importlib
import json
import os

GENERATION_CONFIG = "generation_config.json"


def require(module: str):
    """Imports an optional package (transformers, tokenizers) or raises a one-line
    ImportError saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"Hugging Face tokenizers need {module}: pip install -r requirements-hf.txt"
        ) from e


def stop_ids(directory: str) -> list[int] | None:
    """`eos_token_id` of directory/generation_config.json as a list (an int or a list
    there); None without the file or the field."""
    path = os.path.join(directory, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object ({e})") from e
    if eos is None:
        return None
    ids = eos if isinstance(eos, list) else [eos]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids
