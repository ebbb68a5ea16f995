"""A tiny random checkpoint of any family, with a tokenizer fitted to a data file: the
whole real-data pipeline (load, chat template, rollout, reward, update, export, evaluate)
runs on it on a laptop CPU in minutes (launch/tiny_checkpoint.py, docs/real_models.md).

Its weights are random, so its accuracy is about zero: it tests the plumbing, not the
method.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx

from dsparse_jax.data import sources
from dsparse_jax.data.tokenizers import fit
from dsparse_jax.data.tokenizers.gemma import MATH_INSTRUCTION
from dsparse_jax.data.tokenizers.load import load_tokenizer
from dsparse_jax.model import hf_checkpoint
from dsparse_jax.model.config import tiny_of
from dsparse_jax.model.transformer import Transformer

MAX_TEXTS = 20_000  # records read for fitting the tokenizer


def _strings(value):
    """Every string in a record (nested dicts and lists: verl's chat messages too)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def build(out_dir: str, family: str, data: str, vocab_size: int = 512, seed: int = 0) -> dict:
    """Writes a Hugging Face checkpoint directory (config.json, model.safetensors, the
    tokenizer files, generation_config.json) of a tiny random `family` model whose
    tokenizer is fitted to the records of data source `data`. Returns a summary."""
    records = [r for r in sources.read_records(data) if isinstance(r, dict)][:MAX_TEXTS]
    if not records:
        raise ValueError(f"data source {data!r}: no readable records")
    texts = [s for r in records for s in _strings(r)] + [MATH_INSTRUCTION]
    files = fit.fit_tokenizer(texts, family, out_dir, vocab_size)
    tok = load_tokenizer(out_dir)
    cfg = tiny_of(family, tok.vocab_size)
    model = Transformer(cfg, nnx.Rngs(seed))
    params = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    hf = hf_checkpoint.hf_config_from(cfg)
    hf.update(pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    files += hf_checkpoint.export(out_dir, params, cfg, dtype="float32", hf_config=hf)
    return {
        "out": os.path.abspath(out_dir),
        "family": family,
        "records": len(records),
        "vocab_size": tok.vocab_size,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "files": sorted(set(files)),
    }
