"""The jitted sampler: greedy == argmax, log-prob convention, EOS / lengths / padding,
samples_per_prompt, top-k / top-p, top_logprobs, no recompilation on new weights.

Every rollout is checked against the teacher-forced forward of the same model on the
tokens it produced. To stay fast the file uses one model graph, a few SamplingConfigs
(each is a compile) and one forward shape. Tolerances: log-probs 1e-4 absolute;
sampling frequencies within 5 binomial standard deviations (plus 2e-3).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import random_params

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.model import config as C
from dsparse_jax.model.transformer import Transformer
from dsparse_jax.sampling import sampler as S
from dsparse_jax.sampling.sampler import Sampler, SamplingConfig

LP_TOL = 1e-4
VOCAB, EOS, PAD = 32, 1, 0
CFG = C.tiny(vocab_size=VOCAB).replace(
    d_model=32, head_dim=8, mlp_dim=64, num_layers=3, num_heads=4, num_kv_heads=2, sliding_window=8
)
MAX_NEW = 12
LENGTHS = np.array([7, 3, 5, 1, 6, 2])
PROMPTS = np.random.default_rng(0).integers(2, VOCAB, (6, 7))  # no EOS / PAD inside
PROMPTS = np.where(np.arange(7) < LENGTHS[:, None], PROMPTS, PAD)
GREEDY = SamplingConfig(MAX_NEW, EOS, PAD, temperature=0.0, top_logprobs=3)
TEMP = SamplingConfig(MAX_NEW, EOS, PAD, temperature=0.7, samples_per_prompt=3, top_logprobs=4)
TRUNC = SamplingConfig(MAX_NEW, EOS, PAD, temperature=1.3, top_k=6, top_p=0.7)


class CountingTransformer(Transformer):
    """Transformer whose decode reports each executed step to the host (and counts traces)."""

    traces = 0
    steps = 0
    batches = []  # (mode, batch) of every traced prefill / decode

    def prefill(self, tokens_BxT, *args, **kw):
        CountingTransformer.batches.append(("prefill", tokens_BxT.shape[0]))
        return super().prefill(tokens_BxT, *args, **kw)

    def decode(self, tokens_B, pos_B, caches, spec=AttentionSpec(), **kw):
        CountingTransformer.traces += 1
        CountingTransformer.batches.append(("decode", tokens_B.shape[0]))

        def tick(_):
            CountingTransformer.steps += 1

        jax.debug.callback(tick, pos_B)
        return super().decode(tokens_B, pos_B, caches, spec, **kw)


@functools.lru_cache(maxsize=None)
def setup():
    """One model graph for the whole file (the decode-step-counting Transformer)."""
    graphdef, state = random_params(CFG, model_cls=CountingTransformer)
    forward = jax.jit(lambda st, tokens: nnx.merge(graphdef, st).forward(tokens))
    return graphdef, state, Sampler(graphdef), forward


@functools.lru_cache(maxsize=None)
def rollout(cfg, seed=0, prompts_rows=6):
    _, state, sampler, forward = setup()
    r = sampler(
        state,
        jnp.asarray(PROMPTS[:prompts_rows]),
        LENGTHS[:prompts_rows],
        jax.random.key(seed),
        cfg,
    )
    r = jax.device_get(r)
    logits = np.asarray(forward(state, jnp.asarray(r.tokens)), np.float64)
    return r, logits


def completion_positions(r):
    """(row, position) of every completion token, from the rollout's own lengths."""
    out = []
    for b in range(r.tokens.shape[0]):
        p = int(r.prompt_lengths[b])
        out += [(b, j) for j in range(p, p + int(r.completion_lengths[b]))]
    return out


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def check_layout(r, cfg, prompts, lengths):
    """Prompt kept, completion after it (EOS ends it and is part of it), pad after,
    mask/log-probs zero outside the completion, at most max_new_tokens."""
    n = cfg.samples_per_prompt
    b, s = r.tokens.shape
    assert b == len(lengths) * n
    assert s == S.buffer_length(prompts.shape[1], cfg.max_new_tokens, 16)
    np.testing.assert_array_equal(r.prompt_lengths, np.repeat(lengths, n))
    for row in range(b):
        p, c = int(r.prompt_lengths[row]), int(r.completion_lengths[row])
        tok = r.tokens[row]
        np.testing.assert_array_equal(tok[:p], prompts[row // n, :p])
        assert 1 <= c <= cfg.max_new_tokens
        comp = tok[p : p + c]
        assert EOS not in comp[:-1]  # generation stops at the first EOS
        if c < cfg.max_new_tokens:
            assert comp[-1] == EOS  # only EOS ends a completion early
        assert np.all(tok[p + c :] == PAD)
        mask = np.zeros(s)
        mask[p : p + c] = 1
        np.testing.assert_array_equal(r.completion_mask[row], mask)
        assert np.all(r.logprobs[row][mask == 0] == 0)
        assert np.all(r.logprobs[row][mask == 1] <= 0)
    np.testing.assert_array_equal(r.lengths, r.prompt_lengths + r.completion_lengths)


def test_stop_ids_end_rows_like_eos():
    """SamplingConfig.stop_ids (a checkpoint's several stop tokens): a row ends at the first
    of EOS or a stop id, the stop token its last; the rest of the rollout is unchanged."""
    r, _ = rollout(GREEDY)
    comp0 = r.tokens[0, LENGTHS[0] : LENGTHS[0] + r.completion_lengths[0]]
    stop = int(comp0[len(comp0) // 2])  # greedy row 0 emits it mid-completion
    assert stop not in (EOS, PAD)
    cfg = dataclasses.replace(GREEDY, stop_ids=(stop,))
    got, _ = rollout(cfg)
    for b in range(6):
        p, c = int(r.prompt_lengths[b]), int(r.completion_lengths[b])
        comp = list(r.tokens[b, p : p + c])
        ends = [j for j, t in enumerate(comp) if t in (EOS, stop)]
        n = ends[0] + 1 if ends else c
        assert int(got.completion_lengths[b]) == n, b
        np.testing.assert_array_equal(got.tokens[b, : p + n], r.tokens[b, : p + n])
        assert np.all(got.tokens[b, p + n :] == PAD)
        np.testing.assert_allclose(got.logprobs[b, : p + n], r.logprobs[b, : p + n], atol=LP_TOL)
    assert int(got.completion_lengths[0]) <= len(comp0) // 2 + 1 < int(r.completion_lengths[0])


# ----------------------------------------------------------------------------- greedy
@pytest.mark.slow  # compiles a sampler
def test_greedy_is_argmax_of_teacher_forced_forward():
    r, logits = rollout(GREEDY)
    check_layout(r, GREEDY, PROMPTS, LENGTHS)
    lp = log_softmax(logits)
    pos = completion_positions(r)
    assert len(pos) > 30
    for b, j in pos:
        tok = r.tokens[b, j]
        # The argmax of the teacher-forced logits at j - 1 (ties within 1e-5 accepted).
        assert logits[b, j - 1, tok] >= logits[b, j - 1].max() - 1e-5, (b, j)
        # Greedy log-prob convention: log_softmax(logits) (temperature 1).
        assert abs(r.logprobs[b, j] - lp[b, j - 1, tok]) < LP_TOL, (b, j)
    # top_logprobs: the 3 largest log_softmax entries (temperature 1 for greedy).
    vals, ids = r.top_logprobs
    assert vals.shape == (6, r.tokens.shape[1], 3) and ids.shape == vals.shape
    for b, j in pos:
        want = np.sort(lp[b, j - 1])[::-1][:3]
        np.testing.assert_allclose(vals[b, j], want, atol=LP_TOL)
        np.testing.assert_allclose(lp[b, j - 1, ids[b, j]], want, atol=LP_TOL)
        assert ids[b, j, 0] == r.tokens[b, j]  # greedy token is the top-1


def test_max_new_tokens_reached_without_eos():
    r, _ = rollout(GREEDY)
    no_eos = [b for b in range(6) if EOS not in r.tokens[b, r.prompt_lengths[b] :]]
    assert no_eos  # precondition of this test (holds for this seed)
    for b in no_eos:
        assert r.completion_lengths[b] == MAX_NEW
        assert np.all(r.tokens[b, LENGTHS[b] + MAX_NEW :] == PAD)


# ----------------------------------------------------------------------------- T != 1
@pytest.mark.slow  # compiles a sampler
def test_temperature_logprobs_match_teacher_forced():
    r, logits = rollout(TEMP, seed=1, prompts_rows=2)
    check_layout(r, TEMP, PROMPTS[:2], LENGTHS[:2])
    lp = log_softmax(logits / TEMP.temperature)
    pos = completion_positions(r)
    assert len(pos) > 20
    got = np.array([r.logprobs[b, j] for b, j in pos])
    want = np.array([lp[b, j - 1, r.tokens[b, j]] for b, j in pos])
    np.testing.assert_allclose(got, want, atol=LP_TOL, rtol=0)
    # The temperature matters: at T=1 the log-probs would differ.
    lp1 = log_softmax(logits)
    assert np.abs(got - np.array([lp1[b, j - 1, r.tokens[b, j]] for b, j in pos])).max() > 0.05
    vals, ids = r.top_logprobs
    for b, j in pos:
        np.testing.assert_allclose(vals[b, j], np.sort(lp[b, j - 1])[::-1][:4], atol=LP_TOL)
        np.testing.assert_array_equal(np.sort(ids[b, j]), np.sort(np.argsort(-lp[b, j - 1])[:4]))


def test_samples_per_prompt_groups():
    r, _ = rollout(TEMP, seed=1, prompts_rows=2)
    n = TEMP.samples_per_prompt
    # Contiguous groups: rows [i*n, (i+1)*n) hold prompt i.
    for i in range(2):
        for row in range(i * n, (i + 1) * n):
            assert r.prompt_lengths[row] == LENGTHS[i]
            np.testing.assert_array_equal(r.tokens[row, : LENGTHS[i]], PROMPTS[i, : LENGTHS[i]])
        comps = [tuple(r.tokens[row, LENGTHS[i] :]) for row in range(i * n, (i + 1) * n)]
        assert len(set(comps)) == n  # the samples of one prompt differ
    # One prefill of the 2 prompts serves the 6 samples (trace the sampler, no compile).
    _, state, sampler, _ = setup()
    CountingTransformer.batches = []
    jax.make_jaxpr(
        functools.partial(sampler._sample, cfg=TEMP, spec=AttentionSpec(), lora_scale=1.0)
    )(state, jnp.asarray(PROMPTS[:2]), jnp.asarray(LENGTHS[:2]), jax.random.key(0), None)
    assert CountingTransformer.batches == [("prefill", 2), ("decode", 6)]


def eos_bigram_state(state, p_eos, temperature):
    """Weights that make the model a bigram model with a known next-token distribution:
    after any token but EOS, EOS has probability p_eos at `temperature` and the other 31
    tokens share the rest uniformly.

    Post-attention / post-MLP norm gains of 0 (scale -1) zero every residual update, so the
    final hidden state is embed(token) * sqrt(d); with an orthogonal embedding Q and final
    norm gain g the logits are sqrt(d) * (Q diag(g) Q^T)[token], i.e. any symmetric logit
    matrix M = sqrt(d) U diag(lambda) U^T (eigendecomposition; Q = U, g = lambda / sqrt(d)).
    """
    a = temperature * math.log(p_eos * (VOCAB - 1) / (1 - p_eos))
    a = CFG.final_softcap * math.atanh(a / CFG.final_softcap)  # undo the final soft-cap
    m = np.zeros((VOCAB, VOCAB))
    m[:, EOS] = m[EOS, :] = a
    lam, u = np.linalg.eigh(m)
    new = jax.tree.map(lambda x: x, state)
    new["embed"][...] = jnp.asarray(u, jnp.float32)
    new["final_norm"]["scale"][...] = jnp.asarray(lam / math.sqrt(CFG.d_model) - 1, jnp.float32)
    for i in range(CFG.num_layers):
        for name in ("post_attn_norm", "post_mlp_norm"):
            new["layers"][i][name]["scale"][...] = -jnp.ones((CFG.d_model,))
    return new


def sample_until(state, cfg, ok, prompts_rows=2, tries=40):
    """A rollout (and its number of executed decode steps) for the first key where ok(r)."""
    _, _, sampler, _ = setup()
    for seed in range(tries):
        CountingTransformer.steps = 0
        r = jax.device_get(
            sampler(
                state,
                jnp.asarray(PROMPTS[:prompts_rows]),
                LENGTHS[:prompts_rows],
                jax.random.key(seed),
                cfg,
            )
        )
        jax.effects_barrier()
        if ok(r):
            return r, CountingTransformer.steps
    pytest.fail(f"no key in {tries} satisfied the test's precondition")


def test_eos_stops_a_row():
    """P(EOS) = 0.15 per step: a rollout where some rows stop early and some run to
    max_new_tokens (reuses the compiled TEMP sampler: new weights only)."""
    _, state, _, _ = setup()
    p_eos = 0.15
    bigram = eos_bigram_state(state, p_eos, TEMP.temperature)
    r, _ = sample_until(bigram, TEMP, lambda r: 0 < (r.completion_lengths < MAX_NEW).sum() < 6)
    check_layout(r, TEMP, PROMPTS[:2], LENGTHS[:2])
    for b in range(6):
        p, c = r.prompt_lengths[b], r.completion_lengths[b]
        if c < MAX_NEW:
            assert r.tokens[b, p + c - 1] == EOS and r.completion_mask[b, p + c - 1] == 1
            assert np.all(r.tokens[b, p + c :] == PAD) and np.all(
                r.completion_mask[b, p + c :] == 0
            )
        assert r.lengths[b] == p + c
        # The log-probs are the closed-form bigram ones (the prompts hold no EOS).
        comp = r.tokens[b, p : p + c]
        want = np.where(comp == EOS, math.log(p_eos), math.log((1 - p_eos) / (VOCAB - 1)))
        np.testing.assert_allclose(r.logprobs[b, p : p + c], want, atol=LP_TOL)
        if c >= 8:  # uniform over 31 tokens: fresh randomness at every step
            assert len(set(comp)) >= 4, comp


@pytest.mark.slow
def test_early_exit_and_no_recompile_on_new_weights():
    """The decode loop stops once every row has emitted EOS (counted decode steps); new
    weights, prompts and keys reuse the compiled sampler (no new trace or cache entry)."""
    _, state, sampler, _ = setup()
    r, steps = sample_until(state, TEMP, lambda r: True)
    traces, cache_size = CountingTransformer.traces, sampler._jitted._cache_size()
    if (r.completion_lengths == MAX_NEW).any():
        assert steps == MAX_NEW - 1  # a running row: max_new_tokens - 1 decode steps
    bigram = eos_bigram_state(state, 0.5, TEMP.temperature)
    r2, steps = sample_until(bigram, TEMP, lambda r: (r.completion_lengths < MAX_NEW).all())
    assert steps == r2.completion_lengths.max() - 1 < MAX_NEW - 1  # none after the last EOS
    assert np.abs(r2.logprobs - r.logprobs).max() > 0.1  # the new weights were used
    # Other weights, prompts and keys.
    sample_until(jax.tree.map(lambda x: x * 1.01, state), TEMP, lambda r: True)
    r3 = sampler(state, jnp.asarray(PROMPTS[2:4]), LENGTHS[2:4], jax.random.key(5), TEMP)
    assert int(r3.prompt_lengths[0]) == LENGTHS[2]
    assert CountingTransformer.traces == traces
    assert sampler._jitted._cache_size() == cache_size


# ----------------------------------------------------------------------------- top-k / top-p
LOGITS6 = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])


def np_truncated_probs(logits, top_k, top_p):
    """Reference: keep the top_k largest, then the smallest prefix (by decreasing prob)
    whose mass before each kept token is < top_p; renormalise."""
    order = np.argsort(-logits)
    keep = np.zeros(len(logits), bool)
    keep[order[: top_k or len(logits)]] = True
    p = np.where(keep, np.exp(logits - logits.max()), 0)
    p /= p.sum()
    before = np.cumsum(p[order]) - p[order]
    keep2 = np.zeros(len(logits), bool)
    keep2[order[(before < top_p) & keep[order]]] = True
    q = np.where(keep2, p, 0)
    return q / q.sum()


TRUNC_CASES = [
    (1.0, 3, 1.0),
    (1.0, 0, 0.8),
    (1.0, 4, 0.7),
    (0.5, 0, 0.9),
    (2.0, 5, 0.95),
    (1.0, 0, 1.0),
    (1.0, 1, 1.0),
    (1.0, 0, 1e-3),
]
N_DRAWS = 20_000


@functools.lru_cache(maxsize=None)
def truncation_draws():
    """All TRUNC_CASES in one jit: N_DRAWS samples from LOGITS6 each, their log-probs, and
    the truncated logits."""

    def run(key):
        logits = jnp.broadcast_to(jnp.asarray(LOGITS6, jnp.float32), (N_DRAWS, 6))
        out = []
        for t, k, p in TRUNC_CASES:
            cfg = SamplingConfig(1, EOS, PAD, temperature=t, top_k=k, top_p=p)
            tok, lp = S.sample_token(logits, key, cfg)
            out.append((tok, lp, S.truncate_logits(logits[:1] / t, k, p)[0]))
        return out

    return jax.device_get(jax.jit(run)(jax.random.key(7)))


@pytest.mark.parametrize("case", range(len(TRUNC_CASES)))
def test_top_k_top_p_frequencies_and_logprobs(case):
    temperature, top_k, top_p = TRUNC_CASES[case]
    tok, lp, trunc = truncation_draws()[case]
    want = np_truncated_probs(LOGITS6 / temperature, top_k, top_p)
    # truncate_logits: -inf exactly outside the allowed set, unchanged inside.
    np.testing.assert_array_equal(np.isfinite(trunc), want > 0)
    np.testing.assert_allclose(trunc[want > 0], (LOGITS6 / temperature)[want > 0], rtol=1e-6)
    # Samples only from the allowed set, with the renormalised frequencies.
    assert np.all(want[tok] > 0)
    freq = np.bincount(tok, minlength=6) / N_DRAWS
    tol = 5 * np.sqrt(want * (1 - want) / N_DRAWS) + 2e-3
    assert np.all(np.abs(freq - want) <= tol), (freq, want)
    # The returned log-prob is the log of the renormalised probability.
    np.testing.assert_allclose(lp, np.log(want[tok]), atol=1e-5)


def test_truncation_reference_hand_values():
    """The numpy reference itself, on hand-checked cases (logits 3, 2, 1, 0.5, 0, -1)."""
    assert set(np.flatnonzero(np_truncated_probs(LOGITS6, 3, 1.0))) == {5, 0, 1}
    # softmax of (3, 2, 1, .5, 0, -1) = .605, .222, .082, .050, .030, .011: the mass before
    # the third is .827 >= .8 -> {5, 0}; with top_p .83 the third is kept too.
    assert set(np.flatnonzero(np_truncated_probs(LOGITS6, 0, 0.8))) == {5, 0}
    assert set(np.flatnonzero(np_truncated_probs(LOGITS6, 0, 0.83))) == {5, 0, 1}
    assert set(np.flatnonzero(np_truncated_probs(LOGITS6, 0, 1e-3))) == {5}


@pytest.mark.slow  # compiles a sampler
def test_truncated_rollout_samples_from_allowed_set():
    """top-k/top-p inside the sampler: every token is in the truncated set of the
    teacher-forced logits, and its log-prob is log of the renormalised probability."""
    r, logits = rollout(TRUNC, seed=2)
    check_layout(r, TRUNC, PROMPTS, LENGTHS)
    n_trunc = 0
    for b, j in completion_positions(r):
        want = np_truncated_probs(logits[b, j - 1] / TRUNC.temperature, TRUNC.top_k, TRUNC.top_p)
        tok = r.tokens[b, j]
        assert want[tok] > 0, (b, j)
        assert abs(r.logprobs[b, j] - np.log(want[tok])) < LP_TOL, (b, j)
        n_trunc += (want == 0).sum() > VOCAB - TRUNC.top_k
    assert n_trunc > 0  # top-p cut below top-k somewhere


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(samples_per_prompt=0), "samples_per_prompt"),
        (dict(top_logprobs=-1), "top_logprobs"),
        (dict(grow_buffer_from=-1), "grow_buffer_from"),
    ],
)
def test_bad_sampling_config_raises(kw, match):
    args = dict(max_new_tokens=4, eos_id=EOS, pad_id=PAD) | kw
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**args)


