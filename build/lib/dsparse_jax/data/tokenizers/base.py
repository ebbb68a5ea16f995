"""SentencePiece tokenizer wrapper, trained in process (no files, no downloads).

Special ids are the same for every model trained here: pad=0, unk=1, bos=2, eos=3.
Text is not normalized (identity rule, no dummy prefix, whitespace kept), so
`decode(encode(text)) == text` for any text made of characters the model knows.
The batch helpers (`encode_batch`, `decode_batch`) are written over any tokenizer's
`encode`, `decode` and `pad_id`: `hf.HFTokenizer` uses them too.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from dsparse_jax.data.tokenizers import hf_files

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MODEL_TYPES = ("char", "bpe", "unigram")

# The chat template written with a tokenizer whose prompts are plain text (this char
# tokenizer, a Gemma base model): BOS, then the messages' contents, stripped, joined by
# blank lines, then a newline; system messages first, merged into the first user
# message. The Jinja twin of gemma.render_chat(messages, chat=False).
PLAIN_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set system = messages | selectattr('role', 'equalto', 'system')"
    " | map(attribute='content') | join('\\n\\n') -%}"
    "{%- set turns = messages | rejectattr('role', 'equalto', 'system') | list -%}"
    "{%- set lead = system and (not turns or turns[0]['role'] != 'user') -%}"
    "{%- if lead -%}{{ system | trim }}{{ '\\n\\n' if turns else '\\n' }}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- set c = system + '\\n\\n' + m['content'] if loop.first and system and not lead"
    " else m['content'] -%}"
    "{{ c | trim }}{{ '\\n' if loop.last else '\\n\\n' }}"
    "{%- endfor -%}"
)


class Tokenizer:
    """Thin wrapper over a `SentencePieceProcessor` with batch helpers."""

    def __init__(self, processor: spm.SentencePieceProcessor):
        self._sp = processor
        ids = {
            "pad": processor.pad_id(),
            "unk": processor.unk_id(),
            "bos": processor.bos_id(),
            "eos": processor.eos_id(),
        }
        for name, i in ids.items():
            if i < 0:
                raise ValueError(f"tokenizer model has no {name} piece (id {i})")
        if len(set(ids.values())) != len(ids):
            raise ValueError(f"tokenizer special ids must be distinct, got {ids}")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        return self._sp.unk_id()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def stop_ids(self) -> frozenset[int]:
        """The tokens that end a completion (the sampler's and decode's): eos."""
        return frozenset({self.eos_id})

    @property
    def processor(self) -> spm.SentencePieceProcessor:
        return self._sp

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    # -- encoding ------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in bos/eos."""
        return self._sp.encode(text, out_type=int, add_bos=add_bos, add_eos=add_eos)

    def encode_batch(
        self,
        texts: Sequence[str],
        add_bos: bool = False,
        add_eos: bool = False,
        pad_to: int | None = None,
        pad_side: str = "right",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encodes and pads texts: ids int32 [B, L] and lengths int32 [B] (`encode_batch`)."""
        return encode_batch(self, texts, add_bos, add_eos, pad_to, pad_side)

    # -- decoding ------------------------------------------------------------

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`: pad and bos are skipped, decoding stops at the first eos.

        Ids outside [0, vocab_size) (e.g. sampled from a padded embedding table)
        decode as unk instead of raising.
        """
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i == self.eos_id:
                break
            if i == self.pad_id or i == self.bos_id:
                continue
            out.append(i if 0 <= i < self.vocab_size else self.unk_id)
        return self._sp.decode(out)

    def decode_batch(
        self, ids_2d: np.ndarray, lengths: Sequence[int] | np.ndarray | None = None
    ) -> list[str]:
        """Decodes each row; with `lengths`, row i is cut to `row[:lengths[i]]` first."""
        return decode_batch(self, ids_2d, lengths)

    # -- persistence ---------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The serialized SentencePiece model proto."""
        return self._sp.serialized_model_proto()

    def save_hf(self, out_dir: str | os.PathLike) -> list[str]:
        """Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json with a chat
        template: prompts as plain text after BOS, tokenizer.model, generation_config.json),
        loadable by transformers' AutoTokenizer, fast or slow. Returns the files written."""
        return hf_files.write_sentencepiece(self, out_dir, PLAIN_TEMPLATE)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the model proto to `path`, creating parent directories."""
        path = os.fspath(path)
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Reads a model written by `save` (or any SentencePiece .model file)."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer model file at {path!r}")
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> Tokenizer:
        """Builds a tokenizer from a serialized model proto."""
        sp = spm.SentencePieceProcessor()
        try:
            sp.load_from_serialized_proto(model_proto)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"not a SentencePiece model proto: {e}") from e
        return cls(sp)


def encode_batch(
    tok,
    texts: Sequence[str],
    add_bos: bool = False,
    add_eos: bool = False,
    pad_to: int | None = None,
    pad_side: str = "right",
) -> tuple[np.ndarray, np.ndarray]:
    """`tok`'s encodings of texts, padded with its pad_id: ids int32 [B, L], lengths [B].

    L is `pad_to` if given, else the longest encoding. `pad_side='right'` puts
    the tokens at columns [0, len), 'left' at [L - len, L).
    """
    if pad_side not in ("right", "left"):
        raise ValueError(f"pad_side must be 'right' or 'left', got {pad_side!r}")
    if pad_to is not None and pad_to < 0:
        raise ValueError(f"pad_to must be >= 0, got {pad_to}")
    seqs = [tok.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]
    lengths = np.array([len(s) for s in seqs], dtype=np.int32)
    width = pad_to if pad_to is not None else int(lengths.max(initial=0))
    for i, s in enumerate(seqs):
        if len(s) > width:
            raise ValueError(f"text {i} encodes to {len(s)} tokens, more than pad_to={width}")
    ids = np.full((len(seqs), width), tok.pad_id, dtype=np.int32)
    for i, s in enumerate(seqs):
        if s and pad_side == "right":
            ids[i, : len(s)] = s
        elif s:
            ids[i, width - len(s) :] = s
    return ids, lengths


def decode_batch(
    tok, ids_2d: np.ndarray, lengths: Sequence[int] | np.ndarray | None = None
) -> list[str]:
    """`tok.decode` of each row; with `lengths`, row i is cut to `row[:lengths[i]]` first."""
    rows = np.asarray(ids_2d)
    if rows.ndim != 2:
        raise ValueError(f"ids_2d must be 2-D, got shape {rows.shape}")
    if lengths is not None and len(lengths) != rows.shape[0]:
        raise ValueError(f"got {len(lengths)} lengths for {rows.shape[0]} rows")
    if lengths is None:
        return [tok.decode(row) for row in rows]
    return [tok.decode(row[: int(n)]) for row, n in zip(rows, lengths)]


def train_tokenizer(
    sentences: Iterable[str],
    vocab_size: int,
    model_type: str = "char",
    user_defined_symbols: Sequence[str] = (),
    byte_fallback: bool = False,
) -> Tokenizer:
    """Trains a SentencePiece model in memory; the same input gives the same model.

    'char': the vocabulary is exactly the 4 specials, the user symbols, 256 byte
    pieces if `byte_fallback`, and every distinct character of `sentences`, so no
    character seen in training is ever unk (ValueError if the trainer cannot learn
    one, e.g. tab: pass it in `user_defined_symbols`). Ids follow the order of
    `user_defined_symbols`, then character frequency. `vocab_size` is an upper
    limit here: ValueError (saying how many are needed) if it is too small.
    'bpe' / 'unigram': `vocab_size` is the target; a smaller vocabulary comes back
    when the corpus cannot fill it.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    sents = [s for s in sentences if s]
    if not sents:
        raise ValueError("sentences is empty: nothing to train a tokenizer on")
    user_defined_symbols = list(user_defined_symbols)
    num_special = 4 + len(user_defined_symbols) + (256 if byte_fallback else 0)
    chars = set("".join(sents))
    if model_type == "char":
        # The trainer drops a sentence's trailing newlines: one more sentence with
        # every character, whitespace first, makes sure each is seen.
        sents.append("".join(sorted(chars)))
        # An upper bound on what the char model needs; it keeps exactly what it sees.
        train_size = num_special + len(chars)
    else:
        train_size = vocab_size
    if vocab_size <= num_special:
        raise ValueError(
            f"vocab_size={vocab_size} leaves no room beyond the "
            f"{num_special} special/user/byte pieces"
        )
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sents),
        model_writer=writer,
        model_type=model_type,
        vocab_size=train_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=byte_fallback,
        user_defined_symbols=user_defined_symbols,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=max(4192, max(len(s.encode()) for s in sents) + 1),
        num_threads=1,
        minloglevel=2,
    )
    tok = Tokenizer.from_bytes(writer.getvalue())
    if model_type == "char":
        missing = sorted(c for c in chars if tok.unk_id in tok.encode(c))
        if missing:
            raise ValueError(
                f"the char model could not learn {missing}; pass them in user_defined_symbols"
            )
    if tok.vocab_size > vocab_size:
        raise ValueError(
            f"the {model_type!r} vocabulary needs {tok.vocab_size} pieces, "
            f"more than vocab_size={vocab_size}"
        )
    return tok
