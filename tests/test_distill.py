"""DistillSparse update pieces on one real sparse rollout of a tiny model:

- the phi step leaves theta bitwise unchanged and moves only phi;
- repeated phi steps on a fixed batch strictly lower KL(sparse || dense) (k3 and exact);
- the theta side ignores phi: the dense recompute is the same for any adapter;
- TIS / MIS wiring of the theta batch, against hand-computed values;
- the oversampling filter keeps the top-n rows (pages gathered with them) and advantages
  use only the kept samples;
- mismatch metrics: the direction and binning of the wiring, against numpy.
"""

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.model.lora import LoRAConfig, init_lora
from dsparse_jax.rl import modes
from dsparse_jax.rl.advantages import grpo_advantages
from dsparse_jax.rl.corrections import Correction
from dsparse_jax.sampling.sampler import Rollout, Sampler, SamplingConfig
from dsparse_jax.train import distill, phases, recompute, steps
from tests.test_lora import VOCAB, model_cfg, random_params

# 2 layers: 0 local, 1 global and sparse. Page size 4, budget 3 pages (12 of up to 32
# keys): the sparse policy really differs from the dense one.
DENSE = AttentionSpec(page_size=4)
SPARSE = AttentionSpec(page_size=4, sparse=SparseSpec(budget=3, dense_layers=1))
LCFG = LoRAConfig(rank=4, alpha=8.0)
REC = dict(temperature=1.0, dense_spec=DENSE, lora_scale=LCFG.scale, bin_width=8, num_bins=3)


@functools.lru_cache(maxsize=None)
def setup():
    cfg = model_cfg()
    graphdef, params = random_params(cfg, seed=5)
    rng = np.random.default_rng(0)
    lengths = np.array([5, 8, 3, 6])
    prompts = np.where(np.arange(8) < lengths[:, None], rng.integers(2, VOCAB, (4, 8)), 0)
    scfg = SamplingConfig(max_new_tokens=24, eos_id=1, pad_id=0, temperature=1.0)
    lora = init_lora(cfg, LCFG, jax.random.key(0))
    rollout = Sampler(graphdef)(
        params, prompts, lengths, jax.random.key(1), scfg, SPARSE, lora, LCFG.scale
    )
    return cfg, graphdef, params, rollout


def rec_of(graphdef, params, lora, r):
    return recompute.dense_and_twin(
        params,
        lora,
        r.tokens,
        r.prompt_lengths,
        r.completion_mask,
        r.pages(),
        r.logprobs,
        graphdef=graphdef,
        twin_spec=SPARSE,
        **REC,
    )


