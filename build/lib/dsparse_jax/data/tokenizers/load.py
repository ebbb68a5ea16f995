"""Which tokenizer a path holds, decided by its files (KINDS), and loading it.

A directory: its tokenizer.json (a Hugging Face checkpoint: hf.HFTokenizer, the authors'
chat template and stop tokens), else its tokenizer.model (Gemma's SentencePiece model:
gemma.GemmaTokenizer, Gemma turns). A file: by its name, *.json or a SentencePiece model.
Naming the file picks its kind in a directory holding both.
"""

from __future__ import annotations

import os

from dsparse_jax.data.tokenizers.gemma import GemmaTokenizer
from dsparse_jax.data.tokenizers.hf import HFTokenizer

# (file, kind) in order of preference for a directory; each kind's loader.
KINDS = (("tokenizer.json", "huggingface"), ("tokenizer.model", "sentencepiece"))
LOADERS = {"huggingface": HFTokenizer.load, "sentencepiece": GemmaTokenizer.load}


def kind_of(path: str | os.PathLike) -> str:
    """The kind of tokenizer at `path` (a key of LOADERS)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name, kind in KINDS:
            if os.path.isfile(os.path.join(path, name)):
                return kind
        raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path!r}")
    return "huggingface" if path.endswith(".json") else "sentencepiece"


def load_tokenizer(path: str | os.PathLike, chat: bool = True) -> GemmaTokenizer | HFTokenizer:
    """The tokenizer at `path` (a directory or a file), chat prompts or plain (`chat`)."""
    return LOADERS[kind_of(path)](path, chat=chat)
