"""Checkpoints' own tokenizers (tokenizer.json, the chat template of tokenizer_config.json,
the stop tokens of generation_config.json) and the tokenizer files our export writes.

Tiny byte-level BPE tokenizers are trained here with `tokenizers`, wrapped in transformers'
PreTrainedTokenizerFast with Qwen2.5 / Qwen3 ChatML, Llama 3 and Gemma 3 style templates
and saved as checkpoints save them. The prompt ids our code feeds the sampler must equal
transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.
"""

import json
import os
import shutil
import sys
import types

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="requirements-hf.txt not installed")
tk = pytest.importorskip("tokenizers", reason="requirements-hf.txt not installed")

from dsparse_jax.data import batches, math_task, sources  # noqa: E402
from dsparse_jax.data.task import Problem  # noqa: E402
from dsparse_jax.data.tokenizers import fit, hf_files  # noqa: E402
from dsparse_jax.data.tokenizers import gemma as gt  # noqa: E402
from dsparse_jax.data.tokenizers.hf import HFTokenizer  # noqa: E402
from dsparse_jax.data.tokenizers.load import kind_of, load_tokenizer  # noqa: E402

SENTENCES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether?",
    "You are a helpful assistant. Be brief. Answer with a number.",
    gt.MATH_INSTRUCTION,
    "system user assistant model 0123456789 +-*/=()[]{}.,;:?!$#%",
] * 5

QWEN2, QWEN3, LLAMA3 = fit.QWEN2_TEMPLATE, fit.QWEN3_TEMPLATE, fit.LLAMA3_TEMPLATE
# Gemma 3 IT's template, its whitespace control made explicit.
GEMMA3 = r"""{{- bos_token -}}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") -}}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") -}}
    {{- message['content'] | trim -}}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# specials: special tokens (ids 0..); bos: also added by the tokenizer's post-processor
# (Llama 3, Gemma); stops: generation_config.json's eos_token_id; jinja: the template in
# chat_template.jinja (newer checkpoints) instead of tokenizer_config.json.
FAMILIES = {
    "qwen2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        template=QWEN2,
        stops=["<|im_end|>", "<|endoftext|>"],
        jinja=False,
    ),
    "qwen3": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<think>", "</think>"],
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        template=QWEN3,
        stops=["<|im_end|>", "<|endoftext|>"],
        jinja=True,
    ),
    "llama3": dict(
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eom_id|>",
            "<|eot_id|>",
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,
        template=LLAMA3,
        stops=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        jinja=False,
    ),
    "gemma": dict(
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        template=GEMMA3,
        stops=["<eos>", "<end_of_turn>"],
        jinja=False,
    ),
}

MESSAGES = [
    [{"role": "user", "content": "How many clips did Natalia sell?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many clips in April?"},
    ],
    [
        {"role": "user", "content": "How many clips in April?"},
        {"role": "assistant", "content": "48 clips."},
        {"role": "user", "content": "And in May?"},
    ],
]


def make_checkpoint_tokenizer(family: str, out_dir, template: bool = True) -> str:
    """A tiny byte-level BPE tokenizer of `family` saved as a checkpoint ships it."""
    f = FAMILIES[family]
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320,
        show_progress=False,
        special_tokens=f["specials"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(SENTENCES, trainer)
    if f["bos"]:  # BOS first in every encoding with special tokens (Llama 3, Gemma)
        bos = (f["bos"], backend.token_to_id(f["bos"]))
        backend.post_processor = tk.processors.TemplateProcessing(
            single=f"{f['bos']} $A", pair=f"{f['bos']} $A {f['bos']} $B", special_tokens=[bos]
        )
    else:
        backend.post_processor = tk.processors.ByteLevel(trim_offsets=False)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=f["bos"],
        eos_token=f["eos"],
        pad_token=f["pad"],
        chat_template=f["template"] if template else None,
    )
    fast.add_tokens(f.get("added", []))
    out_dir = os.fspath(out_dir)
    fast.save_pretrained(out_dir, save_jinja_files=f["jinja"])
    stops = [backend.token_to_id(t) for t in f["stops"]]
    with open(os.path.join(out_dir, hf_files.GENERATION_CONFIG), "w") as fh:
        json.dump({"bos_token_id": None, "eos_token_id": stops}, fh)
    return out_dir


def reference(directory):
    """transformers' own tokenizer of a directory (fast)."""
    return transformers.AutoTokenizer.from_pretrained(directory)


