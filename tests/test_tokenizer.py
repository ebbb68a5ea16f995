"""Tokenizer: training, round trips, batching, persistence."""

import numpy as np
import pytest

from dsparse_jax.data.tokenizers.base import Tokenizer, train_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "vars: k3=7 b1=2\nsum: +k3 -b1\n",
    "Hello, World! 0123456789 (x + y) * z = 42;",
    "  leading and trailing spaces  ",
] * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=128, model_type="char")


def test_special_ids(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert tok.vocab_size == 4 + len(set("".join(CORPUS)))


@pytest.mark.parametrize(
    "text",
    ["", "x", "vars: k3=7\nsum: +k3\n", "  two  spaces ", "\nnewline first", "ends with newline\n"],
)
def test_roundtrip(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text)  # char model: one id per character
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text


def test_unknown_char_is_unk(tok):
    assert tok.unk_id in tok.encode("€")


def test_bos_eos(tok):
    ids = tok.encode("abc", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == 5
    assert tok.decode(ids) == "abc"
    # Decoding skips pad/bos and stops at the first eos.
    assert (
        tok.decode([tok.pad_id, tok.bos_id] + tok.encode("ab") + [tok.eos_id] + tok.encode("zz"))
        == "ab"
    )
    # Ids beyond the vocabulary (padded embedding tables) decode as unk, not raise.
    assert tok.decode(tok.encode("a") + [tok.vocab_size + 5]) != "a"


@pytest.mark.parametrize("pad_side", ["right", "left"])
def test_encode_batch(tok, pad_side):
    texts = ["abc", "", "hello world"]
    ids, lengths = tok.encode_batch(texts, add_eos=True, pad_to=16, pad_side=pad_side)
    assert ids.shape == (3, 16) and ids.dtype == np.int32 and lengths.dtype == np.int32
    assert lengths.tolist() == [4, 1, 12]
    for row, text, n in zip(ids, texts, lengths):
        body = row[:n] if pad_side == "right" else row[16 - n :]
        pad = row[n:] if pad_side == "right" else row[: 16 - n]
        assert body.tolist() == tok.encode(text, add_eos=True)
        assert (pad == tok.pad_id).all()
    assert tok.decode_batch(ids) == texts
    if pad_side == "right":
        assert tok.decode_batch(ids, lengths=[2, 0, 5]) == ["ab", "", "hello"]


def test_encode_batch_default_width(tok):
    ids, lengths = tok.encode_batch(["ab", "abcde"], add_bos=True)
    assert ids.shape == (2, 6) and lengths.tolist() == [3, 6]
    empty, _ = tok.encode_batch([])
    assert empty.shape == (0, 0)


def test_encode_batch_too_long(tok):
    with pytest.raises(ValueError, match="text 1"):
        tok.encode_batch(["ab", "abcdef"], pad_to=4)
    with pytest.raises(ValueError, match="pad_side"):
        tok.encode_batch(["ab"], pad_side="middle")


def test_save_load_from_bytes(tok, tmp_path):
    path = tmp_path / "sub" / "tok.model"
    tok.save(path)
    text = "vars: k3=7\nsum: +k3\n"
    for other in (Tokenizer.load(path), Tokenizer.from_bytes(tok.to_bytes())):
        assert other.vocab_size == tok.vocab_size
        assert other.encode(text) == tok.encode(text)
        assert other.decode(other.encode(text)) == text
    with pytest.raises(FileNotFoundError, match="no tokenizer model file"):
        Tokenizer.load(tmp_path / "missing.model")
    with pytest.raises(ValueError):
        Tokenizer.from_bytes(b"not a model")


def test_training_is_deterministic():
    for model_type, size in [("char", 128), ("bpe", 80), ("unigram", 80)]:
        a = train_tokenizer(CORPUS, vocab_size=size, model_type=model_type)
        b = train_tokenizer(iter(CORPUS), vocab_size=size, model_type=model_type)
        assert a.to_bytes() == b.to_bytes(), model_type
        assert (a.pad_id, a.unk_id, a.bos_id, a.eos_id) == (0, 1, 2, 3)
        assert a.decode(a.encode(CORPUS[1])) == CORPUS[1]


def test_char_vocab_limits_and_symbols():
    with pytest.raises(ValueError, match="needs"):
        train_tokenizer(CORPUS, vocab_size=20, model_type="char")
    with pytest.raises(ValueError, match="model_type"):
        train_tokenizer(CORPUS, vocab_size=64, model_type="word")
    with pytest.raises(ValueError, match="empty"):
        train_tokenizer([], vocab_size=64)
    # A trailing newline is still learned; tab needs a user symbol.
    assert train_tokenizer(["ab\n"], vocab_size=16).encode("ab\n")[-1] != 1
    with pytest.raises(ValueError, match="user_defined_symbols"):
        train_tokenizer(["a\tb"], vocab_size=16)
    tok = train_tokenizer(["a\tb", "ab"], vocab_size=16, user_defined_symbols=["\t", "<x>"])
    assert tok.id_to_piece(4) == "\t" and tok.id_to_piece(5) == "<x>"
    assert tok.encode("a<x>\tb") == [tok.encode("a")[0], 5, 4, tok.encode("b")[0]]


def test_byte_fallback():
    tok = train_tokenizer(CORPUS, vocab_size=512, model_type="char", byte_fallback=True)
    ids = tok.encode("é€")
    assert tok.unk_id not in ids
    assert tok.decode(ids) == "é€"