def leaves(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


PHI_CASES = {  # name: (DistillSettings overrides, metric that must fall strictly)
    "ppo+kl_k3": (dict(), None),
    "kl_only_k3": (dict(loss="kl_only", kl="k3", kl_coef=1.0), "kl_k3"),
    "kl_only_exact_reverse": (dict(loss="kl_only", kl="exact_reverse", kl_coef=1.0), "kl_exact"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(PHI_CASES))
def test_phi_steps_move_only_phi_and_lower_kl(case):
    cfg, graphdef, params, r = setup()
    overrides, falling = PHI_CASES[case]
    settings = distill.DistillSettings(spec=SPARSE, lora_scale=LCFG.scale, **overrides)
    tx = steps.make_optimizer(
        3e-3,
        warmup_steps=0,
        total_steps=10,
        weight_decay=0.0,
        max_grad_norm=1.0,
        schedule="constant",
    )
    lora = init_lora(cfg, LCFG, jax.random.key(0))
    opt = tx.init(lora)
    rec0 = rec_of(graphdef, params, lora, r)
    mb = {
        "tokens": r.tokens,
        "mask": r.completion_mask,
        "rollout_logp": r.logprobs,
        "adv": jnp.array([1.0, -1.0, 0.5, -0.5]),
        "pages": r.pages(),
        "teacher_logp": rec0["dense_logp"],
    }
    teacher = params if settings.exact else None
    theta_before, lora_before = leaves(params), leaves(lora)
    history = [float(rec0["metrics"][falling])] if falling else []
    for _ in range(4 if falling else 1):
        lora, opt, m = distill.phi_update(
            lora, opt, mb, params, teacher, graphdef=graphdef, tx=tx, settings=settings
        )
        assert float(m["skipped"]) == 0 and float(m["grad_norm"]) > 0
        if falling:
            history.append(float(rec_of(graphdef, params, lora, r)["metrics"][falling]))
    # theta: bitwise unchanged (and not an output); phi: moved.
    for a, b in zip(theta_before, leaves(params)):
        np.testing.assert_array_equal(a, b)
    moved = [not np.array_equal(a, b) for a, b in zip(lora_before, leaves(lora))]
    assert any(moved)
    if falling:
        assert history[0] > 1e-4, history  # a real mismatch to remove
        assert all(b < a for a, b in zip(history, history[1:])), history


def test_dense_recompute_ignores_phi_and_twin_reproduces_rollout():
    cfg, graphdef, params, r = setup()
    lora0 = init_lora(cfg, LCFG, jax.random.key(0))  # what the rollout used
    rng = np.random.default_rng(7)
    lora1 = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), lora0)
    a = rec_of(graphdef, params, lora0, r)
    b = rec_of(graphdef, params, lora1, r)
    mask = np.asarray(r.completion_mask) > 0
    np.testing.assert_array_equal(np.asarray(a["dense_logp"]), np.asarray(b["dense_logp"]))
    assert np.abs(np.asarray(a["twin_logp"] - b["twin_logp"])[mask]).max() > 1e-3
    # The twin (sparse + the rollout's adapter, rollout pages) is the actor...
    assert float(a["metrics"]["twin_mu_max_abs"]) < 1e-4
    # ...and differs from the dense policy (budget 3 of up to 8 pages).
    assert float(a["metrics"]["kl_exact"]) > 1e-4
    assert np.abs(np.asarray(a["dense_logp"] - a["twin_logp"])[mask]).max() > 1e-2
    # Chunked recompute (rows in 2 groups, as when the update uses 2 microbatches) gives
    # the same token log-probs and metrics (f32, 1e-5: only the matmul grouping differs).
    c = recompute.dense_and_twin(
        params,
        lora0,
        r.tokens,
        r.prompt_lengths,
        r.completion_mask,
        r.pages(),
        r.logprobs,
        graphdef=graphdef,
        twin_spec=SPARSE,
        chunks=2,
        **REC,
    )
    for k in ("dense_logp", "twin_logp", "dense_entropy"):
        np.testing.assert_allclose(np.asarray(c[k]), np.asarray(a[k]), atol=1e-5)
    for k, v in recompute.flatten_metrics(jax.device_get(a["metrics"])).items():
        got = recompute.flatten_metrics(jax.device_get(c["metrics"]))[k]
        assert got == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), k


def test_kept_rows_metrics_from_all_rows_arrays():
    """The select phase's kept-row figures (batch_metrics on the rows' arrays of an all-rows
    recompute) equal a recompute of those rows alone, and differ from the all-rows ones."""
    cfg, graphdef, params, r = setup()
    lora = init_lora(cfg, LCFG, jax.random.key(0))
    every = rec_of(graphdef, params, lora, r)
    rows = np.array([0, 2])
    kept = jax.tree.map(lambda x: x[rows], r)
    arrays = jax.tree.map(lambda x: x[rows], {k: v for k, v in every.items() if k != "metrics"})
    got = recompute.batch_metrics(
        arrays,
        kept.tokens,
        kept.prompt_lengths,
        kept.completion_mask,
        kept.logprobs,
        bin_width=REC["bin_width"],
        num_bins=REC["num_bins"],
    )
    want = recompute.flatten_metrics(
        jax.device_get(rec_of(graphdef, params, lora, kept)["metrics"])
    )
    got = recompute.flatten_metrics(jax.device_get(got))
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), k
    all_rows = recompute.flatten_metrics(jax.device_get(every["metrics"]))
    assert got["kl_exact"] != pytest.approx(all_rows["kl_exact"], rel=1e-3)


def _rollout(tokens, mask, logprobs, prompt_lengths=None, page_ids=None):
    b, s = tokens.shape
    pl = np.zeros(b, np.int32) if prompt_lengths is None else prompt_lengths
    return Rollout(
        tokens=jnp.asarray(tokens, jnp.int32),
        prompt_lengths=jnp.asarray(pl),
        completion_lengths=jnp.asarray(mask.sum(1).astype(np.int32)),
        completion_mask=jnp.asarray(mask, jnp.float32),
        logprobs=jnp.asarray(logprobs, jnp.float32),
        page_ids=page_ids or {},
    )


SPARSE_MODE = modes.get("sparse")