def test_batch_mismatch_raises():
    _, state, sampler, _ = setup()
    with pytest.raises(ValueError, match="batch size"):
        sampler(state, jnp.asarray(PROMPTS), LENGTHS[:3], jax.random.key(0), GREEDY)


def test_buffer_length_and_completion_view():
    assert S.buffer_length(7, 12, 16) == 32 and S.buffer_length(4, 12, 16) == 16
    assert S.buffer_length(5, 12, 4) == 20
    # Growing buffers: prompt + N, 2N, 4N, ... (rounded to pages, deduplicated), then full.
    assert S.buffer_schedule(64, 4096, 16) == [4160]
    assert S.buffer_schedule(64, 4096, 16, 1024) == [1088, 2112, 4160]
    assert S.buffer_schedule(64, 1024, 16, 1024) == [1088]  # nothing to grow into
    assert S.buffer_schedule(7, 12, 16, 4) == [16, 32]  # 11 and 15 share a page-rounded size
    assert S.buffer_schedule(17, 28, 4, 4) == [24, 28, 36, 48]
    r, _ = rollout(GREEDY)
    view = S.completion_view(r, PAD)
    for b in range(6):
        c = r.completion_lengths[b]
        np.testing.assert_array_equal(view[b, :c], r.tokens[b, LENGTHS[b] : LENGTHS[b] + c])
        assert np.all(view[b, c:] == PAD)


