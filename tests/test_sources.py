"""Gemma tokenizer, dataset sources (jsonl / parquet / tfds), the dataset task, and a real-
data run context built from an exported HF-format checkpoint (no transformers needed)."""

import json
import os
import sys

import numpy as np
import pytest

from dsparse_jax.config.validate import load_config
from dsparse_jax.data import dataset_task, math_task, sources
from dsparse_jax.data.rewards import graders
from dsparse_jax.data.task import Problem
from dsparse_jax.data.tokenizers import gemma as gt

CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as "
    "many clips in May. How many clips did Natalia sell altogether?",
    "What is $\\frac{1}{2} + \\frac{1}{3}$? The answer is \\boxed{\\frac{5}{6}}.",
    "Solve the following math problem step by step. Put your final answer within \\boxed{}.",
    "user\nmodel\n0123456789 +-*/=()[]{}.,;:?!$#%&'\"<>",
]


@pytest.fixture(scope="module")
def tok():
    return gt.train_gemma_like(CORPUS * 20, vocab_size=400)


def test_gemma_special_ids(tok, tmp_path):
    assert (tok.pad_id, tok.processor.eos_id(), tok.bos_id, tok.unk_id) == (0, 1, 2, 3)
    sot, eot = (tok.processor.piece_to_id(p) for p in gt.CHAT_TOKENS)
    assert tok.eos_id == eot  # chat: the sampler stops at <end_of_turn>
    prompt = gt.math_prompt("What is 2+2?")
    assert prompt.startswith("<start_of_turn>user\n" + gt.MATH_INSTRUCTION)
    assert prompt.endswith("What is 2+2?<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode(prompt, add_bos=True)
    assert ids[0] == 2 and ids[1] == sot and ids.count(sot) == 2 and ids.count(eot) == 1
    assert tok.decode(tok.encode("Natalia sold 48 clips.")) == "Natalia sold 48 clips."
    # Decoding stops at <end_of_turn> and at <eos>; pad and bos are skipped.
    body = tok.encode("x = 5")
    assert tok.decode([2] + body + [eot] + tok.encode("junk")) == "x = 5"
    assert tok.decode(body + [1] + tok.encode("junk") + [0]) == "x = 5"
    tok.save(tmp_path / "tokenizer.model")
    again = gt.GemmaTokenizer.load(tmp_path)  # a directory: its tokenizer.model
    assert again.encode(prompt) == tok.encode(prompt)
    base = gt.GemmaTokenizer.load(tmp_path / "tokenizer.model", chat=False)
    assert base.eos_id == 1 and gt.math_prompt("q", chat=False) == gt.MATH_INSTRUCTION + "\n\nq\n"


def test_non_gemma_tokenizer_rejected_for_chat():
    char_tok = math_task.build_tokenizer(math_task.ChainTaskConfig(), 0)
    with pytest.raises(ValueError, match="<start_of_turn>"):
        gt.GemmaTokenizer.from_bytes(char_tok.to_bytes(), chat=True)


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


GSM = [
    {
        "question": f"Tom has {i} apples and buys {i + 1} more. How many?",
        "answer": f"{i}+{i + 1}={2 * i + 1}\n#### {2 * i + 1:,}",
    }
    for i in range(995, 1045)
]


def test_jsonl_gsm8k(tok, tmp_path):
    rows = list(GSM) + [
        "{not json",
        {"question": "no answer"},
        {"answer": "#### 3"},
        {"question": "", "answer": "#### 1"},
        [1, 2],
    ]
    _write_jsonl(tmp_path / "g.jsonl", rows)
    cfg = sources.SourceConfig(max_bad_fraction=0.2, max_prompt_tokens=400)
    with pytest.warns(UserWarning, match="skipped 5 of 55 bad records"):
        probs, stats = sources.load_problems(f"jsonl:{tmp_path}/g.jsonl", cfg, tok)
    assert stats == {"total": 55, "bad": 5, "overlong": 0, "truncated": 0, "kept": 50}
    assert probs[0].answer == "1,991" and probs[0].grader == "math"
    # the thousands separator is kept in the reference and graded numerically
    assert graders.reward("so \\boxed{1991}", probs[0].answer, "math") == 1.0
    assert "Tom has 995 apples" in probs[0].prompt and probs[0].solution.endswith("#### 1,991")
    with pytest.raises(ValueError, match="max_bad_fraction"):
        sources.load_problems(
            f"jsonl:{tmp_path}/g.jsonl", sources.SourceConfig(max_bad_fraction=0.05), tok
        )


def test_overlong_drop_and_truncate(tok, tmp_path):
    long_q = "How many clips? " * 80
    rows = [{"question": long_q, "answer": "#### 1"}] + GSM[:3]
    _write_jsonl(tmp_path / "l.jsonl", rows)
    width = 120
    assert 1 + len(tok.encode(gt.math_prompt(long_q))) > width
    with pytest.warns(UserWarning, match="dropped 1 prompts"):
        probs, stats = sources.load_problems(
            f"jsonl:{tmp_path}/l.jsonl", sources.SourceConfig(max_prompt_tokens=width), tok
        )
    assert stats["overlong"] == 1 and len(probs) == 3
    probs, stats = sources.load_problems(
        f"jsonl:{tmp_path}/l.jsonl",
        sources.SourceConfig(max_prompt_tokens=width, overlong="truncate"),
        tok,
    )
    assert stats["truncated"] == 1 and len(probs) == 4
    p = probs[0].prompt
    assert 1 + len(tok.encode(p)) <= width and p.endswith("<start_of_turn>model\n")
    assert "How many clips?" in p


def test_parquet_math_fields(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "problem": ["Compute $\\frac12+\\frac13$.", "Find $x$ if $2x=4$.", None],
            "solution": ["It is $\\boxed{\\frac{5}{6}}$.", "So $x=\\boxed{2}$.", "\\boxed{1}"],
            "level": ["Level 1", "Level 2", "Level 1"],
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    cfg = sources.SourceConfig(
        question_field="problem", answer_field="solution", max_bad_fraction=0.5
    )
    with pytest.warns(UserWarning, match="no usable question"):
        probs, stats = sources.load_problems(f"parquet:{tmp_path}/m.parquet", cfg, tok)
    assert [p.answer for p in probs] == ["\\frac{5}{6}", "2"] and stats["bad"] == 1
    r = graders.batch_rewards(
        ["so \\boxed{5/6}", "\\boxed{3}", "answer: 2"],
        [probs[0].answer, probs[1].answer, probs[1].answer],
        graders=["math", "math", "math"],
    )
    np.testing.assert_array_equal(r, [1.0, 0.0, 0.0])
    # A wrong explicit field name is a bad record for every row: a clear error.
    with pytest.raises(ValueError, match="data.question_field=.question. is not a field"):
        sources.load_problems(
            f"parquet:{tmp_path}/m.parquet", sources.SourceConfig(question_field="question"), tok
        )


def test_uri_errors(tok, tmp_path):
    for bad in ("gsm8k.txt", "csv:/x", "jsonl:"):
        with pytest.raises(ValueError, match="scheme"):
            sources.parse_uri(bad)
    with pytest.raises(FileNotFoundError):
        sources.load_problems(f"jsonl:{tmp_path}/missing.jsonl", sources.SourceConfig(), tok)
    with pytest.raises(FileNotFoundError, match="no such file"):
        sources.read_records(f"jsonl:{tmp_path}/none_*.jsonl")  # a glob matching nothing


def test_paths_as_users_write_them(tok, tmp_path):
    """A path with a known extension needs no scheme; comma lists and globs are one
    source, in order; a .json array is read; a string prompt column is the question."""
    _write_jsonl(tmp_path / "a.jsonl", GSM[:3])
    _write_jsonl(tmp_path / "b.jsonl", GSM[3:5])
    assert sources.parse_uri(f"{tmp_path}/a.jsonl") == ("jsonl", f"{tmp_path}/a.jsonl")
    assert sources.parse_uri("/data/x.parquet")[0] == "parquet"
    assert sources.parse_uri("/data/x.json")[0] == "jsonl"
    both = sources.read_records(f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl")
    assert both == GSM[:5] == sources.read_records(f"jsonl:{tmp_path}/*.jsonl")
    (tmp_path / "arr.json").write_text(json.dumps(GSM[:2]))
    assert sources.read_records(f"{tmp_path}/arr.json") == GSM[:2]
    rows = [{"prompt": "What is 6 * 7?", "answer": "42", "question": None}]
    _write_jsonl(tmp_path / "p.jsonl", rows)
    probs, _ = sources.load_problems(f"{tmp_path}/p.jsonl", sources.SourceConfig(), tok)
    assert "What is 6 * 7?" in probs[0].prompt and probs[0].answer == "42"
    with pytest.raises(ValueError, match="data.question_field='question_text' is not a field"):
        sources.load_problems(
            f"{tmp_path}/b.jsonl",
            sources.SourceConfig(question_field="question_text", max_bad_fraction=0.0),
            tok,
        )


def test_tfds_missing_is_a_clear_error(tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails
    with pytest.raises(ImportError, match="tensorflow_datasets.*local data_dir"):
        sources.load_problems(
            "tfds:math_dataset/algebra__linear_1d",
            sources.SourceConfig(data_dir="/nonexistent"),
            tok,
        )


def test_dataset_task_order_and_dispatch():
    train = [Problem(f"p{i}", "", str(i), grader="math") for i in range(10)]
    task = dataset_task.DatasetTask(train, train[:3], max_prompt_tokens=64, max_new_tokens=32)
    epoch0 = task.problems("train", 0, 10, seed=1)
    assert sorted(p.answer for p in epoch0) == sorted(str(i) for i in range(10))
    assert task.problems("train", 0, 10, seed=1) == epoch0  # deterministic
    assert task.problems("train", 10, 10, seed=1) != epoch0  # reshuffled
    assert task.problems("train", 10_000_003, 2, seed=1) == task.problems(
        "train", 10_000_003, 2, seed=1
    )
    assert [p.answer for p in task.problems("eval", 2, 3, seed=0)] == ["2", "0", "1"]
    chain = math_task.ChainTaskConfig(num_vars=5, num_terms=3)
    assert chain.problems("train", 4, 2, 0) == math_task.problems(chain, "train", 4, 2, 0)
    assert chain.describe() == "3 terms"
    from dsparse_jax.data import batches

    assert task.prompt_buffer() == 64 and task.completion_budget() == 32
    assert batches.sequence_buffer(task, 16) == 96


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_real_configs_validate():
    from dsparse_jax.config.validate import validate

    for name, budget, gen in (
        ("gemma3_1b_gsm8k.py", 32, 1024),
        ("gemma2_2b_math.py", 32, 2048),
        ("qwen3_4b_math.py", 32, 16384),
    ):
        c = load_config(os.path.join(ROOT, "configs", name))
        validate(c)
        assert (c.attention.page_size, c.sparse.budget, c.sparse.dense_layers) == (16, budget, 2)
        assert (c.rl.samples_per_prompt, c.rl.samples_generated) == (8, 16)
        assert (c.rl.learning_rate, c.rl.clip_low, c.rl.clip_high) == (1e-6, 0.2, 0.28)
        assert c.model.param_dtype == c.model.dtype == "bfloat16"
        assert not c.sft.enabled and c.data.max_new_tokens == gen
        assert c.rl.kl_coef == 0.0
    qwen = load_config(os.path.join(ROOT, "configs", "qwen3_4b_math.py"))
    assert (qwen.model.preset, qwen.rl.prompts_per_step) == ("qwen3_4b", 32)
    default = load_config(os.path.join(ROOT, "configs", "gemma_math.py"))
    assert default.data.source == "synthetic:chain" and default.sft.enabled
    assert default.model.checkpoint_dir == ""


def test_real_data_context_from_exported_checkpoint(tok, tmp_path):
    """jsonl data + Gemma-like tokenizer + an HF-format checkpoint written by our exporter:
    context.build imports the weights and the evaluator grades with answer_check."""
    import jax
    from flax import nnx

    from dsparse_jax.model import hf_checkpoint
    from dsparse_jax.model.config import tiny
    from dsparse_jax.model.transformer import Transformer
    from dsparse_jax.train import context

    pytest.importorskip("safetensors")
    cfg = tiny(vocab_size=tok.vocab_size).replace(
        d_model=32, num_layers=2, num_heads=2, head_dim=16, mlp_dim=64, sliding_window=16
    )
    _, params = nnx.split(Transformer(cfg, nnx.Rngs(3)))
    ckpt = tmp_path / "ckpt"
    hfc_files = hf_checkpoint.export(str(ckpt), params, cfg, dtype="float32")
    assert "model.safetensors" in hfc_files
    tok.save(ckpt / "tokenizer.model")
    _write_jsonl(tmp_path / "train.jsonl", GSM)
    c = load_config(os.path.join(ROOT, "configs", "gemma_math.py"))
    c.model.checkpoint_dir = str(ckpt)
    c.data.source = f"jsonl:{tmp_path}/train.jsonl"
    c.data.max_prompt_tokens = 192
    c.data.max_new_tokens = 8
    c.eval.num_problems = 4
    with pytest.raises(ValueError, match="sft.enabled"):
        context.build(c)
    c.sft.enabled = False
    ctx = context.build(c)
    assert ctx.model_cfg == cfg.replace(query_scale=cfg.scale, family=cfg.arch.name)
    assert len(ctx.task.eval) == 4 and len(ctx.task.train) == 46
    jax.tree.map(
        np.testing.assert_array_equal, nnx.to_pure_dict(ctx.init_params), nnx.to_pure_dict(params)
    )
    assert ctx.seq_width == 208 and ctx.tok.eos_id == tok.eos_id
    acc = ctx.evaluator.greedy(ctx.init_params)
    assert acc == 0.0  # a random model does not answer GSM8K; the path runs end to end


def test_hf_config_matches_presets():
    """config.json of the released gemma-3-1b-it / gemma-2-2b-it gives our presets."""
    from dsparse_jax.model import config as mc
    from dsparse_jax.model import hf_checkpoint

    g3 = {
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "rope_scaling": None,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    assert hf_checkpoint.model_config_from_hf(g3) == mc.gemma3_1b()
    g2 = {
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 10000.0,
    }
    assert hf_checkpoint.model_config_from_hf(g2) == mc.gemma2_2b()
    g3_4b = {
        "model_type": "gemma3_text",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "sliding_window": 1024,
        "vocab_size": 262144,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    }
    assert hf_checkpoint.model_config_from_hf(g3_4b) == mc.gemma3_4b()


# ------------------------------------------------------------- verl parquet, save_to_disk
def _verl_rows():
    """Rows exactly as verl's examples/data_preprocess/gsm8k.py writes them."""
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? {instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}",
                "question": f"What is {i} + {i}?",
            },
        }
        for i in range(4)
    ]


def _check_verl_problems(probs):
    assert [p.answer for p in probs] == ["0", "2", "4", "6"]
    p = probs[1]
    assert p.prompt == gt.chat_prompt(_verl_rows()[1]["prompt"][0]["content"])
    assert gt.MATH_INSTRUCTION not in p.prompt  # the messages are the prompt as written
    assert (p.data_source, p.ground_truth, p.extra_info["index"]) == ("openai/gsm8k", "2", 1)
    assert p.solution.endswith("#### 2")


def test_verl_parquet(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), path)
    probs, stats = sources.load_problems(f"parquet:{path}", sources.SourceConfig(), tok)
    _check_verl_problems(probs)
    assert stats["bad"] == 0 and stats["kept"] == 4
    # A GSM8K config's question / answer fields do not hide verl's layout.
    gsm8k = sources.SourceConfig(question_field="question", answer_field="answer")
    _check_verl_problems(sources.load_problems(f"parquet:{path}", gsm8k, tok)[0])


def test_verl_system_and_multi_turn_messages():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "2+2?"},
    ]
    assert gt.render_chat(msgs) == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert gt.render_chat(msgs, chat=False) == "Be brief.\n\nHi\n\nHello\n\n2+2?\n"


