"""launch/evaluate.py and launch/export.py on a tiny trained run: the evaluator's numbers
match the run's own final evaluation, the export reloads in transformers (and peft) with
the trained run's logits, and the exported checkpoint evaluates like the run."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_train_e2e import ROOT, TINY

from dsparse_jax.data.rewards import graders
from dsparse_jax.data.task import Problem
from dsparse_jax.train import evaluation

K = 2


def _run(script, *args):
    cmd = [sys.executable, os.path.join(ROOT, "launch", script), *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("run") / "wd")
    res = _run(
        "train.py",
        "--config=" + os.path.join(ROOT, "configs", "gemma_math.py"),
        f"--workdir={wd}",
        *TINY,
        # mini: no attention soft-cap, which transformers' Gemma 3 would ignore (the tiny
        # preset's export reloads with slightly different logits: transformers_caveats)
        "--config.model.preset=mini",
        "--config.rl.num_steps=1",
        f"--config.eval.mean_at_k={K}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return wd


def test_k_sample_metrics():
    correct = np.array([[1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)
    answers = [["5", "4", "4"], [None, None, None], ["7", "7", "07"]]
    assert evaluation.mean_at_k(correct) == pytest.approx(4 / 9)
    assert evaluation.pass_at_k(correct) == pytest.approx(2 / 3)
    # problem 0: the majority answer "4" is wrong; 1: no answer; 2: "7" is right
    assert evaluation.maj_at_k(answers, correct) == pytest.approx(1 / 3)
    tie = [["3", "5"]]
    assert evaluation.maj_at_k(tie, np.array([[False, True]])) == 0.0  # first seen wins
    p = Problem("vars: a1\nsum: +a\n", "", "1")
    assert graders.answer_key(p, "+a1 t=1\nanswer: 1\n") == "1"


@pytest.mark.slow
def test_evaluate_a_workdir_matches_the_runs_final_eval(workdir, tmp_path):
    out = str(tmp_path / "eval.json")
    res = _run("evaluate.py", f"--workdir={workdir}", f"--out={out}", "--samples=2")
    assert res.returncode == 0, res.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    assert report["source"] == "rl step 1" and report["k"] == K
    dense, sparse = report["policies"]["dense"], report["policies"]["sparse_actor"]
    for m in (dense, sparse):
        assert set(m) == {"greedy_accuracy", f"mean_at_{K}", f"maj_at_{K}", f"pass_at_{K}"}
        assert 0 <= m[f"mean_at_{K}"] <= m[f"pass_at_{K}"] <= 1
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        final = [r for r in map(json.loads, f) if r["phase"] == "eval"][-1]
    assert final["step"] == 1
    assert dense["greedy_accuracy"] == final["greedy_accuracy"]
    assert sparse["greedy_accuracy"] == final["sparse_greedy_accuracy"]
    assert "policy" in res.stdout and "sparse_actor" in res.stdout  # the table
    assert "[eval]" in res.stderr  # the progress line
    # --samples=2: the completions of problems 0 and 1, greedy and the K samples, per policy
    with open(str(tmp_path / "eval.samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 2 * 2 * (1 + K)
    assert {(r["policy"], r["problem"]) for r in rows} == {
        (p, i) for p in ("dense", "sparse_actor") for i in (0, 1)
    }
    for r in rows:  # each reward is the grader's for that completion
        assert r["reward"] == graders.reward(r["completion"], r["reference"])
    assert [r["decoding"] for r in rows[: 2 * (1 + K)]] == ["greedy"] * 2 + ["sample_t1"] * 2 * K


@pytest.mark.slow
def test_export_reloads_in_transformers_and_peft(workdir, tmp_path):
    torch = pytest.importorskip("torch", reason="torch not installed (requirements-hf.txt)")
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    import jax.numpy as jnp
    from flax import nnx

    from dsparse_jax.train import context, trained

    out = str(tmp_path / "export")
    res = _run("export.py", f"--workdir={workdir}", f"--out={out}", "--dtype=float32")
    assert res.returncode == 0, res.stderr[-3000:]
    for f in ("config.json", "model.safetensors", "tokenizer.model", "export.json"):
        assert os.path.isfile(os.path.join(out, f)), f
    config = trained.workdir_config(workdir)
    ctx = context.build(config)
    ctx.rewarder.close()
    t = trained.load(ctx, workdir)
    model = nnx.merge(ctx.graphdef, t.params)
    tokens = np.asarray(
        [
            ctx.tok.encode(p.prompt + p.solution, add_bos=True)[:24]
            for p in ctx.evaluator.problems[:2]
        ]
    )
    ours = np.asarray(model.forward(jnp.asarray(tokens)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        got = hf(input_ids=torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(got - ours).max() <= 1e-4
    prompt = ctx.evaluator.problems[0].prompt
    for use_fast in (False, True):  # the export carries tokenizer.json and a chat template
        hf_tok = transformers.AutoTokenizer.from_pretrained(out, use_fast=use_fast)
        assert hf_tok.is_fast == use_fast
        assert hf_tok.encode(prompt) == ctx.tok.encode(prompt, add_bos=True)
        user = [{"role": "user", "content": prompt}]
        got = hf_tok.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
        assert list(got) == ctx.tok.encode(prompt, add_bos=True)
    peft = pytest.importorskip("peft", reason="peft not installed (requirements-hf.txt)")
    adapted = peft.PeftModel.from_pretrained(hf, os.path.join(out, "phi_adapter")).eval()
    with torch.no_grad():
        got = adapted(input_ids=torch.as_tensor(tokens)).logits.numpy()
    want = np.asarray(
        model.forward(jnp.asarray(tokens), lora=t.lora, lora_scale=t.setup.lora_scale)
    )
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.slow
def test_evaluate_an_exported_checkpoint(workdir, tmp_path):
    pytest.importorskip("transformers", reason="export writes tokenizer.json with it")
    out = str(tmp_path / "export")
    assert _run("export.py", f"--workdir={workdir}", f"--out={out}").returncode == 0
    tiny_task = [a for a in TINY if a.startswith(("--config.task.", "--config.eval.num"))]
    res = _run(
        "evaluate.py",
        f"--checkpoint={out}",
        "--config=" + os.path.join(ROOT, "configs", "gemma_math.py"),
        *tiny_task,
        "--k=0",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (name,) = [f for f in os.listdir(out) if f.startswith("eval_") and f.endswith(".json")]
    with open(os.path.join(out, name)) as f:
        report = json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        final = [r for r in map(json.loads, f) if r["phase"] == "eval"][-1]
    assert report["policies"]["dense"]["greedy_accuracy"] == final["greedy_accuracy"]


@pytest.mark.slow
def test_a_run_with_another_model_leaves_the_workdir_as_it_was(workdir):
    """Another model in an existing workdir stops before writing anything (one line naming
    the fields, exit 2, no SFT); the earlier run's files are untouched and it still loads.
    A compatible change (more RL steps) is accepted by the same check."""
    from dsparse_jax.train import run, trained

    with open(os.path.join(workdir, "config.json"), "rb") as f:
        before = f.read()
    res = _run(
        "train.py",
        "--config=" + os.path.join(ROOT, "configs", "gemma_math.py"),
        f"--workdir={workdir}",
        *TINY,
        "--config.model.preset=mini",
        "--config.model.d_model=64",
        "--config.rl.rollout_mode=dense",
    )
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --workdir: ") and "model.d_model (32 -> 64)" in last
    assert "rl.rollout_mode ('distillsparse' -> 'dense')" in last and "[sft]" not in res.stdout
    with open(os.path.join(workdir, "config.json"), "rb") as f:
        assert f.read() == before
    config = trained.workdir_config(workdir)
    from dsparse_jax.train import context

    ctx = context.build(config)
    ctx.rewarder.close()
    assert trained.load(ctx, workdir).source == "rl step 1"
    config.rl.num_steps, config.eval.every = 2, 5
    run.check_workdir(workdir, config)  # compatible: no error


def test_eval_files_are_named_by_their_data():
    from dsparse_jax.commands import evaluate

    a = evaluate.data_tag("parquet:/data/gsm8k/test.parquet")
    b = evaluate.data_tag("parquet:/data/math/test.parquet")
    assert a.startswith("test-") and b.startswith("test-") and a != b
    assert evaluate.data_tag("synthetic:chain").startswith("chain-")
    assert evaluate.data_tag("hf_disk:/data/gsm8k_dd/").startswith("gsm8k_dd-")
    assert evaluate.data_tag("/d/a.jsonl,/d/b.jsonl").startswith("a+1-")
    assert evaluate.data_tag("parquet:/d/train-*.parquet").startswith("train-x-")


def test_transformers_caveats():
    from dsparse_jax.model import hf_checkpoint as hfc
    from dsparse_jax.model.config import preset

    assert "ignores attn_logit_softcapping" in hfc.transformers_caveats(preset("tiny"))[0]
    assert hfc.transformers_caveats(preset("mini")) == []
    assert hfc.transformers_caveats(preset("gemma2_2b")) == []


def test_bad_invocations_are_one_line_errors(tmp_path):
    res = _run("evaluate.py", f"--workdir={tmp_path}/none")
    assert res.returncode == 2 and "error: --workdir: no such directory" in res.stderr
    res = _run("export.py", f"--workdir={tmp_path}", f"--out={tmp_path}/o")
    assert res.returncode == 2 and "no config.json" in res.stderr
    res = _run("evaluate.py")
    assert res.returncode == 2 and "one of the arguments --workdir --checkpoint" in res.stderr
    (tmp_path / "a_file").write_text("x")
    res = _run("export.py", f"--workdir={tmp_path}", f"--out={tmp_path}/a_file")
    assert (
        res.returncode == 2 and "error: --out: " in res.stderr and "not a directory" in res.stderr
    )
    assert "Traceback" not in res.stderr