def test_rollout_is_a_pytree_with_a_static_prompt_width():
    """Row gathers (tree maps) keep the static prompt width, which reaches the decode
    record as the twin's dense prefix; a forced replay needs one row per prompt."""
    b, s = 4, 16
    ids = jnp.zeros((b, s, 2, 3), jnp.int32)
    r = S.Rollout(
        tokens=jnp.zeros((b, s), jnp.int32),
        prompt_lengths=jnp.array([3, 5, 5, 2]),
        completion_lengths=jnp.array([4, 4, 0, 9]),
        completion_mask=jnp.zeros((b, s)),
        logprobs=jnp.zeros((b, s)),
        page_ids={3: ids},
        prompt_width=6,
    )
    assert len(jax.tree.leaves(r)) == 6  # the arrays; prompt_width is static
    kept = jax.tree.map(lambda x: x[np.array([3, 0])], r)
    assert kept.prompt_width == 6 and kept.tokens.shape == (2, s)
    rec = kept.pages()[3]
    assert rec.dense_prefix == 6 and rec.page_ids.shape == (2, s, 2, 3)
    np.testing.assert_array_equal(rec.sparse_query[1], (np.arange(s) >= 3) & (np.arange(s) < 6))
    assert S.Rollout(*jax.tree.leaves(r)[:5], page_ids={3: ids}).pages()[3].dense_prefix is None
    graphdef, state = random_params(C.tiny(vocab_size=16).replace(num_layers=1), seed=0)
    cfg = SamplingConfig(4, 1, 0, samples_per_prompt=2)
    with pytest.raises(ValueError, match="forced"):
        Sampler(graphdef)(
            state, jnp.ones((2, 3)), [3, 3], jax.random.key(0), cfg, forced_BxS=jnp.ones((4, 8))
        )
