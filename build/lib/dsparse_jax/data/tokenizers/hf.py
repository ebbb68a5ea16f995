"""A checkpoint's own tokenizer (tokenizer.json), as its authors ship it: transformers'
fast tokenizer, the chat template of its tokenizer_config.json (or chat_template.jinja)
through `apply_chat_template`, the stop tokens of its generation_config.json.

The interface is the one the rest of the code uses of `base.Tokenizer` and
`gemma.GemmaTokenizer`: encode / decode and their batch forms, pad / bos / eos ids,
`stop_ids`, `vocab_size`, `render_chat` and `math_prompt`. Ids:

- `eos_id`: the tokenizer's eos token (else the first stop token); `add_eos` appends it.
- `stop_ids`: generation_config.json's `eos_token_id` (an int or a list) and `eos_id`.
  The sampler stops at any of them; decoding stops at the first.
- `pad_id`: the pad token, else `eos_id` (Llama 3 has none; padding only fills buffers).
- `bos_id`: the bos token or None (Qwen). `encode(add_bos=True)` puts it first when the
  tokenizer's own encoding starts with it (Llama 3, Gemma: `tokenizer(text)`) and the text
  does not already begin with it (a chat template that writes it), so a prompt's ids are
  exactly `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from dsparse_jax.data.tokenizers import hf_files
from dsparse_jax.data.tokenizers.base import decode_batch, encode_batch
from dsparse_jax.data.tokenizers.gemma import MATH_INSTRUCTION, render_chat


class HFTokenizer:
    """transformers' fast tokenizer of a checkpoint directory (`load`)."""

    def __init__(self, hf, directory: str, chat: bool = True, stops: Sequence[int] = ()):
        """`hf`: the transformers tokenizer; `stops`: generation_config.json's stop ids."""
        if not getattr(hf, "is_fast", False):
            raise ValueError(
                f"{directory}: transformers loaded a slow tokenizer, not tokenizer.json"
            )
        if chat and not hf.chat_template:
            raise ValueError(
                f"{directory}: tokenizer_config.json has no chat_template (set "
                "tokenizer.chat=False for a base model)"
            )
        self._hf, self.directory, self.chat = hf, directory, chat
        eos = hf.eos_token_id
        if eos is None and stops:
            eos = stops[0]
        if eos is None:
            raise ValueError(
                f"{directory}: no eos token (neither tokenizer_config.json nor "
                f"{hf_files.GENERATION_CONFIG} names one)"
            )
        self._eos = int(eos)
        self._stops = frozenset(int(i) for i in stops) | {self._eos}
        self._pad = hf.pad_token_id if hf.pad_token_id is not None else self._eos
        self._bos = hf.bos_token_id
        own = hf("", add_special_tokens=True)["input_ids"]
        self._adds_bos = self._bos is not None and own[:1] == [self._bos]

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def unk_id(self) -> int | None:
        return self._hf.unk_token_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stops

    @property
    def hf(self):
        """The transformers tokenizer."""
        return self._hf

    def id_to_piece(self, i: int) -> str:
        return self._hf.convert_ids_to_tokens(int(i))

    # -- prompts -------------------------------------------------------------

    def render_chat(self, messages: list[dict], chat: bool = True) -> str:
        """Chat messages [{role, content}] as the checkpoint's chat template renders them,
        ending with the opening of the assistant's turn. chat=False: the contents joined
        by blank lines (as gemma.render_chat)."""
        if not chat:
            return render_chat(messages, chat=False)
        jinja2 = hf_files.require("jinja2")
        try:
            return self._hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as e:
            raise ValueError(
                f"{self.directory}: the chat template refused the messages: {e}"
            ) from e

    def math_prompt(
        self, question: str, instruction: str = MATH_INSTRUCTION, chat: bool = True
    ) -> str:
        """Instruction + question: one user message, through the chat template (chat)."""
        text = f"{instruction}\n\n{question.strip()}" if instruction else question.strip()
        if not chat:
            return text + "\n"
        return self.render_chat([{"role": "user", "content": text}])

    # -- encoding ------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids (special tokens in the text, e.g. a template's, are single ids)."""
        ids = self._hf.encode(text, add_special_tokens=False)
        if add_bos and self._adds_bos and ids[:1] != [self._bos]:
            ids = [self._bos] + ids
        if add_eos:
            ids.append(self._eos)
        return ids

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
        """Text up to the first stop token; pad and bos skipped, ids outside the vocabulary
        (a padded embedding table) dropped."""
        out, n = [], self.vocab_size
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            if i in self._stops:
                break
            if i not in (self._pad, self._bos) and 0 <= i < n:
                out.append(i)
        return self._hf.decode(out)

    def decode_batch(
        self, ids_2d: np.ndarray, lengths: Sequence[int] | np.ndarray | None = None
    ) -> list[str]:
        """Decodes each row; with `lengths`, row i is cut to `row[:lengths[i]]` first."""
        return decode_batch(self, ids_2d, lengths)

    # -- persistence ---------------------------------------------------------

    def save_hf(self, out_dir: str | os.PathLike) -> list[str]:
        """Copies the checkpoint's tokenizer files (hf_files.TOKENIZER_FILES, with
        generation_config.json) to out_dir; their names."""
        return hf_files.copy_files(self.directory, out_dir)

    @classmethod
    def load(cls, path: str | os.PathLike, chat: bool = True) -> HFTokenizer:
        """The tokenizer of a directory holding tokenizer.json (or of that file)."""
        path = os.fspath(path)
        directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
        if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
            raise FileNotFoundError(f"no tokenizer.json in {directory!r}")
        transformers = hf_files.require("transformers")
        try:
            hf = transformers.AutoTokenizer.from_pretrained(
                directory, use_fast=True, local_files_only=True
            )
        except Exception as e:  # a bad file: transformers and tokenizers raise many kinds
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ValueError(
                f"{directory}: transformers cannot load its tokenizer: {reason}"
            ) from e
        return cls(hf, directory, chat, hf_files.stop_ids(directory) or ())
