"""End-to-end smoke of the main job: launch/train.py with a tiny override config."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config.model.d_model=32",
    "--config.model.num_layers=2",
    "--config.model.mlp_dim=64",
    "--config.task.num_vars=4",
    "--config.task.num_terms=2",
    "--config.sft.max_steps=2",
    "--config.sft.batch_size=4",
    "--config.sft.eval_every=1",
    "--config.eval.num_problems=4",
    "--config.eval.every=1",
    "--config.eval.mean_at_k=2",
    "--config.rl.prompts_per_step=2",
    "--config.rl.samples_per_prompt=2",
    "--config.rl.minibatches=2",
    "--config.checkpoint.every=1",
    "--config.log.tensorboard=true",
    # the default rollout mode is distillsparse: make layer 1 really sparse (5 pages)
    "--config.sparse.budget=3",
    "--config.sparse.dense_layers=1",
    "--config.lora.rank=2",
]


def _train(workdir, *extra):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launch", "train.py"),
        "--config=" + os.path.join(ROOT, "configs", "gemma_math.py"),
        f"--workdir={workdir}",
        *TINY,
        *extra,
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)


def cfg_num_problems(wd) -> int:
    with open(os.path.join(wd, "config.json")) as f:
        return json.load(f)["eval"]["num_problems"]


def _records(workdir, phase):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["phase"] == phase]


@pytest.mark.slow
def test_main_job_runs_writes_and_resumes(tmp_path):
    wd = str(tmp_path / "run")
    # SFT: one curriculum step on 1-term problems, then the task (evaluated from step 2)
    sft = ("--config.sft.curriculum=1:2:1", "--config.sft.max_steps=3")
    first = _train(wd, "--config.rl.num_steps=2", *sft)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "[sft] stage 1/2: steps 1-1, num_terms=1, batch 2" in first.stdout
    sft_records = _records(wd, "sft")
    assert sft_records[0]["step"] == 1 and "eval_greedy_accuracy" not in sft_records[0]
    assert all("eval_greedy_accuracy" in r for r in sft_records[1:]) and len(sft_records) > 1
    rl = _records(wd, "rl")
    assert [r["step"] for r in rl] == [1, 2]
    for key in (
        "reward",
        "accuracy",
        "response_length_mean",
        "response_length_max",
        "entropy",
        "clip_frac",
        "grad_norm",
        "time_rollout",
        "time_recompute",
        "time_update_theta",
        "rollout_tokens_per_s",
        # distillsparse (the default): phi update and mismatch metrics
        "phi_loss",
        "phi_grad_norm",
        "time_update_phi",
        "kl_exact",
        "kl_k3",
        "alpha_mean",
        "alpha_p5_bin0",
        "tis_clip_frac",
        "mis_masked_frac",
    ):
        assert key in rl[0], key
    assert [r["step"] for r in _records(wd, "eval")] == [0, 1, 2]
    ev = _records(wd, "eval")[0]
    assert "sparse_greedy_accuracy" in ev
    for name in ("greedy", "sparse_greedy"):  # per-problem outcomes behind each accuracy
        outcomes = ev[f"{name}_correct"]
        assert set(outcomes) <= {0, 1} and len(outcomes) == cfg_num_problems(wd)
        assert abs(sum(outcomes) / len(outcomes) - ev[f"{name}_accuracy"]) < 1e-9
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) >= ["1", "2"]
    assert os.path.exists(os.path.join(wd, "sft", "DONE.json"))
    assert any(f.startswith("events") for f in os.listdir(os.path.join(wd, "tb")))
    # samples.jsonl: log.num_samples (here all 2) prompts of each RL step
    with open(os.path.join(wd, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    assert all({"prompt", "completion", "reward", "answer"} <= set(s) for s in samples)
    # Not a terminal: a progress line every log.every (10) steps and at the last step only.
    progress = [l for l in first.stderr.splitlines() if l.startswith(("[rl] ", "[sft] "))]
    assert [l.split()[2] for l in progress] == ["3/3", "2/2"], progress
    assert "ETA <= " in progress[0] and "\r" not in first.stderr

    second = _train(wd, "--config.rl.num_steps=3", *sft)
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout + second.stderr
    assert "reusing cached warm start" in out
    assert "resuming from checkpoint at step 2" in out
    assert [r["step"] for r in _records(wd, "rl")] == [1, 2, 3]


def test_invalid_config_fails_before_compiling(tmp_path):
    res = _train(str(tmp_path / "bad"), "--config.rl.samples_per_prompt=1")
    assert res.returncode != 0
    assert "config.rl.samples_per_prompt" in res.stderr
    res = _train(str(tmp_path / "bad"), "--config.rl.no_such_field=1")
    assert res.returncode != 0
    assert "no_such_field" in res.stderr