def test_verl_malformed_records_are_counted_and_named(tok, tmp_path):
    rows = _verl_rows()
    rows[0]["prompt"] = [{"role": "user"}]  # no content
    rows[1]["reward_model"] = {"style": "rule"}  # no ground_truth
    rows[2]["prompt"] = []
    path = tmp_path / "bad.jsonl"
    _write_jsonl(path, rows)
    cfg = sources.SourceConfig(max_bad_fraction=0.9)
    with pytest.warns(UserWarning, match="skipped 3 of 4 bad records") as w:
        probs, stats = sources.load_problems(f"jsonl:{path}", cfg, tok)
    msg = str(w[0].message)
    assert "record 0: prompt is not a list of chat messages" in msg
    assert "record 1: no usable reward_model.ground_truth" in msg
    assert [p.answer for p in probs] == ["6"] and stats["bad"] == 3
    with pytest.raises(ValueError, match="more than max_bad_fraction"):
        sources.load_problems(f"jsonl:{path}", sources.SourceConfig(), tok)


def _save_to_disk(directory, rows, split="train"):
    """The layout datasets' Dataset.save_to_disk writes: arrow IPC stream shards listed in
    state.json, beside dataset_info.json."""
    import pyarrow as pa

    os.makedirs(directory)
    table = pa.Table.from_pylist(rows)
    name = "data-00000-of-00001.arrow"
    with pa.OSFile(os.path.join(directory, name), "wb") as f:
        with pa.ipc.new_stream(f, table.schema) as writer:
            writer.write_table(table)
    with open(os.path.join(directory, "dataset_info.json"), "w") as f:
        json.dump({"citation": "", "description": "", "features": {}, "homepage": ""}, f)
    state = {
        "_data_files": [{"filename": name}],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": split,
    }
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump(state, f)


