"""Learning-rate schedules are stated in RL steps (rl.warmup_steps, lora.warmup_steps, the
cosine decay over rl.num_steps) and converted to optimizer steps in one place
(train/rl_state.py optimizer_steps_per_rl_step): theta and phi take rl.minibatches
optimizer steps per RL step, whatever rl.microbatches is."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsparse_jax.config import cli, schema
from dsparse_jax.config.validate import validate
from dsparse_jax.train import context, phases, rl_state, steps, trainables
from tests.test_modes import base_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_STEPS = 10
# RL steps of warmup: theta's, phi's (its own setting). Optimizer steps: x 2 minibatches.
WARMUP = {"theta": 3.0, "phi": 1.5}


@pytest.fixture(scope="module")
def state():
    """distillsparse's theta and phi with their optimizers: minibatches = microbatches = 2,
    a cosine schedule of peak 1 over 10 RL steps."""
    c = base_config()
    c.rl.num_steps, c.rl.minibatches, c.rl.microbatches = RL_STEPS, 2, 2
    for section, warmup in ((c.rl, WARMUP["theta"]), (c.lora, WARMUP["phi"])):
        section.learning_rate, section.warmup_steps, section.schedule = 1.0, warmup, "cosine"
    validate(c)
    ctx = context.build(c)
    ctx.rewarder.close()
    return trainables.init_state(ctx, rl_state.make_setup(ctx), ctx.init_params)


def learning_rates(tx, minibatches: int, microbatches: int) -> np.ndarray:
    """[RL step, minibatch]: the learning rate of every optimizer step of RL_STEPS RL steps,
    taken through the update phases' path (phases._minibatch_updates over
    steps.accumulated_update). The loss's gradient is 1 at every step, so Adam moves the
    parameter by exactly the learning rate."""

    def terms(w, mb):  # numerator and denominator summed over the microbatch's rows
        return w * jnp.sum(mb["ones"]), (jnp.sum(mb["ones"]), {})

    one = jax.jit(lambda w, opt, mb: steps.accumulated_update(terms, w, opt, mb, microbatches, tx))
    moves = []

    def update(w, opt, mb, tx):
        new, opt, m = one(w, opt, mb)
        moves.append(float(w - new))
        return new, opt, m

    rows = 4 * minibatches * microbatches
    batch = {"tokens": jnp.zeros((rows, 1), jnp.int32), "ones": jnp.ones(rows)}
    w = jnp.zeros((), jnp.float32)
    w = trainables.Trainable(w, tx.init(w), tx)
    for step in range(RL_STEPS):
        w, _ = phases._minibatch_updates(update, w, batch, jax.random.key(step), minibatches)
    return np.array(moves).reshape(RL_STEPS, minibatches)


def expected(count: int, warmup: int, total: int) -> float:
    """The schedule at optimizer step `count`: linear from 0 over `warmup` steps, then a
    cosine to 10% of the peak at `total`."""
    if count < warmup:
        return count / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (count - warmup) / (total - warmup)))


@pytest.mark.parametrize("trainable", ["theta", "phi"])
def test_schedule_is_in_rl_steps(state, trainable):
    tx = getattr(state, trainable).tx
    lr = learning_rates(tx, minibatches=2, microbatches=2)
    warmup, total = round(WARMUP[trainable] * 2), RL_STEPS * 2  # in optimizer steps
    checks = {
        "first RL step": 0,
        "the RL step before the warmup ends": warmup // 2 - 1,
        "the RL step where the warmup ends (the peak)": warmup // 2,
        "last RL step": RL_STEPS - 1,
    }
    for what, step in checks.items():
        want = [expected(step * 2 + i, warmup, total) for i in range(2)]
        np.testing.assert_allclose(lr[step], want, rtol=1e-4, atol=1e-6, err_msg=what)
    assert lr.max() == pytest.approx(1.0, rel=1e-4)  # the peak is reached
    assert lr[-1, -1] > 0.1 + 1e-3  # the floor comes at the end of the run, not before


def test_warmup_is_a_float_from_the_command_line_and_an_old_config_json():
    """A fraction of an RL step is allowed; an older config.json holds an int."""
    c = cli.load_config(
        os.path.join(ROOT, "configs", "gemma_math.py"),
        {"rl.warmup_steps": "3", "lora.warmup_steps": "0.5"},
    )
    assert (c.rl.warmup_steps, c.lora.warmup_steps) == (3.0, 0.5)
    validate(c)
    old = schema.from_dict({"rl": {"warmup_steps": 5}, "lora": {"warmup_steps": 0}})
    assert isinstance(old.rl.warmup_steps, float) and old.rl.warmup_steps == 5.0
    validate(old)


def test_default_warmup_keeps_earlier_results():
    """Every earlier result warmed theta up over 5 optimizer steps (rl.warmup_steps was in
    optimizer steps): the default and configs/gemma2_2b_math.py (4 minibatches) still do."""
    from dsparse_jax.config.validate import load_config

    for name in ("gemma_math", "gemma2_2b_math", "mini_longchain"):
        rl = load_config(os.path.join(ROOT, "configs", f"{name}.py")).rl
        per = rl_state.optimizer_steps_per_rl_step(rl)["theta"]
        assert round(rl.warmup_steps * per) == 5, name
