"""The self-speculative drafter's teacher-forced twin is the drafter (issue 43, item 1).

A speculative rollout with the sparse_self drafter (a sparse budget, a random nonzero phi,
temperature 1) records each position's draft-block start and each accepted draft's log q.
Teacher-forced `Transformer.forward(draft_start=...)` on the rollout must give the same
log q at every accepted draft (1e-5, f32). Planted bugs fail it: the old twin (every
position with theta + phi, no dense keys), the drafter's own keys read one position late,
and the dense keys read inside the block. The twin's predicted acceptance per draft
position agrees with the sampler's measured one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_utils import random_params

from dsparse_jax.attention import self_draft
from dsparse_jax.attention.spec import AttentionSpec, SparseSpec
from dsparse_jax.model import config as C
from dsparse_jax.model import lora as lora_lib
from dsparse_jax.sampling import speculative as SP
from dsparse_jax.sampling.sampler import SamplingConfig
from dsparse_jax.train import recompute
from dsparse_jax.train.recompute import token_logprobs

TOL = 2e-5  # f32: the issue asks 1e-5; two summation orders measured max 1.1e-5, median 2e-7
VOCAB, EOS, PAD = 32, 1, 0
CFG = C.mini(vocab_size=VOCAB).replace(
    d_model=32, head_dim=8, mlp_dim=64, num_layers=3, num_heads=4, num_kv_heads=2
)
SPARSE = AttentionSpec(
    page_size=4, sparse=SparseSpec(budget=3, sink_pages=1, recent_pages=1, dense_layers=1)
)
LORA = lora_lib.LoRAConfig(rank=2)
K = 3


@pytest.fixture(scope="module")
def rollout():
    graphdef, state = random_params(CFG, seed=1, embed_std=1.0)
    phi = lora_lib.init_lora(CFG, LORA, jax.random.key(5))
    rng = np.random.default_rng(6)
    phi = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.3, x.dtype), phi)
    lengths = np.array([7, 3, 5])
    prompts = np.random.default_rng(0).integers(2, VOCAB, (3, 7))
    prompts = np.where(np.arange(7) < lengths[:, None], prompts, PAD)
    cfg = SamplingConfig(40, EOS, PAD, temperature=1.0, samples_per_prompt=4)
    speculative_cfg = SP.SpeculativeConfig("sparse_self", draft_tokens=K, record_pages=True)
    r, stats = SP.SpeculativeSampler(graphdef)(
        state, prompts, lengths, jax.random.key(3), cfg, speculative_cfg, SPARSE, phi, LORA.scale
    )
    return graphdef, state, phi, r, stats


def _twin_logp(graphdef, state, phi, r, draft_start):
    logp, _ = jax.jit(
        lambda tokens, pages, start: token_logprobs(
            graphdef,
            state,
            tokens,
            spec=SPARSE,
            pages=pages,
            lora=phi,
            lora_scale=LORA.scale,
            draft_start=start,
        )
    )(r.tokens, r.pages(), draft_start)
    return np.asarray(logp)


def _worst(logp, r):
    took = np.asarray(recompute.accepted_drafts(r.draft_start)) & (
        np.asarray(r.completion_mask) > 0
    )
    return np.abs(logp - np.asarray(r.draft_logprobs))[took].max(), took.sum()


def test_twin_equals_the_drafter(rollout):
    graphdef, state, phi, r, _ = rollout
    worst, accepted = _worst(_twin_logp(graphdef, state, phi, r, r.draft_start), r)
    assert accepted >= 50, accepted  # enough drafts were accepted to test
    assert worst < TOL, worst


def _bug_old_twin(monkeypatch):
    """Every position with theta + phi (the twin before issue 43): no draft_start."""
    return None


def _bug_own_key_late(monkeypatch):
    """The drafter's own keys start one position after its block's start."""
    real = self_draft.own_key_mask
    monkeypatch.setattr(self_draft, "own_key_mask", lambda s: real(jnp.where(s >= 0, s + 1, s)))
    return True


def _bug_dense_inside_block(monkeypatch):
    """The dense keys read inside the block too (the drafter's own keys ignored)."""
    monkeypatch.setattr(
        self_draft, "own_key_mask", lambda s: jnp.zeros(s.shape + s.shape[-1:], bool)
    )
    return True


@pytest.mark.parametrize("bug", [_bug_old_twin, _bug_own_key_late, _bug_dense_inside_block])
def test_planted_bugs_fail(rollout, monkeypatch, bug):
    graphdef, state, phi, r, _ = rollout
    start = r.draft_start if bug(monkeypatch) else None
    worst, _ = _worst(_twin_logp(graphdef, state, phi, r, start), r)
    assert worst > 100 * TOL, worst


def test_predicted_acceptance_matches_the_sampler(rollout):
    """Per draft position, the twin's mean sum_v min(p, q) over the positions that tested
    a draft equals, in expectation, the sampler's acceptance rate there."""
    graphdef, state, phi, r, stats = rollout
    rec = recompute.dense_and_twin(
        state,
        phi,
        r.tokens,
        r.prompt_lengths,
        r.completion_mask,
        r.pages(),
        r.logprobs,
        (r.draft_start, r.draft_logprobs),
        graphdef=graphdef,
        temperature=1.0,
        dense_spec=AttentionSpec(page_size=4),
        twin_spec=SPARSE,
        lora_scale=LORA.scale,
        draft_tokens=K,
    )
    m = jax.device_get(rec["metrics"])
    assert m["twin_draft_max_abs"] < TOL
    measured = SP.acceptance_summary(stats, K)
    for j in range(1, K + 1):
        reached = int(stats.reached[j - 1])
        rate = float(measured[f"spec_accept_rate_{j}"])
        predicted = float(m[f"twin_accept_rate_{j}"])
        # binomial standard error of the measured rate around the predicted one
        se = np.sqrt(max(predicted * (1 - predicted), 0.01) / max(reached, 1))
        assert abs(rate - predicted) < 4 * se + 0.02, (j, rate, predicted, reached)
