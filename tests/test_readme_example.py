"""README "Bring your own reward and data": its reward file and its command, run exactly
as written (in a scratch directory that links the repository's code), then the same
reward made to fail on every completion stops the run with one line."""

import json
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_example() -> tuple[str, str]:
    """(my_reward.py, the train command) as the README shows them."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Bring your own reward and data", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"\n\n((?:    .*\n|\n)+?)(?=\S)", section)
    blocks = ["\n".join(l[4:] for l in b.rstrip("\n").split("\n")) + "\n" for b in blocks]
    reward = next(b for b in blocks if b.startswith("def compute_score("))
    command = next(b for b in blocks if "--config.reward.fn=my_reward.py" in b)
    assert command.startswith("python launch/train.py")
    return reward, command


def _scratch(tmp_path, reward: str) -> str:
    """A directory where the README's relative paths work: the repo's code linked in."""
    for name in ("launch", "configs", "dsparse_jax", "pallas_kernels"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "my_reward.py").write_text(reward)
    return str(tmp_path)


def _bash(cwd, command):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, env=env, timeout=900
    )


def test_readme_reward_file_is_short_and_loads(tmp_path):
    from dsparse_jax.data.rewards import user

    reward, command = readme_example()
    assert len(reward.strip().splitlines()) <= 12
    path = tmp_path / "my_reward.py"
    path.write_text(reward)
    fn = user.load_fn(f"{path}:compute_score")
    assert user.signature_kind(fn) == user.VERL
    assert fn("synthetic:chain", "+a1 t=1\nanswer: 7\n", "7") == 1.0
    assert fn("synthetic:chain", "answer: 3", "7") == 0.2 and fn("x", "no", "7") == 0.0


@pytest.mark.slow
def test_readme_example_runs_as_written(tmp_path):
    reward, command = readme_example()
    cwd = _scratch(tmp_path, reward)
    res = _bash(cwd, command)
    assert res.returncode == 0, res.stderr[-3000:]
    wd = os.path.join(cwd, "runs", "my_reward")
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        rl = [r for r in map(json.loads, f) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(r["reward_errors"] == 0 for r in rl)
    with open(os.path.join(wd, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    assert {s["step"] for s in samples} == {1, 2}
    for s in samples:  # the README's reward: 1, 0.2 or 0
        assert s["reward"] in (0.0, 0.2, 1.0)
        assert s["reward"] == (
            0.0
            if "answer:" not in s["completion"]
            else (1.0 if _first_answer(s["completion"]) == s["answer"] else 0.2)
        )

    # The same reward failing on every completion: the run (RL from the cached warm start)
    # stops with one line once reward.error_min_rows (64) rows were scored: the step-0
    # evaluation scores 40 (8 greedy, 32 mean@4), RL step 1 64 more.
    failing = reward.replace('"""\n', '"""\n    raise ValueError("broken reward")\n', 1)
    assert failing != reward
    shutil.rmtree(os.path.join(wd, "checkpoints"))
    (tmp_path / "my_reward.py").write_text(failing)
    res = _bash(cwd, command)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: reward: ") and "rows failed (at RL step 1)" in last
    assert "config.reward.max_error_fraction=0.1" in last and "ValueError: broken reward" in last
    assert "Traceback" in res.stderr  # the first error, printed once with its traceback


def _first_answer(text: str) -> str:
    line = next(l for l in text.splitlines() if l.startswith("answer:"))
    return line[len("answer:") :].strip()
