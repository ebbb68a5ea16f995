"""The draft head's training-time test (EAGLE-3; rl.draft_head.unroll, train/draft_head.py).

- The unrolled training's logits at draft step j of a block equal what the speculative
  sampler's drafter (`_draft_head`) computes at its draft step j on the same tokens, from
  a head cache built as in a rollout (prompt prefill, one verify whose later entries were
  rejected): 1e-5 in log-probabilities, ragged rows, every step of a 4-token draft. Step 0
  also equals the teacher-forced logits at every position. Planted bugs (the true feature
  instead of the head's own output; the block's own entries one position late) fail it.
- Its masks: step j trains only where the block start t - j is a completion token.
- draft_head_update with unroll trains the unrolled steps (their KL falls on a fixed batch).
- rl.draft_head.unroll is validated (an integer in [0, rl.draft_tokens]).

Tiny all-global model (3 layers, 2 KV heads), f32.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import random_params

from dsparse_jax.attention.spec import AttentionSpec
from dsparse_jax.config.validate import ConfigError, load_config, validate
from dsparse_jax.model import config as C
from dsparse_jax.model import draft_head
from dsparse_jax.sampling import speculative as SP
from dsparse_jax.sampling.sampler import SamplingConfig
from dsparse_jax.train import draft_head as draft_head_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, K, S = 32, 4, 16
CFG = C.mini(vocab_size=VOCAB).replace(
    d_model=32, head_dim=8, mlp_dim=64, num_layers=3, num_heads=4, num_kv_heads=2
)
DENSE = AttentionSpec(page_size=4)
LAYERS = draft_head.default_layers(CFG.num_layers)


@pytest.fixture(scope="module")
def models():
    graphdef, state = random_params(CFG, seed=1, embed_std=3.0)
    hg, hs = draft_head.create(CFG, draft_head.DraftHeadConfig(LAYERS), jax.random.key(3))
    return graphdef, state, hg, hs


@pytest.fixture(scope="module")
def drafted(models):
    """A 4-token draft of the sampler's drafter (`_draft_head`) in two rows: prompts of 5
    and 4 tokens, a verify of 5 tokens that emitted 2 and 1 (the head's entries past them
    hold the rejected block's features), then the draft from the new last token. Returns
    (q [B, K, V], cur [B], the drafted block as a sequence (the true tokens up to cur,
    then d_1..d_{K-1}), the head and the policy)."""
    graphdef, state, hg, hs = models
    policy, head = nnx.merge(graphdef, state), nnx.merge(hg, hs)
    ctx = dict(
        head=head,
        model=policy,
        cfg=SamplingConfig(8, VOCAB + 1, 0, temperature=1.0),
        speculative_cfg=SP.SpeculativeConfig(draft="draft_head", draft_tokens=K),
    )
    rows = jnp.arange(2)
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, VOCAB, (2, S)), jnp.int32)
    lengths, n_new = jnp.array([5, 4]), jnp.array([2, 1])
    caches = policy.init_cache(2, S, DENSE)
    _, caches, prompt_h = policy.prefill(tokens[:, :5], lengths, caches, DENSE, hidden_at=LAYERS)
    head_st = SP._head_prefill(ctx, tokens[:, :5], lengths, prompt_h, S)
    verify_in = tokens[rows[:, None], lengths[:, None] + jnp.arange(K + 1)]
    _, _, ver_h = policy.extend(verify_in, lengths, caches, DENSE, hidden_at=LAYERS)
    head_st = SP._head_observe(ctx, head_st, ver_h, verify_in, lengths, n_new)
    cur = lengths + n_new
    out = SP._draft_head(ctx, SP.DraftIn(tokens, cur, cur + 1, caches, jax.random.key(7), head_st))
    at = cur[:, None] + 1 + jnp.arange(K - 1)
    seq = tokens.at[rows[:, None], at].set(out.drafts[:, : K - 1])
    return np.asarray(out.probs), np.asarray(cur), seq, head, policy


def _step_errors(drafted, unrolled=draft_head.unrolled_logits):
    """Per draft step, the largest |log q - log_softmax(unrolled)| over the two rows, and
    the unrolled step 0 against the teacher-forced logits at every position."""
    q_BxKxV, cur, seq, head, policy = drafted
    _, hiddens = policy.forward(seq, hidden_at=LAYERS)
    emb, embed = policy.embed_tokens(seq), policy.unembedding()
    got = unrolled(head, hiddens, emb, embed, K)  # [K, B, S, V]
    tf = draft_head.teacher_forced_logits(head, hiddens, emb, embed)
    logp = np.asarray(jax.nn.log_softmax(got, axis=-1))
    errs = [
        max(np.abs(logp[j, b, cur[b] + j] - np.log(q_BxKxV[b, j])).max() for b in range(2))
        for j in range(K)
    ]
    return errs, float(np.abs(np.asarray(got[0]) - np.asarray(tf)).max())


def test_unrolled_logits_equal_the_drafters(drafted):
    errs, tf_err = _step_errors(drafted)
    assert max(errs) < 1e-5, errs
    assert tf_err < 1e-5, tf_err


def _true_feature_unroll(head, hiddens, emb, embed, steps):
    """Planted bug: every step reads the policy's true feature, not the head's output."""
    g = draft_head.shifted_features(head.feature(hiddens))
    ks, vs, out = [], [], []
    for _ in range(steps):
        h, ks, vs = head.unrolled_pass(g, emb, ks, vs)
        out.append(head.logits(h, embed))
    return jnp.stack(out)


@pytest.mark.parametrize("bug", ["true_feature", "own_entries_one_late"])
def test_planted_unroll_bugs_fail(drafted, bug, monkeypatch):
    """Step 0 still matches; the later steps do not."""
    unrolled = draft_head.unrolled_logits
    if bug == "true_feature":
        unrolled = _true_feature_unroll
    else:
        shift = draft_head._shift
        monkeypatch.setattr(draft_head, "_shift", lambda x, n: shift(x, n + 1))
    errs, _ = _step_errors(drafted, unrolled)
    assert errs[0] < 1e-5 and min(errs[1:]) > 1e-2, errs


def test_unroll_masks():
    """Step 0 is the teacher-forced mask; step j also needs a completion token at t - j."""
    comp = jnp.array([[0, 0, 1, 1, 1, 1, 0, 0]], jnp.float32)
    m = np.asarray(draft_head_train.unroll_masks(comp, 3))
    np.testing.assert_array_equal(m[0, 0], [0, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(m[1, 0], [0, 0, 0, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(m[2, 0], [0, 0, 0, 0, 1, 0, 0, 0])
    assert draft_head_train.unroll_masks(comp, 0).shape == (1, 1, 8)


def test_draft_head_update_trains_the_unrolled_steps(models):
    """30 Adam steps with unroll=3 on a fixed batch: the KL of draft steps 2 and 3 falls."""
    graphdef, state, hg, hs = models
    tokens = jnp.asarray(np.random.default_rng(1).integers(2, VOCAB, (4, S)), jnp.int32)
    mask = jnp.zeros((4, S)).at[:, 4:].set(1.0)
    tx = draft_head_train.make_tx(3e-3, 1.0)
    hs = jax.tree.map(jnp.copy, hs)  # draft_head_update donates it
    _, _, m = draft_head_train.draft_head_update(
        hs,
        tx.init(hs),
        {"tokens": tokens, "mask": mask},
        state,
        graphdef=graphdef,
        head_graphdef=hg,
        layers=LAYERS,
        tx=tx,
        steps=30,
        unroll=3,
    )
    m = {k: float(v) for k, v in m.items()}
    assert {"kl_2", "kl_3", "top1_agree_2", "top1_agree_3"} <= set(m), m
    for j in (2, 3):
        assert m[f"kl_{j}_after"] < 0.7 * m[f"kl_{j}"], m
    assert "kl_4" not in m


@pytest.mark.parametrize("value,message", [(-1, "must be an integer >= 0")])
def test_unroll_is_validated(value, message):
    c = load_config(os.path.join(ROOT, "configs", "gemma_math.py"))
    c.rl.rollout_mode, c.rl.draft = "speculative", "draft_head"
    c.rl.draft_head.unroll = K
    validate(c)
    c.rl.draft_head.unroll = c.rl.draft_tokens + 1  # capped at the draft's steps
    validate(c)
    c.rl.draft_head.unroll = value
    with pytest.raises(ConfigError) as e:
        validate(c)
    text = str(e.value)
    assert text.startswith("config.rl.draft_head.unroll: ") and message in text, text
    assert "\n" not in text
