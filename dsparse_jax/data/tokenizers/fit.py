"""A small tokenizer fitted to your own texts and shaped like a family's own: its special
tokens, chat template and stop tokens, saved as that family's checkpoints ship it. For
smoke tests of the real-data path on CPU (launch/tiny_checkpoint.py); a real run uses the
checkpoint's tokenizer.

  qwen2, qwen3  byte-level BPE, ChatML turns (<|im_start|>user ... <|im_end|>), no BOS,
                stops at <|im_end|> and <|endoftext|>
  llama         byte-level BPE, Llama 3 headers (<|start_header_id|>user<|end_header_id|>),
                BOS <|begin_of_text|>, stops at <|eot_id|>, <|eom_id|>, <|end_of_text|>
  gemma2/3      Gemma's SentencePiece model (gemma.train_gemma_like) and its fast
                tokenizer files, Gemma turns, stops at <end_of_turn> and <eos>

The templates are the authors' (Qwen2.5-Instruct, Qwen3, Llama 3 Instruct), tool
branches left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from dsparse_jax.data.tokenizers import gemma, hf_files

QWEN2_TEMPLATE = r"""
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
QWEN3_TEMPLATE = r"""
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

_CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA3 = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
]
# family -> the special tokens (ids 0..), BOS added by the post-processor, eos, pad, the
# stop tokens of generation_config.json and the chat template.
_CHATML_STYLE = dict(
    specials=_CHATML,
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stops=["<|im_end|>", "<|endoftext|>"],
)
BPE_STYLES = {
    "qwen2": dict(_CHATML_STYLE, template=QWEN2_TEMPLATE),
    "qwen3": dict(_CHATML_STYLE, template=QWEN3_TEMPLATE),
    "llama": dict(
        specials=_LLAMA3,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        stops=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        template=LLAMA3_TEMPLATE,
    ),
}
FAMILIES = tuple(BPE_STYLES) + ("gemma2", "gemma3")


def fit_tokenizer(texts: Iterable[str], family: str, out_dir: str, vocab_size: int = 512):
    """Fits a tokenizer of `family`'s kind to `texts` and saves it in out_dir as that
    family's checkpoints ship theirs. Returns the files written."""
    texts = [t for t in texts if t]
    os.makedirs(out_dir, exist_ok=True)
    if family in ("gemma2", "gemma3"):
        tok = gemma.train_gemma_like(texts, vocab_size)
        tok.save(os.path.join(out_dir, "tokenizer.model"))
        return ["tokenizer.model"] + tok.save_hf(out_dir)
    if family not in BPE_STYLES:
        raise ValueError(f"unknown family {family!r}; choose from {list(FAMILIES)}")
    return _fit_bpe(texts, BPE_STYLES[family], out_dir, vocab_size)


def _fit_bpe(texts: list[str], style: dict, out_dir: str, vocab_size: int) -> list[str]:
    tk = hf_files.require("tokenizers")
    transformers = hf_files.require("transformers")
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        special_tokens=style["specials"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    if style["bos"]:  # BOS first in every encoding with special tokens (Llama 3)
        bos = (style["bos"], backend.token_to_id(style["bos"]))
        backend.post_processor = tk.processors.TemplateProcessing(
            single=f"{style['bos']} $A",
            pair=f"{style['bos']} $A {style['bos']} $B",
            special_tokens=[bos],
        )
    else:
        backend.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=style["bos"],
        eos_token=style["eos"],
        pad_token=style["pad"],
        chat_template=style["template"],
    )
    files = {os.path.basename(f) for f in fast.save_pretrained(out_dir)}
    ids = {k: backend.token_to_id(style[k]) if style[k] else None for k in ("bos", "pad")}
    stops = [backend.token_to_id(t) for t in style["stops"]]
    files.add(hf_files.write_generation_config(out_dir, ids["bos"], stops, ids["pad"]))
    return sorted(files)