def test_theta_batch_tis_mis_hand_values():
    rho = np.array([[1.0, 2.0, 0.25, 3.0, 1.5], [0.4, 0.6, 1.0, 1.0, 9.0]])
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], np.float32)
    mu = np.full(rho.shape, -1.0)
    old = jnp.asarray(np.log(rho) + mu, jnp.float32)
    kept = _rollout(np.ones(rho.shape), mask, mu)
    adv = jnp.array([1.0, -1.0])
    c = Correction(kind="none", tis_cap=2.0, mis_lo=0.5, mis_hi=2.0, mis_level="token")
    batch, m = phases.theta_batch(SPARSE_MODE, kept, adv, old, None, c)
    assert "is_weights" not in batch and "pages" not in batch
    np.testing.assert_array_equal(batch["mask"], mask)
    np.testing.assert_array_equal(batch["old_logp"], old)  # dense logp is pi_old
    assert m["tis_clip_frac"] == pytest.approx(2 / 9)  # 3.0 and 9.0 exceed C = 2
    assert m["mis_masked_frac"] == pytest.approx(4 / 9)  # 0.25, 3.0, 0.4, 9.0

    c = dataclasses.replace(c, kind="tis")
    batch, _ = phases.theta_batch(SPARSE_MODE, kept, adv, old, None, c)
    want = np.array([[1.0, 2.0, 0.25, 2.0, 0.0], [0.4, 0.6, 1.0, 1.0, 2.0]])
    np.testing.assert_allclose(batch["is_weights"], want, rtol=1e-6)
    np.testing.assert_array_equal(batch["mask"], mask)

    c = dataclasses.replace(c, kind="mis")
    batch, _ = phases.theta_batch(SPARSE_MODE, kept, adv, old, None, c)
    want = np.array([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0]], np.float32)
    np.testing.assert_array_equal(batch["mask"], want)
    # Sequence level, geometric mean ratios: row 0 (1*2*.25*3)^(1/4) = 1.107 (in),
    # row 1 (.4*.6*1*1*9)^(1/5) = 1.167 (out of [0.5, 1.15]).
    c = dataclasses.replace(c, mis_level="sequence", mis_hi=1.15)
    batch, _ = phases.theta_batch(SPARSE_MODE, kept, adv, old, None, c)
    np.testing.assert_array_equal(batch["mask"], np.array([[1, 1, 1, 1, 0], [0] * 5], np.float32))

    # sparse_train: the sparse twin is pi_old and the pages ride along.
    ids = {1: jnp.zeros((2, 5, 1, 3), jnp.int32)}
    kept = _rollout(np.ones(rho.shape), mask, mu, page_ids=ids)
    twin = old + 0.5
    batch, _ = phases.theta_batch(modes.get("sparse_train"), kept, adv, old, twin, c)
    np.testing.assert_array_equal(batch["old_logp"], twin)
    assert list(batch["pages"]) == [1]
    batch, _ = phases.theta_batch(modes.get("distillsparse"), kept, adv, old, twin, c)
    np.testing.assert_array_equal(batch["old_logp"], old)
    assert "pages" not in batch


def test_filter_keeps_top_n_and_advantages_use_only_kept():
    rewards = np.array([0.0, 1.0, 0.5, 0.2, 1.0, 0.0, 0.0, 0.7, 0.3, 0.3, 0.9, 0.1])  # P=3, M=4
    rows, _ = phases.select_rows(rewards, 2, 4, jax.random.key(0))
    assert rows.tolist() == [1, 2, 4, 7, 10, 8] or rows.tolist() == [1, 2, 4, 7, 10, 9]
    rows_b, _ = phases.select_rows(rewards, 2, 4, jax.random.key(0))
    np.testing.assert_array_equal(rows, rows_b)  # deterministic given the key
    ties = {tuple(phases.select_rows(rewards, 2, 4, jax.random.key(k))[0][4:]) for k in range(12)}
    assert ties == {(10, 8), (10, 9)}  # the 0.3 tie broken both ways
    np.testing.assert_array_equal(phases.select_rows(rewards, 4, 4, None)[0], np.arange(12))

    adv = np.asarray(grpo_advantages(jnp.asarray(rewards[rows]), 2))
    # Group (1.0, 0.5): +-1/sqrt(2) (unbiased std); dropped rows never enter a group.
    np.testing.assert_allclose(adv[:2], [2**-0.5, -(2**-0.5)], atol=1e-5)
    np.testing.assert_allclose(adv[2:4], [2**-0.5, -(2**-0.5)], atol=1e-5)

    # Gathering a rollout keeps page ids with their rows.
    b, s = 12, 4
    ids = {1: jnp.asarray(np.arange(b)[:, None, None, None] * np.ones((1, s, 1, 2)), jnp.int32)}
    r = _rollout(np.arange(b * s).reshape(b, s), np.ones((b, s)), np.zeros((b, s)), page_ids=ids)
    kept = phases.gather_rows(r, rows)
    np.testing.assert_array_equal(np.asarray(kept.page_ids[1])[:, 0, 0, 0], rows)
    np.testing.assert_array_equal(np.asarray(kept.tokens)[:, 0], rows * s)


