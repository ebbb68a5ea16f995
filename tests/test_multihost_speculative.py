"""Speculative rollouts on a 2-process CPU mesh (2 processes x 4 devices, mesh (2, 2, 2),
jax.distributed over localhost as in test_multihost.py): with every drafter (sparse_self,
the history drafter's latest, counts and tree modes with their bank, draft_head), two
rollout phases over the same 8 prompts (the second drafts from the bank the first filled;
each process's bank holds the prompts it made) give the same tokens as one process on one
device, and log-probs within 1e-4 (the partitioner reorders f32 reductions)."""

import json
import sys

import numpy as np
import pytest
from test_multihost import _ctx, join_two_processes, run_two_processes

DRAFTS = [
    ("sparse_self", "latest"),
    ("history", "latest"),
    ("history", "counts"),
    ("history", "tree"),
    ("draft_head", "latest"),
]


def rollouts(mesh) -> dict:
    """{drafter: [tokens, logprobs] of both rollout phases, every row} on this mesh."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import test_sharding as ts

    from dsparse_jax.config.validate import validate
    from dsparse_jax.train import context, phases, rl_state, trainables

    base = _ctx(ts)
    out = {}
    for draft, mode in DRAFTS:
        c = ts.mesh_config(mesh)
        c.rl.rollout_mode, c.rl.draft, c.rl.history_draft = "speculative", draft, mode
        c.rl.samples_generated, c.rl.draft_tokens = 0, 3
        c.rl.draft_head.warmup_steps = 0
        validate(c)
        task = dataclasses.replace(base.task, train_size=c.rl.prompts_per_step)  # they recur
        ctx = context.RunContext(**{**base.__dict__, "config": c, "task": task})
        setup = rl_state.make_setup(ctx)
        st = trainables.init_state(ctx, setup, jax.tree.map(jnp.copy, ctx.init_params))
        got = []
        for step in range(2):
            gen, m = phases.rollout(ctx, setup, st, jax.random.key(11 + step), step)
            r = gen.rollout
            rows = [r.tokens, r.logprobs]
            if setup.plan is not None:
                rows = [setup.plan.gather_rows(setup.plan.local_rows(x)) for x in rows]
            got += [np.asarray(x).tolist() for x in rows]
            got.append(m["spec_accept_length"])
        out[f"{draft}/{mode}"] = got
    return out


def worker(pid: int, port: int, path: str) -> None:
    join_two_processes(pid, port)
    import jax

    with open(path, "w") as f:
        json.dump(rollouts((2, 2, 2)), f)
    jax.distributed.shutdown()


@pytest.mark.slow
def test_two_process_speculative_rollouts_equal_one_process(tmp_path):
    got = run_two_processes(__file__, tmp_path, timeout=600)
    want = rollouts((1, 1, 1))
    for name, ref in want.items():
        for g in got:
            for step in range(2):
                tokens, logprobs, accept = g[name][3 * step : 3 * step + 3]
                np.testing.assert_array_equal(tokens, ref[3 * step], err_msg=name)
                np.testing.assert_allclose(logprobs, ref[3 * step + 1], atol=1e-4, err_msg=name)
                assert accept == pytest.approx(ref[3 * step + 2], abs=1e-6), name
    # The bank made a difference: the second phase drafts from the first one's rows.
    for mode in ("latest", "counts", "tree"):
        first, second = want[f"history/{mode}"][2], want[f"history/{mode}"][5]
        assert second > first, (mode, first, second)


def test_the_bank_is_checkpointed_by_one_process_only(monkeypatch):
    """Each process's bank holds its own prompts: with several processes it stays out of
    the checkpoint (a resume rebuilds it) rather than every process restoring process 0's."""
    import jax

    from dsparse_jax.sampling.history import HistoryBank
    from dsparse_jax.train import trainables

    st = trainables.TrainState(theta=None, history=HistoryBank(2, 2, 8))
    assert "history" in trainables.to_tree(st)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert "history" not in trainables.to_tree(st)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
