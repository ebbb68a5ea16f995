"""The rollout benchmark (bench/rollout.py) runs end to end at toy sizes and reports
what it measured: every part, the growing-cache rows, the ratios and the targets; so do
bench/gather_slices.py and bench/rl_step.py (one field varied side by side), and the
prepared device check (launch/device_check.sh) runs every stage in its CPU dry run.
Timings are not checked (benchmarks are not timed tests); the structure and the
invariants the script itself relies on are."""

import json
import os
import subprocess
import sys

import pytest

from dsparse_jax.bench import gather_slices, kernels, rl_step, rollout
from dsparse_jax.errors import UserError


@pytest.mark.slow  # ~10 sampler / step / forward compiles of the tiny preset
def test_bench_rollout_reports_every_part(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rollout.main(
        [
            "--batch=2",
            "--prompt_len=8",
            "--gen_lens=32",
            "--grow_from=0,16",
            "--configs=dense,centroid:0",
            "--budget=3",
            "--warmup=aot",
            "--step_contexts=64",
            "--step_rounds=1",
            "--step_reps=2",
            "--twin_lens=64",
            "--twin_batch=1",
            "--twin_reps=1",
            f"--out={out}",
        ]
    )
    printed = json.loads(capsys.readouterr().out)
    d = json.loads(out.read_text())
    assert d == printed and not os.path.exists(f"{out}.partial")

    rows = {(r["config"], r["grow_buffer_from"]): r for r in d["throughput"]}
    assert set(rows) == {
        ("dense", 0),
        ("centroid:0", 0),
        ("dense", 16),
        ("centroid:0", 16),
    }
    for r in rows.values():
        assert r["completion_len_min"] == r["completion_len_max"] == 32  # EOS never sampled
        assert r["tokens_per_s"] > 0 and r["compile_s"] > 0
    assert rows[("dense", 0)]["cache_buffers"] == [48]  # 8 + 32 rounded to pages of 16
    assert rows[("dense", 16)]["cache_buffers"] == [32, 48]
    assert "over_fixed_buffer" in rows[("dense", 16)]
    assert "sparse_over_dense" in rows[("centroid:0", 16)]

    steps = {(r["context"], r["config"]) for r in d["step"]}
    # every config at each context, plus the dense references at the budget and the floor
    assert steps == {(64, "dense"), (64, "centroid:0"), (48, "dense"), (16, "dense")}
    (ratio,) = d["step_ratios"]
    assert ratio["config"] == "centroid:0" and ratio["decode_speedup_vs_dense"] > 0
    assert "over_dense_at_budget" in ratio and d["step_floor_ms"] > 0
    # the overhead's reference (dense at the budget) ran in the same rounds as the step at 64
    step64 = next(r for r in d["step"] if (r["context"], r["config"]) == (64, "centroid:0"))
    ref = step64["reference"]
    assert ref["context"] == 48 and ref["n"] == 2 and ratio["reference_same_rounds"]
    assert ratio["over_dense_at_budget"] == pytest.approx(ratio["sparse_ms"] / ref["median_ms"])
    assert ratio["fraction_of_bound"] == pytest.approx(1 / ratio["over_dense_at_budget"])
    assert ratio["free_attention_bound"] == pytest.approx(ratio["dense_ms"] / ref["median_ms"])
    assert d["targets"]["sparse_step_at_64_le_1.25x_dense_step_at_48"] != "not measured"

    twin = {r["config"]: r for r in d["twin"]}
    assert set(twin) == {"dense", "centroid:0"}
    assert twin["centroid:0"]["twin_over_dense"] > 0
    assert all(r["temp_bytes"] > 0 for r in twin.values())


def test_bench_rollout_config_names():
    """ "<policy>:<dense_layers>[:g<G>c<C>]" names parse to the spec they describe."""
    spec_for = rollout.spec_for
    assert spec_for("dense", 32, 16).sparse is None
    sp = spec_for("quest:2", 32, 16).sparse
    assert (sp.policy, sp.dense_layers, sp.group_pages) == ("quest", 2, 0)
    sp = spec_for("centroid:0:g16c8", 32, 16).sparse
    assert (sp.dense_layers, sp.group_pages, sp.candidate_groups) == (0, 16, 8)


def test_bench_gather_slices_reports_every_pair(tmp_path):
    out = tmp_path / "slices.json"
    gather_slices.main(
        [
            "--contexts=64",
            "--configs=centroid:0",
            "--slices=1,2,3",
            "--rounds=1",
            "--reps=2",
            "--batch=3",
            "--budget=3",
            f"--out={out}",
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["gather_slices"]) for r in rows] == [(64, 1), (64, 2), (64, 3)]
    for r in rows:
        assert r["n"] == 2 and r["same_logits_as_first"]  # slicing never changes a bit
        assert r["over_dense_at_budget"] == r["median_ms"] / r["dense_at_budget_ms"]["median_ms"]


@pytest.mark.slow  # ~60 s: every stage of the device check at toy size, on CPU
def test_device_check_dry_run_runs_every_stage(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    subprocess.run(
        ["bash", "launch/device_check.sh", "--dry-run"],
        cwd=root,
        env=env,
        capture_output=True,
        timeout=900,
        check=False,
    )
    log = (tmp_path / "stages.log").read_text()
    stages = [
        s for s in json.loads((tmp_path / "stages.json").read_text()) if s["stage"] != "install"
    ]
    assert [s["stage"] for s in stages] == ["env", "tests", "kernels", "rollout", "speculative"]
    assert all(s["rc"] == 0 for s in stages), (stages, log[-4000:])
    assert json.loads((tmp_path / "env.json").read_text())["backend"] == "cpu"
    assert json.loads((tmp_path / "bench_kernels.json").read_text())
    assert json.loads((tmp_path / "bench_rollout.json").read_text())["step"]
    spec = json.loads((tmp_path / "bench_speculative.json").read_text())
    names = [r["name"] for r in spec["random"][0]["rows"]]
    assert names == ["plain", "sparse_self", "history", "draft_head"]
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_bench_kernels_chain_runs_dependent_calls_on_their_own_pages():
    import jax.numpy as jnp

    q = jnp.ones((1, 2, 4), jnp.float32)
    ids_NxBxKxP = jnp.arange(3 * 2, dtype=jnp.int32).reshape(3, 1, 1, 2)  # sums 1, 5, 9

    def fn(q, k, v, pos, ids):  # the output depends on the query and on this call's pages
        return 2.0 * q + ids.sum()

    got = kernels.chained(fn, 3)(q, None, None, None, ids_NxBxKxP)
    want = q
    for s in (1.0, 5.0, 9.0):
        want = want + 1e-3 * (2.0 * want + s)
    assert jnp.allclose(got, want, rtol=0, atol=1e-7)
    dense = kernels.chained(lambda q, k, v, pos: q + k, 2)(q, q, None, None, None)
    assert jnp.allclose(dense, (q + 2e-3 * q) + 1e-3 * ((q + 2e-3 * q) + q))


def test_bench_speculative_history_rows_parse_and_refuse():
    from dsparse_jax.bench import speculative
    from dsparse_jax.errors import UserError

    assert speculative.history_row("latest:4") == ("latest", 4, 1)
    assert speculative.history_row("tree:2x3") == ("tree", 2, 3)
    for bad in ("tree", "suffix:4", "tree:0x2", "counts:four"):
        with pytest.raises(UserError, match="--history"):
            speculative.history_row(bad)


@pytest.mark.slow  # two distillsparse steps at each of two phi row strides, tiny model
def test_bench_rl_step_varies_one_field_side_by_side(tmp_path, capsys):
    out = tmp_path / "rl_step.json"
    tiny = ["model.d_model=32", "model.num_layers=2", "model.mlp_dim=64", "task.num_vars=4"]
    tiny += ["rl.prompts_per_step=2", "rl.samples_per_prompt=2", "rl.minibatches=1"]
    tiny += ["attention.page_size=8", "sparse.budget=3", "sparse.dense_layers=1"]
    rl_step.main(
        [f"--config.{t}" for t in tiny]
        + ["--terms=2", "--modes=distillsparse", "--vary=distill.row_stride=1,2", "--steps=1"]
        + [f"--out={out}"]
    )
    rows = json.loads(out.read_text())
    assert [r["distill.row_stride"] for r in rows] == ["1", "2"]
    assert all(r["mode"] == "distillsparse" and r["time_update_phi"] > 0 for r in rows)
    assert rows[1]["phi_num_tokens"] == rows[0]["phi_num_tokens"] / 2  # the field took effect
    ratio = rows[1]["ratio_to_first"]
    assert ratio["time_update_phi"] == pytest.approx(
        rows[1]["time_update_phi"] / rows[0]["time_update_phi"]
    )
    assert "distillsparse distill.row_stride=2 / =1" in capsys.readouterr().out


def test_bench_rl_step_builds_each_row_from_its_own_config(tmp_path, monkeypatch):
    """A varied field the run context derives (here the sparse spec) reaches the row's
    run: each row's context is built from its own config, not from the first one's."""
    from dsparse_jax.train import phases

    budgets = []

    def step_stub(run, setup, state, key, step):
        budgets.append(run.rollout_spec.sparse.budget)
        return state, {"time_step": 1.0, "response_length_mean": 1.0}

    monkeypatch.setattr(phases, "rl_step", step_stub)
    tiny = ["model.d_model=32", "model.num_layers=2", "model.mlp_dim=64", "task.num_vars=4"]
    tiny += ["attention.page_size=8", "sparse.budget=3", "sparse.dense_layers=1"]
    rl_step.main(
        [f"--config.{t}" for t in tiny]
        + ["--terms=2", "--modes=sparse", "--vary=sparse.budget=4,5", "--steps=1"]
        + [f"--out={tmp_path / 'rl_step.json'}"]
    )
    assert budgets == [4, 4, 5, 5]  # one untimed and one timed step per row


def test_bench_rl_step_refuses_bad_arguments():
    for argv, message in [
        (["--vary=distill.row_stride"], "--vary: expected FIELD=A,B"),
        (
            ["--vary=rl.rollout_mode=dense,sparse"],
            "--vary: the rollout mode is varied with --modes",
        ),
        (["--steps=0"], "--steps: at least 1"),
    ]:
        with pytest.raises(UserError, match=message):
            rl_step.parse_args(argv)
    with pytest.raises(UserError, match="config.distill.row_strid"):  # before any compile
        rl_step.main(["--terms=2", "--modes=dense", "--vary=distill.row_strid=1,2"])
