"""Installed, the tool runs anywhere: a fresh virtual environment (its dependencies from
the system's site-packages), `pip install` of the project (not editable), and the console
commands run from a temporary directory: the packaged config by name, one RL step of the
embedded task."""

import json
import os
import shutil
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
    "--config.eval.num_problems=4",
    "--config.eval.mean_at_k=0",
    "--config.rl.prompts_per_step=2",
    "--config.rl.samples_per_prompt=2",
    "--config.rl.num_steps=1",
    "--config.log.tensorboard=false",
]


@pytest.mark.slow
def test_installed_console_commands_run_from_anywhere(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ there
    for name in ("dsparse_jax", "pallas_kernels", "configs"):
        shutil.copytree(
            os.path.join(ROOT, name), src / name, ignore=shutil.ignore_patterns("__pycache__")
        )
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    pip = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(cmd, *args):
        return subprocess.run(
            [str(venv / "bin" / cmd), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=elsewhere,
            timeout=900,
        )

    for cmd in ("dsparse-evaluate", "dsparse-export", "dsparse-tiny-checkpoint"):
        assert run(cmd, "--help").returncode == 0, cmd
    res = run("dsparse-train", "--config=gemma_math", "--workdir=run", *TINY)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(elsewhere / "run" / "summary.json") as f:
        assert "rl_greedy_accuracy" in json.load(f)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import dsparse_jax; print(dsparse_jax.__file__)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=elsewhere,
    ).stdout
    assert str(venv) in where  # the installed copy, not the checkout
    res = run("dsparse-train", "--config=no_such_config", "--workdir=run2")
    assert res.returncode == 2 and "packaged: " in res.stderr and "gemma_math" in res.stderr
    res = run("dsparse-train", "--workdir=run3", *TINY)  # the default config, by its name
    assert res.returncode == 0, res.stderr[-3000:]