def test_mismatch_metrics_against_numpy():
    rng = np.random.default_rng(0)
    b, s, v = 2, 6, 5
    dense = rng.normal(size=(b, s, v)).astype(np.float32)
    twin = (dense + rng.normal(size=(b, s, v)) * 0.7).astype(np.float32)
    tok = rng.integers(0, v, (b, s))
    mask = np.array([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]], np.float32)
    prompt_lengths = np.array([2, 1])
    lsm = lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))
    ld, lt = lsm(dense), lsm(twin)
    pick = lambda l: np.take_along_axis(l, tok[..., None], -1)[..., 0]
    metrics_fn = lambda d, t, *a: recompute.mismatch_metrics(
        recompute.token_mismatch(d, t), *a, bin_width=2, num_bins=2
    )
    got = jax.jit(metrics_fn)(
        jnp.asarray(dense),
        jnp.asarray(twin),
        jnp.asarray(pick(ld)),
        jnp.asarray(pick(lt)),
        jnp.asarray(mask),
        recompute.completion_positions(jnp.zeros((b, s)), jnp.asarray(prompt_lengths)),
    )
    got = recompute.flatten_metrics(jax.device_get(got))
    on = mask > 0
    alpha = np.minimum(np.exp(ld), np.exp(lt)).sum(-1)
    kl_rev = (np.exp(lt) * (lt - ld)).sum(-1)  # KL(sparse || dense)
    kl_fwd = (np.exp(ld) * (ld - lt)).sum(-1)
    r = pick(ld) - pick(lt)
    assert got["alpha_mean"] == pytest.approx(alpha[on].mean(), rel=1e-5)
    assert got["alpha_p5"] == pytest.approx(np.percentile(alpha[on], 5), rel=1e-5)
    assert got["kl_exact"] == pytest.approx(kl_rev[on].mean(), rel=1e-4)
    assert got["kl_exact_fwd"] == pytest.approx(kl_fwd[on].mean(), rel=1e-4)
    assert got["kl_k3"] == pytest.approx((np.exp(r) - r - 1)[on].mean(), rel=1e-4)
    assert got["log_ratio_mean"] == pytest.approx(r[on].mean(), rel=1e-4, abs=1e-6)
    assert got["log_ratio_max_abs"] == pytest.approx(np.abs(r[on]).max(), rel=1e-5)
    # completion positions: row 0 tokens 2..5 -> 0..3, row 1 tokens 1..3 -> 0..2; width 2.
    pos = np.arange(s)[None] - prompt_lengths[:, None]
    for k in range(2):
        sel = on & (pos // 2 == k)
        assert got[f"tokens_bin{k}"] == sel.sum()
        assert got[f"alpha_mean_bin{k}"] == pytest.approx(alpha[sel].mean(), rel=1e-5)
        assert got[f"alpha_p5_bin{k}"] == pytest.approx(np.percentile(alpha[sel], 5), rel=1e-5)
        assert got[f"kl_exact_bin{k}"] == pytest.approx(kl_rev[sel].mean(), rel=1e-4)


def test_plots_from_metrics_jsonl(tmp_path):
    import json as _json

    from dsparse_jax.harness import plots

    runs = []
    for label, kl in (("dense", 0.0), ("distillsparse", 0.05)):
        wd = tmp_path / label
        wd.mkdir()
        (wd / "config.json").write_text(_json.dumps({"metrics": {"position_bin": 8}}))
        with open(wd / "metrics.jsonl", "w") as f:
            for step in range(1, 7):
                rec = {
                    "phase": "rl",
                    "step": step,
                    "reward": 0.1 * step,
                    "kl_k3": kl,
                    "response_length_mean": 20.0,
                    "accuracy": 0.1,
                }
                if kl:
                    rec.update(
                        {
                            "kl_exact": kl / step,
                            "alpha_mean": 0.9,
                            "alpha_p5": 0.7,
                            "kl_exact_bin0": kl,
                            "kl_exact_bin1": 2 * kl,
                            "alpha_p5_bin0": 0.8,
                            "alpha_p5_bin1": float("nan"),
                            "alpha_mean_bin0": 0.9,
                            "alpha_mean_bin1": 0.85,
                        }
                    )
                f.write(_json.dumps(rec) + "\n")
            f.write(_json.dumps({"phase": "eval", "step": 6, "greedy_accuracy": 0.5}) + "\n")
        runs.append(str(wd))
    assert plots.bin_profile(plots.load_run(runs[1])["rl"], "kl_exact") == pytest.approx(
        [0.05, 0.1]
    )
    paths = plots.plot_runs(runs, str(tmp_path / "fig"))
    assert sorted(os.path.basename(p) for p in paths) == [
        "alpha_bins.png",
        "kl_bins.png",
        "mismatch.png",
        "reward.png",
    ]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