def test_hf_save_to_disk_dataset_and_dataset_dict(tok, tmp_path):
    _save_to_disk(tmp_path / "ds", _verl_rows())
    probs, _ = sources.load_problems(f"hf_disk:{tmp_path}/ds", sources.SourceConfig(), tok)
    _check_verl_problems(probs)
    # A DatasetDict: one directory per split, dataset_dict.json naming them.
    gsm = [{"question": f"What is {i}?", "answer": f"It is {i}.\n#### {i}"} for i in range(3)]
    _save_to_disk(tmp_path / "dd" / "train", gsm)
    _save_to_disk(tmp_path / "dd" / "test", gsm[:1], split="test")
    with open(tmp_path / "dd" / "dataset_dict.json", "w") as f:
        json.dump({"splits": ["train", "test"]}, f)
    uri = f"hf_disk:{tmp_path}/dd"
    train, _ = sources.load_problems(uri, sources.SourceConfig(), tok)
    test, _ = sources.load_problems(uri, sources.SourceConfig(split="test"), tok)
    assert [p.answer for p in train] == ["0", "1", "2"] and [p.answer for p in test] == ["0"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        sources.load_problems(uri, sources.SourceConfig(split="validation"), tok)
    with pytest.raises(FileNotFoundError, match="not a directory written by datasets"):
        sources.load_problems(f"hf_disk:{tmp_path}", sources.SourceConfig(), tok)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        sources.load_problems(f"hf_disk:{tmp_path}/none", sources.SourceConfig(), tok)


def test_hf_save_to_disk_written_by_datasets(tok, tmp_path):
    datasets = pytest.importorskip("datasets", reason="datasets not installed")
    datasets.Dataset.from_list(_verl_rows()).save_to_disk(str(tmp_path / "ds"))
    probs, _ = sources.load_problems(f"hf_disk:{tmp_path}/ds", sources.SourceConfig(), tok)
    _check_verl_problems(probs)
