"""The small real-data path on CPU: launch/tiny_checkpoint.py builds a tiny random
checkpoint of each family with a tokenizer fitted to a data file; transformers loads it
with the same logits as ours (f32, 1e-4), and train.py runs RL on it from the file.
Needs requirements-hf.txt."""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not installed (requirements-hf.txt)")
transformers = pytest.importorskip("transformers", reason="requirements-hf.txt not installed")

from flax import nnx  # noqa: E402

from dsparse_jax.data.tokenizers.load import load_tokenizer  # noqa: E402
from dsparse_jax.model import hf_checkpoint  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("gemma2", "gemma3", "qwen2", "qwen3", "llama")


def _run(script, *args):
    cmd = [sys.executable, os.path.join(ROOT, "launch", script), *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A GSM8K-style jsonl file of 40 word problems."""
    path = tmp_path_factory.mktemp("data") / "toy.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            a, b = 3 + i, 7 + 2 * i
            q = f"Ana has {a} pens and buys {b} more. How many pens does Ana have now?"
            f.write(json.dumps({"question": q, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}))
            f.write("\n")
    return f"jsonl:{path}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tiny_checkpoint_of_each_family_loads_in_transformers(family, data, tmp_path):
    from dsparse_jax.train import tiny_checkpoint

    out = str(tmp_path / family)
    summary = tiny_checkpoint.build(out, family, data, vocab_size=400)
    assert summary["records"] == 40 and "model.safetensors" in summary["files"]
    cfg, graphdef, params = hf_checkpoint.load(out)
    tok = load_tokenizer(out)
    assert cfg.family == family and cfg.vocab_size == tok.vocab_size
    assert tok.eos_id in tok.stop_ids
    ids = tok.encode(tok.math_prompt("Ana has 3 pens. How many?"), add_bos=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    with torch.no_grad():
        want = model(torch.as_tensor([ids])).logits.float().numpy()
    got = np.asarray(nnx.merge(graphdef, params).forward(jnp.asarray([ids], jnp.int32)))
    assert np.abs(got - want).max() <= 1e-4


def test_the_real_data_pipeline_runs_on_a_tiny_checkpoint(data, tmp_path):
    ckpt, wd = str(tmp_path / "ckpt"), str(tmp_path / "run")
    res = _run("tiny_checkpoint.py", "--family=qwen3", f"--data={data}", f"--out={ckpt}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "configs/tiny_real_data.py" in res.stdout  # the next command
    res = _run(
        "train.py",
        "--config=" + os.path.join(ROOT, "configs", "tiny_real_data.py"),
        f"--workdir={wd}",
        f"--config.model.checkpoint_dir={ckpt}",
        f"--config.data.source={data}",
        "--config.rl.num_steps=1",
        "--config.eval.num_problems=4",
        "--config.eval.every=1",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if r["phase"] == "rl"] == [1]
    assert sum(r["phase"] == "eval" for r in records) == 2
    res = _run("tiny_checkpoint.py", "--family=mistral", f"--data={data}", f"--out={ckpt}")
    assert res.returncode == 2 and "--family: 'mistral'" in res.stderr
