"""Hugging Face tokenizer files: what a checkpoint's tokenizer directory holds, the stop
tokens of its generation_config.json, and our SentencePiece models written in that form.

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
import shutil
import tempfile

GENERATION_CONFIG = "generation_config.json"
# A Hugging Face tokenizer directory's files; each present one is copied on export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    GENERATION_CONFIG,
)


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


def copy_files(directory: str, out_dir: str | os.PathLike) -> list[str]:
    """Copies the TOKENIZER_FILES present in `directory` to out_dir; their names."""
    os.makedirs(out_dir, exist_ok=True)
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(directory, n))]
    for n in names:
        shutil.copyfile(os.path.join(directory, n), os.path.join(out_dir, n))
    return names


def write_generation_config(out_dir: str | os.PathLike, bos, stops, pad) -> str:
    """generation_config.json with the stop tokens as `eos_token_id` (a list if several)."""
    stops = sorted(stops)
    config = {
        "bos_token_id": bos,
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
        "pad_token_id": pad,
    }
    with open(os.path.join(out_dir, GENERATION_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return GENERATION_CONFIG


def _model_type(model_proto: bytes) -> str:
    from sentencepiece import sentencepiece_model_pb2  # pylint: disable=import-outside-toplevel

    m = sentencepiece_model_pb2.ModelProto()
    m.ParseFromString(model_proto)
    return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(m.trainer_spec.model_type)


def _char_backend(tok):
    """A char SentencePiece model as a `tokenizers` BPE without merges: each character
    its piece (space as '▁'), a run of unknown characters one unk (as SentencePiece);
    control pieces are special tokens."""
    tk = require("tokenizers")
    vocab = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
    unk = tok.id_to_piece(tok.unk_id)
    backend = tk.Tokenizer(tk.models.BPE(vocab, [], unk_token=unk, fuse_unk=True))
    backend.normalizer = tk.normalizers.Replace(" ", "▁")
    backend.decoder = tk.decoders.Replace("▁", " ")
    sp = tok.processor
    special = [i for i in range(tok.vocab_size) if sp.is_control(i) or sp.is_unknown(i)]
    backend.add_special_tokens(
        [tk.AddedToken(tok.id_to_piece(i), normalized=False, special=True) for i in special]
    )
    return backend


def _bpe_backend(tok, model_file: str):
    """A BPE SentencePiece model with Gemma's ids (pad 0, eos 1, bos 2, unk 3; ours from
    gemma.train_gemma_like, or Gemma's own), converted by transformers' GemmaConverter."""
    transformers = require("transformers")
    sp = tok.processor
    layout = (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id())
    if layout != (0, 1, 2, 3):
        raise ValueError(
            f"cannot write tokenizer.json for a BPE SentencePiece model with special ids "
            f"(pad, eos, bos, unk) = {layout}: only Gemma's (0, 1, 2, 3)"
        )
    pieces = {k: tok.id_to_piece(i) for k, i in zip(("pad", "eos", "bos", "unk"), layout)}
    slow = transformers.GemmaTokenizer(
        vocab_file=model_file, **{f"{k}_token": v for k, v in pieces.items()}
    )
    return importlib.import_module("transformers.convert_slow_tokenizer").convert_slow_tokenizer(
        slow
    )


def write_sentencepiece(tok, out_dir: str | os.PathLike, chat_template: str) -> list[str]:
    """A SentencePiece tokenizer of ours (base.Tokenizer or gemma.GemmaTokenizer) as
    transformers' GemmaTokenizerFast saves it: tokenizer.json (the fast tokenizer: a char
    model as BPE without merges, a Gemma BPE model through transformers' converter),
    tokenizer_config.json (`chat_template`, BOS added, eos = `tok.eos_id`),
    special_tokens_map.json, tokenizer.model (the slow tokenizer), plus
    generation_config.json (`tok.stop_ids`). Returns the files written."""
    transformers = require("transformers")
    kind = _model_type(tok.to_bytes())
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_file = os.path.join(tmp, "tokenizer.model")
        tok.save(model_file)
        if kind == "CHAR":
            backend = _char_backend(tok)
        elif kind == "BPE":
            backend = _bpe_backend(tok, model_file)
        else:
            raise ValueError(f"cannot write tokenizer.json for a {kind} SentencePiece model")
        fast = transformers.GemmaTokenizerFast(
            tokenizer_object=backend,
            vocab_file=model_file,
            bos_token=tok.id_to_piece(tok.bos_id),
            eos_token=tok.id_to_piece(tok.eos_id),
            pad_token=tok.id_to_piece(tok.pad_id),
            unk_token=tok.id_to_piece(tok.unk_id),
            add_bos_token=True,
            add_eos_token=False,
            chat_template=chat_template,
            model_max_length=1_000_000,
        )
        written = fast.save_pretrained(os.fspath(out_dir), save_jinja_files=False)
    files = sorted({os.path.basename(f) for f in written if os.path.isfile(f)})
    return files + [write_generation_config(out_dir, tok.bos_id, tok.stop_ids, tok.pad_id)]