def want_ids(ref, messages) -> list[int]:
    return list(ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def prompt_ids(tok, prompts: list[str], width: int = 192) -> list[list[int]]:
    """What the sampler is fed: the batcher's rows (BOS added as for every task)."""
    problems = [Problem(prompt=p, solution="", answer="") for p in prompts]
    ids, lengths = batches.encode_prompts(tok, problems, width)
    return [row[:n].tolist() for row, n in zip(ids, lengths)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    d = make_checkpoint_tokenizer(name, tmp_path_factory.mktemp(name))
    return name, d, load_tokenizer(d), reference(d)


def test_chat_prompt_ids_equal_apply_chat_template(family):
    name, _, tok, ref = family
    assert isinstance(tok, HFTokenizer)
    got = prompt_ids(tok, [tok.render_chat(m) for m in MESSAGES])
    for m, ids in zip(MESSAGES, got):
        want = want_ids(ref, m)
        assert ids == want, (name, m)
        # The comparison sees the generation prompt: without it the ids differ.
        assert want != list(ref.apply_chat_template(m, tokenize=True))
    bos = FAMILIES[name]["bos"]
    for ids in got:  # BOS once where the family has one (its template writes it), else none
        n_bos = sum(i == tok.bos_id for i in ids) if bos else 0
        assert n_bos == (1 if bos else 0) and (ids[0] == tok.bos_id) == bool(bos)


def test_dataset_prompts_equal_apply_chat_template(family, tmp_path):
    """Through sources: a question record (instruction + question, one user turn) and a
    verl record (chat messages) give exactly the template's ids."""
    name, _, tok, ref = family
    question = "Natalia sold 48 clips in April. How many clips?"
    records = [
        {"question": question, "answer": "#### 48"},
        {"prompt": MESSAGES[1], "reward_model": {"ground_truth": "48"}},
    ]
    cfg = sources.SourceConfig(max_prompt_tokens=256)
    problems, stats = sources.to_problems(records, cfg, tok)
    assert stats["kept"] == 2 and stats["truncated"] == 0
    user = {"role": "user", "content": f"{gt.MATH_INSTRUCTION}\n\n{question}"}
    want = [want_ids(ref, [user]), want_ids(ref, MESSAGES[1])]
    ids, lengths = batches.encode_prompts(tok, problems, 256)
    assert [row[:n].tolist() for row, n in zip(ids, lengths)] == want, name


def test_plain_text_encodes_as_the_tokenizer_does(family):
    """chat=False prompts: add_bos gives the tokenizer's own `tokenizer(text)` ids (BOS
    for Llama 3 and Gemma, none for Qwen); decode inverts encode."""
    name, d, _, ref = family
    plain = load_tokenizer(d, chat=False)
    text = plain.math_prompt("How many clips?", chat=False)
    assert text == gt.MATH_INSTRUCTION + "\n\nHow many clips?\n"
    assert plain.render_chat(MESSAGES[1], chat=False) == "Be brief.\n\nHow many clips in April?\n"
    assert plain.encode(text, add_bos=True) == ref(text)["input_ids"], name
    assert plain.decode(plain.encode(text, add_bos=True)) == text


def test_stop_ids_from_generation_config(family, tmp_path):
    name, d, tok, ref = family
    f = FAMILIES[name]
    stops = {ref.convert_tokens_to_ids(t) for t in f["stops"]}
    assert tok.eos_id == ref.convert_tokens_to_ids(f["eos"]) and tok.stop_ids == stops
    assert tok.pad_id == (ref.pad_token_id if f["pad"] else tok.eos_id)  # Llama 3: no pad
    body = tok.encode("48 clips.")
    for s in stops:  # decoding ends at any of them
        assert tok.decode(body + [s] + tok.encode("more")) == "48 clips."
    assert tok.decode(body + [tok.pad_id, 10**6]) == "48 clips."  # pad, outside the vocab
    # The sampler is told every stop token.
    from dsparse_jax.train import rollouts

    ctx = types.SimpleNamespace(tok=tok, task=types.SimpleNamespace(completion_budget=lambda: 8))
    cfg = rollouts.sampling_config(ctx, 0.0)
    assert {cfg.eos_id, *cfg.stop_ids} == stops
    # An int, no eos_token_id, no file: the tokenizer's eos alone (plus the int).
    other = shutil.copytree(d, tmp_path / "other")
    gen = other / hf_files.GENERATION_CONFIG
    gen.write_text(json.dumps({"eos_token_id": 7}))
    assert load_tokenizer(other).stop_ids == {7, tok.eos_id}
    gen.write_text(json.dumps({"bos_token_id": 1}))
    assert load_tokenizer(other).stop_ids == {tok.eos_id}
    gen.unlink()
    assert load_tokenizer(other).stop_ids == {tok.eos_id}
    gen.write_text(json.dumps({"eos_token_id": "<eos>"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        load_tokenizer(other)


def test_kind_is_chosen_by_files(tmp_path):
    hf_dir = make_checkpoint_tokenizer("qwen2", tmp_path / "hf")
    sp = gt.train_gemma_like(SENTENCES, vocab_size=400)
    sp.save(tmp_path / "sp" / "tokenizer.model")
    both = shutil.copytree(hf_dir, tmp_path / "both")
    sp.save(both / "tokenizer.model")
    assert kind_of(hf_dir) == kind_of(both) == "huggingface"
    assert kind_of(tmp_path / "sp") == kind_of(both / "tokenizer.model") == "sentencepiece"
    assert isinstance(load_tokenizer(both), HFTokenizer)
    assert isinstance(load_tokenizer(both / "tokenizer.model"), gt.GemmaTokenizer)
    assert isinstance(load_tokenizer(tmp_path / "sp"), gt.GemmaTokenizer)
    assert isinstance(load_tokenizer(both / "tokenizer.json"), HFTokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        FileNotFoundError, match="no tokenizer.json or tokenizer.model in '.*empty'"
    ):
        load_tokenizer(tmp_path / "empty")


def test_errors_name_the_directory(tmp_path, monkeypatch):
    d = make_checkpoint_tokenizer("qwen2", tmp_path / "base", template=False)
    with pytest.raises(ValueError, match=r"base.*no chat_template.*tokenizer.chat=False"):
        load_tokenizer(d)
    assert load_tokenizer(d, chat=False).math_prompt("q", chat=False).endswith("\n\nq\n")
    g = make_checkpoint_tokenizer("gemma", tmp_path / "gemma")
    with pytest.raises(ValueError, match="gemma: the chat template refused.*alternate"):
        load_tokenizer(g).render_chat([{"role": "assistant", "content": "hi"}])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="bad: transformers cannot load its tokenizer"):
        load_tokenizer(tmp_path / "bad")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError) as e:
        load_tokenizer(g)
    assert str(e.value) == (
        "Hugging Face tokenizers need transformers: pip install -r requirements-hf.txt"
    )


def test_a_run_uses_the_checkpoint_tokenizer(tmp_path):
    """context.build with tokenizer.path at a Llama 3 style tokenizer directory: the
    dataset's prompts are the template's ids, the sampler stops at every stop token, and
    the evaluator runs (a random model; the path runs end to end)."""
    from dsparse_jax.config.validate import load_config
    from dsparse_jax.train import context

    d = make_checkpoint_tokenizer("llama3", tmp_path / "llama3")
    ref = reference(d)
    questions = [f"Natalia sold {i} clips in April. How many clips?" for i in range(12)]
    with open(tmp_path / "train.jsonl", "w") as f:
        for i, q in enumerate(questions):
            f.write(json.dumps({"question": q, "answer": f"#### {i}"}) + "\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    c = load_config(os.path.join(root, "configs", "gemma_math.py"))
    c.sft.enabled = False
    c.tokenizer.path = d
    c.data.source = f"jsonl:{tmp_path}/train.jsonl"
    c.data.max_prompt_tokens, c.data.max_new_tokens = 128, 4
    c.eval.num_problems = 4
    c.model.d_model, c.model.num_layers, c.model.mlp_dim = 32, 2, 64
    ctx = context.build(c)
    try:
        assert isinstance(ctx.tok, HFTokenizer) and ctx.model_cfg.vocab_size == len(ref)
        problems = ctx.task.train + ctx.task.eval
        want = {
            tuple(want_ids(ref, [{"role": "user", "content": f"{c.data.instruction}\n\n{q}"}]))
            for q in questions
        }
        assert {tuple(ids) for ids in prompt_ids(ctx.tok, [p.prompt for p in problems])} == want
        stops = {ref.convert_tokens_to_ids(t) for t in FAMILIES["llama3"]["stops"]}
        scfg = ctx.evaluator.sampling_config(0.0)
        assert {scfg.eos_id, *scfg.stop_ids} == stops
        assert ctx.evaluator.greedy(ctx.init_params) == 0.0
    finally:
        ctx.rewarder.close()


# ------------------------------------------------------------------------------- export
def test_export_copies_a_checkpoint_tokenizer(family, tmp_path):
    name, d, tok, ref = family
    files = tok.save_hf(tmp_path / "out")
    present = sorted(f for f in os.listdir(d))
    assert sorted(files) == present and "tokenizer.json" in files
    back = reference(tmp_path / "out")
    assert back.is_fast
    for m in MESSAGES:
        assert want_ids(back, m) == want_ids(ref, m)
    again = load_tokenizer(tmp_path / "out")
    assert again.stop_ids == tok.stop_ids and again.eos_id == tok.eos_id


@pytest.mark.parametrize("chat", [True, False])
def test_sentencepiece_gemma_export_loads_fast(tmp_path, chat):
    """Our Gemma SentencePiece tokenizer, exported: transformers' fast AutoTokenizer loads
    it and its chat template gives the ids of our chat format; the slow one still loads;
    our loader reads the export back (tokenizer.json) with the same prompt ids."""
    tok = gt.GemmaTokenizer.from_bytes(
        gt.train_gemma_like(SENTENCES, vocab_size=400).to_bytes(), chat=chat
    )
    out = tmp_path / "out"
    files = tok.save_hf(out)
    assert {"tokenizer.json", "tokenizer_config.json", "tokenizer.model"} <= set(files)
    fast = transformers.AutoTokenizer.from_pretrained(out)
    slow = transformers.AutoTokenizer.from_pretrained(out, use_fast=False)
    assert fast.is_fast and not slow.is_fast
    for m in MESSAGES:
        ours = tok.encode(tok.render_chat(m, chat), add_bos=True)
        assert want_ids(fast, m) == ours
        assert want_ids(slow, m) == ours
    text = "  Natalia sold 48 clips.\n\nHow many?\t" + gt.START_OF_TURN + "ünï 😀"
    assert fast.encode(text, add_special_tokens=False) == tok.encode(text)
    assert fast.encode(text) == tok.encode(text, add_bos=True)
    assert fast.decode(tok.encode(text)) == text
    assert (fast.eos_token_id, fast.pad_token_id, fast.bos_token_id) == (
        tok.eos_id,
        tok.pad_id,
        tok.bos_id,
    )
    with open(out / hf_files.GENERATION_CONFIG) as f:
        assert json.load(f)["eos_token_id"] == sorted(tok.stop_ids)
    back = load_tokenizer(out, chat=chat)
    assert isinstance(back, HFTokenizer) and back.stop_ids == tok.stop_ids
    assert back.eos_id == tok.eos_id
    prompts = [tok.math_prompt("How many clips?", chat=chat)] + [
        tok.render_chat(m, chat) for m in MESSAGES
    ]
    again = [back.math_prompt("How many clips?", chat=chat)] + [
        back.render_chat(m, chat) for m in MESSAGES
    ]
    assert prompt_ids(back, again) == prompt_ids(tok, prompts)


def test_char_tokenizer_export_loads_fast(tmp_path):
    """The chain task's char tokenizer, exported: fast and slow transformers tokenizers
    give our ids (unknown characters too), the chat template our prompts with BOS."""
    task = math_task.ChainTaskConfig()
    tok = math_task.build_tokenizer(task, 0)
    tok.save_hf(tmp_path)
    fast = transformers.AutoTokenizer.from_pretrained(tmp_path)
    slow = transformers.AutoTokenizer.from_pretrained(tmp_path, use_fast=False)
    assert fast.is_fast
    p = math_task.make_problem(task, "eval", 0, 0)
    for text in (p.prompt + p.solution, "vars: QQ? é a\n\n b", ""):
        assert fast.encode(text, add_special_tokens=False) == tok.encode(text), text
        assert slow.encode(text, add_special_tokens=False) == tok.encode(text), text
    assert fast.decode(tok.encode(p.prompt)) == p.prompt
    user = [{"role": "user", "content": p.prompt}]
    assert want_ids(fast, user) == tok.encode(p.prompt, add_bos=True)
    assert (fast.eos_token_id, fast.pad_token_id) == (tok.eos_id, tok.pad_id)
    assert np.array_equal(
        batches.encode_prompts(tok, [p], 300)[0][0][: len(want_ids(fast, user))],
        want_ids(fast, user),
    )
