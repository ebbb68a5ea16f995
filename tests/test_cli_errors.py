"""The error convention of launch/ commands (dsparse_jax/config/cli.py, docs/reliability.md):
a user error prints exactly one line `error: ...` naming the field or path to stderr and
exits with status 2, with no traceback; --verbose adds the traceback; a bug keeps its
traceback and exits 1.

The table runs launch/train.py's entry point on every bad invocation in one Python process
(tests/cli_cases.py: each case's exit status and its whole stdout and stderr file
descriptors); the other tests run launch/train.py as its own process. Each case fails
before any compile.
"""

import json
import os
import subprocess
import sys

import pytest

from dsparse_jax.config import cli
from dsparse_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
SMALL = ["--config.sft.max_steps=1", "--config.eval.num_problems=4", "--sft_only"]


def _train_cases(cases: list[list[str]], tmp) -> list[subprocess.CompletedProcess]:
    """Each argument list through launch/train.py's entry point, all in one process."""
    (tmp / "cases.json").write_text(json.dumps(cases))
    res = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tests", "cli_cases.py"),
            tmp / "cases.json",
            tmp / "out.json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((tmp / "out.json").read_text())
    return [
        subprocess.CompletedProcess(argv, r["code"], r["stdout"], r["stderr"])
        for argv, r in zip(cases, results)
    ]


