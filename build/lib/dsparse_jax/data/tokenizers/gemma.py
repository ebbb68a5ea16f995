"""Gemma's SentencePiece tokenizer (tokenizer.model), its chat tokens and math prompts.

Gemma ids: pad 0, eos 1, bos 2, unk 3; the chat turn markers `<start_of_turn>` and
`<end_of_turn>` are single pieces (106 / 107 in the released models). A chat prompt is

    <start_of_turn>user\\n{instruction}\\n\\n{question}<end_of_turn>\\n<start_of_turn>model\\n

(BOS is added by the batcher, as for every tokenizer here), and an instruction-tuned model
ends its turn with `<end_of_turn>`, so with `chat=True` that piece is the stop token the
sampler sees as `eos_id` (decoding stops at it or at `<eos>`). The special markers are
inserted by id, whether or not the SentencePiece model itself recognises them in text.
`save_hf` writes the tokenizer with CHAT_TEMPLATE, the Jinja twin of `render_chat`, so
transformers' `apply_chat_template` gives the ids of our prompts.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm

from dsparse_jax.data.tokenizers import hf_files
from dsparse_jax.data.tokenizers.base import PLAIN_TEMPLATE, Tokenizer

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
CHAT_TOKENS = (START_OF_TURN, END_OF_TURN)
MATH_INSTRUCTION = (
    "Solve the following math problem step by step. Put your final answer within \\boxed{}."
)
# render_chat(messages) as a Jinja chat template (BOS first: transformers tokenizes the
# rendered text without adding special tokens).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set system = messages | selectattr('role', 'equalto', 'system')"
    " | map(attribute='content') | join('\\n\\n') -%}"
    "{%- set turns = messages | rejectattr('role', 'equalto', 'system') | list -%}"
    "{%- set lead = system and (not turns or turns[0]['role'] != 'user') -%}"
    "{%- if lead -%}{{ '<start_of_turn>user\\n' + system + '<end_of_turn>\\n' }}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- set c = system + '\\n\\n' + m['content'] if loop.first and system and not lead"
    " else m['content'] -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + c + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def chat_prompt(user_text: str) -> str:
    """One user turn followed by the opening of the model's turn."""
    return f"{START_OF_TURN}user\n{user_text}{END_OF_TURN}\n{START_OF_TURN}model\n"


def render_chat(messages: list[dict], chat: bool = True) -> str:
    """Chat messages [{role, content}] (system | user | assistant) as Gemma turns, ending
    with the opening of the model's turn. Gemma has no system turn: a system message goes
    before the first user message, as in Gemma's own chat template. chat=False: the
    contents joined by blank lines."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m for m in messages if m["role"] != "system"]
    if system and turns and turns[0]["role"] == "user":
        turns[0] = {"role": "user", "content": system + "\n\n" + turns[0]["content"]}
    elif system:
        turns.insert(0, {"role": "user", "content": system})
    if not chat:
        return "\n\n".join(m["content"].strip() for m in turns) + "\n"
    role = {"user": "user", "assistant": "model"}
    body = "".join(
        f"{START_OF_TURN}{role[m['role']]}\n{m['content']}{END_OF_TURN}\n" for m in turns
    )
    return body + f"{START_OF_TURN}model\n"


def math_prompt(question: str, instruction: str = MATH_INSTRUCTION, chat: bool = True) -> str:
    """Instruction + question; the answer is asked for in \\boxed{}."""
    text = f"{instruction}\n\n{question.strip()}" if instruction else question.strip()
    return chat_prompt(text) if chat else text + "\n"


class GemmaTokenizer(Tokenizer):
    """A Gemma tokenizer.model with chat tokens; `eos_id` is the stop token."""

    def __init__(self, processor: spm.SentencePieceProcessor, chat: bool = True):
        super().__init__(processor)
        self.chat = chat
        self.special = {}
        for piece in CHAT_TOKENS:
            i = processor.piece_to_id(piece)
            if i == processor.unk_id() or i < 0:
                if chat:
                    raise ValueError(
                        f"tokenizer model has no {piece} piece: not a Gemma "
                        "chat tokenizer (use chat=False for a base model)"
                    )
                continue
            self.special[piece] = i
        self._split = (
            re.compile("(" + "|".join(map(re.escape, self.special)) + ")") if self.special else None
        )

    @property
    def eos_id(self) -> int:
        """The stop token: <end_of_turn> for chat prompts, else <eos>."""
        return self.special[END_OF_TURN] if self.chat else self._sp.eos_id()

    @property
    def stop_ids(self) -> frozenset[int]:
        ids = {self._sp.eos_id()}
        if END_OF_TURN in self.special:
            ids.add(self.special[END_OF_TURN])
        return frozenset(ids)

    def render_chat(self, messages: list[dict], chat: bool = True) -> str:
        """The prompt of chat messages: Gemma turns (module `render_chat`)."""
        return render_chat(messages, chat)

    def math_prompt(
        self, question: str, instruction: str = MATH_INSTRUCTION, chat: bool = True
    ) -> str:
        """Instruction + question as a prompt (module `math_prompt`)."""
        return math_prompt(question, instruction, chat)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids; chat markers in the text become their single special ids."""
        ids = [self._sp.bos_id()] if add_bos else []
        parts = self._split.split(text) if self._split else [text]
        for part in parts:
            if part in self.special:
                ids.append(self.special[part])
            elif part:
                ids.extend(self._sp.encode(part, out_type=int))
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first stop token; pad, bos and other control pieces skipped."""
        out = []
        stop = self.stop_ids
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i in stop:
                break
            if i in (self.pad_id, self.bos_id):
                continue
            out.append(i if 0 <= i < self.vocab_size else self.unk_id)
        return self._sp.decode(out)

    def save_hf(self, out_dir: str | os.PathLike) -> list[str]:
        """Hugging Face tokenizer files (base.Tokenizer.save_hf) with CHAT_TEMPLATE (chat)
        or the plain one; generation_config.json lists `stop_ids`."""
        template = CHAT_TEMPLATE if self.chat else PLAIN_TEMPLATE
        return hf_files.write_sentencepiece(self, out_dir, template)

    @classmethod
    def load(cls, path: str | os.PathLike, chat: bool = True) -> GemmaTokenizer:
        """Reads a tokenizer.model file (a directory: its tokenizer.model)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.model")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no SentencePiece tokenizer.model at {path!r}")
        with open(path, "rb") as f:
            return cls.from_bytes(f.read(), chat=chat)

    @classmethod
    def from_bytes(cls, model_proto: bytes, chat: bool = True) -> GemmaTokenizer:
        sp = spm.SentencePieceProcessor()
        try:
            sp.load_from_serialized_proto(model_proto)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"not a SentencePiece model proto: {e}") from e
        return cls(sp, chat=chat)


def train_gemma_like(sentences: Iterable[str], vocab_size: int = 512) -> GemmaTokenizer:
    """A small BPE model with Gemma's special ids and chat pieces (tests, CPU demos)."""
    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([s for s in sentences if s]),
        model_writer=writer,
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        byte_fallback=True,
        user_defined_symbols=list(CHAT_TOKENS) + ["\\boxed"],
        pad_id=0,
        eos_id=1,
        bos_id=2,
        unk_id=3,
        pad_piece="<pad>",
        eos_piece="<eos>",
        bos_piece="<bos>",
        unk_piece="<unk>",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    return GemmaTokenizer.from_bytes(writer.getvalue())