def _train(args, cwd=ROOT, env=None):
    return subprocess.run(
        [sys.executable, TRAIN, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A file where a directory is expected, a tokenizer.model, and a workdir whose SFT
    checkpoint was written by a model of another shape (d_model 64)."""
    from dsparse_jax.data.tokenizers import gemma as gt

    d = tmp_path_factory.mktemp("cli")
    (d / "afile").write_text("x")
    (d / "data.jsonl").write_text('{"question": "1 + 1?", "answer": "2"}\n')
    gt.train_gemma_like(["user model 0123456789 +-=.,:?"] * 200, vocab_size=300).save(
        d / "tokenizer.model"
    )
    res = _train([f"--workdir={d}/other_shape", "--config.model.d_model=64", *SMALL])
    assert res.returncode == 0, res.stderr[-2000:]
    return d


# (name, arguments, text the one line must contain: the field or the path)
CASES = [
    ("unknown_key", ["--config.rl.bogus=3"], "config.rl.bogus: unknown key"),
    (
        "unknown_key_hint",
        ["--config.rl.learning_rat=1e-4"],
        "config.rl.learning_rat: unknown key (did you mean rl.learning_rate?)",
    ),
    ("unknown_section", ["--config.optimizer=adam"], "config.optimizer: unknown key"),
    (
        "unknown_model_key",
        ["--config.model.num_kv_head=2"],
        "config.model.num_kv_head: unknown key (did you mean model.num_kv_heads?)",
    ),
    ("below_a_leaf", ["--config.sparse.budget.pages=1"], "config.sparse.budget.pages: unknown"),
    ("override_without_value", ["--config.rl.num_steps"], "--config.rl.num_steps=VALUE"),
    (
        "int_type",
        ["--config.rl.samples_per_prompt=abc"],
        "config.rl.samples_per_prompt: expected int",
    ),
    ("float_type", ["--config.rl.learning_rate=fast"], "config.rl.learning_rate: expected float"),
    ("bool_type", ["--config.log.tensorboard=maybe"], "config.log.tensorboard: expected bool"),
    ("section_value", ["--config.rl=3"], "config.rl: is a section"),
    (
        "group_of_one",
        ["--config.rl.samples_per_prompt=1"],
        "config.rl.samples_per_prompt: must be >= 2",
    ),
    ("small_budget", ["--config.sparse.budget=2"], "config.sparse.budget: must be >="),
    (
        "negative_lr",
        ["--config.rl.learning_rate=-1"],
        "config.rl.learning_rate: must be finite and > 0",
    ),
    ("zero_steps", ["--config.rl.num_steps=0"], "config.rl.num_steps: must be a positive integer"),
    ("unknown_mode", ["--config.rl.rollout_mode=fast"], "config.rl.rollout_mode: must be one of"),
    ("gqa_group", ["--config.model.num_kv_heads=3"], "config.model.num_heads"),
    ("layer_pattern", ["--config.model.layer_pattern=globl"], "config.model.layer_pattern"),
    ("minibatches", ["--config.rl.minibatches=3"], "config.rl.minibatches: must divide"),
    (
        "kl_only_without_kl",
        ["--config.distill.loss=kl_only", "--config.distill.kl_coef=0"],
        "config.distill.kl_coef",
    ),
    ("bad_mesh", ["--config.mesh.data=3"], "config.mesh.data"),
    (
        "chunk_of_part_of_a_group",
        ["--config.rl.rollout_chunk_rows=4"],
        "config.rl.rollout_chunk_rows: must be 0 (automatic) or a multiple of the 8 samples",
    ),
    (
        # the memory plan, before the SFT warm start: no rollout chunk fits 1 MB
        "rollout_does_not_fit",
        ["--config.mesh.device_memory_gb=0.001", "--config.rl.rollout_chunk_rows=0"],
        "config.mesh.fsdp: the rollout needs",
    ),
    (
        "prune_in_speculative",
        ["--config.rl.rollout_mode=speculative", "--config.rl.prune.enabled=true"],
        "config.rl.prune.enabled: must be false with rl.rollout_mode=speculative",
    ),
    (
        "acceptance_of_dense_rollouts",
        [
            "--config.rl.rollout_mode=dense",
            "--config.rl.selection=acceptance",
            "--config.rl.samples_generated=16",
        ],
        "config.rl.selection: acceptance needs a sparse actor",
    ),
    ("unknown_synthetic", ["--config.data.source=synthetic:sudoku"], "config.data.source"),
    (
        "missing_tokenizer",
        [
            "--config.data.source=jsonl:/nonexistent.jsonl",
            "--config.sft.enabled=false",
            "--config.tokenizer.path=/nonexistent/tokenizer.model",
        ],
        "config.tokenizer.path: no SentencePiece tokenizer.model at '/nonexistent",
    ),
    (
        "missing_data",
        [
            "--config.data.source=jsonl:/nonexistent.jsonl",
            "--config.sft.enabled=false",
            "--config.tokenizer.path={d}/tokenizer.model",
        ],
        "config.data.source: data source 'jsonl:/nonexistent.jsonl': no such file",
    ),
    (
        "missing_config",
        ["--config=configs/nope.py"],
        "--config: no such config file 'configs/nope.py'",
    ),
    ("unknown_flag", ["--workdri=runs/x"], "unrecognized arguments: --workdri=runs/x"),
    ("workdir_under_a_file", ["--workdir={d}/afile/run"], "cannot create workdir '{d}/afile/run'"),
    (
        "workdir_of_another_shape",
        ["--workdir={d}/other_shape", *SMALL],
        "--workdir: {d}/other_shape holds a run with another model.d_model (64 -> 128)",
    ),
    (
        "bare_path_missing",
        [
            "--config.data.source=/nonexistent/train.parquet",
            "--config.sft.enabled=false",
            "--config.tokenizer.path={d}/tokenizer.model",
        ],
        "data source 'parquet:/nonexistent/train.parquet': no such file",
    ),
    (
        "bare_path_of_unknown_kind",
        ["--config.data.source={d}/afile", "--config.sft.enabled=false"],
        "config.data.source: data source '{d}/afile': expected <scheme>:<target>",
    ),
    (
        "comma_list_with_a_missing_file",
        [
            "--config.data.source=jsonl:{d}/data.jsonl,{d}/missing.jsonl",
            "--config.sft.enabled=false",
            "--config.tokenizer.path={d}/tokenizer.model",
        ],
        "data source 'jsonl:{d}/missing.jsonl': no such file",
    ),
    (
        "checkpoint_dir_is_a_file",
        ["--config.model.checkpoint_dir={d}/afile", "--config.sft.enabled=false"],
        "config.model.checkpoint_dir: '{d}/afile' is not a directory",
    ),
]


def _expect(res, text):
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    assert text in lines[0], (text, lines[0])


@pytest.mark.slow
def test_bad_invocations_print_one_line_and_exit_2(files, tmp_path):
    assert len(CASES) >= 20
    d = str(files)
    argvs = []
    for i, (_, args, _) in enumerate(CASES):
        args = [a.format(d=d) for a in args]
        if not any(a.startswith("--workdir") for a in args):
            args.append(f"--workdir={tmp_path}/run{i}")  # its own: no case sees another's
        argvs.append(args)
    results = [
        (name, res, text.format(d=d))
        for (name, _, text), res in zip(CASES, _train_cases(argvs, tmp_path), strict=True)
    ]
    failures = []
    for name, res, text in results:
        try:
            _expect(res, text)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_a_process_prints_one_line_and_verbose_the_traceback(tmp_path):
    """launch/train.py as its own process (the table above runs in one process)."""
    _expect(
        _train(["--config.rl.bogus=3", f"--workdir={tmp_path}"]), "config.rl.bogus: unknown key"
    )
    res = _train(["--config.rl.samples_per_prompt=1", f"--workdir={tmp_path}", "--verbose"])
    assert res.returncode == 2
    assert "Traceback" in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: config.rl.samples_per_prompt")
    env = _train(["--config.rl.bogus=1"], env={cli.VERBOSE_ENV: "1"})
    assert env.returncode == 2 and "Traceback" in env.stderr


def test_user_error_is_one_line_and_a_bug_keeps_its_traceback(capsys):
    def user(argv):
        raise UserError("config.rl.x: bad\nsecond line")

    with pytest.raises(SystemExit) as e:
        cli.run(user, [])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: config.rl.x: bad (+1 more lines with --verbose)\n"

    def bug(argv):
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):  # not caught: python prints it and exits 1
        cli.run(bug, [])
    with pytest.raises(SystemExit) as e:
        cli.run(lambda argv: 0, [])
    assert e.value.code == 0


def test_every_model_field_can_be_overridden():
    from dsparse_jax.config import schema
    from dsparse_jax.model.config import ModelConfig, preset

    assert set(schema.MODEL_FIELDS) == {f.name for f in ModelConfig.__dataclass_fields__.values()}
    c = cli.load_config(
        os.path.join(ROOT, "configs", "gemma_math.py"),
        {"model.num_kv_heads": "2", "model.layer_pattern": "global", "model.qk_norm": "false"},
    )
    got = preset(c.model.preset, **schema.model_overrides(c.model))
    assert (got.num_kv_heads, got.layer_pattern, got.qk_norm) == (2, ("global",), False)
    assert got.head_dim == preset("tiny").head_dim  # unset: the preset's value
    assert got.d_model == 128  # the default job's own value


def test_a_config_by_name_or_from_another_directory(tmp_path, monkeypatch):
    """--config takes a shipped config's name (gemma_math, gemma_math.py) or its checkout
    path from any directory (the default, configs/gemma_math.py, included)."""
    monkeypatch.chdir(tmp_path)
    want = os.path.join(ROOT, "configs", "gemma_math.py")
    for name in ("gemma_math", "gemma_math.py", "configs/gemma_math.py"):
        assert os.path.samefile(cli.config_path(name), want)
    with pytest.raises(UserError, match="no such config file 'nope'.*packaged: .*gemma_math"):
        cli.config_path("nope")
