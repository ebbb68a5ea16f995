"""Multi-process SPMD on one machine: 2 processes x 4 CPU devices, jax.distributed over
localhost (gloo CPU collectives), one full distillsparse RL step on the global 8-device
mesh (2, 2, 2). Each process makes its own 4 of the 8 prompts (the placement rule of
parallel/sharding.py), grades its own rows and all-gathers the rewards; both processes must
report the same metrics as the single-device step of test_sharding.py's config, and the
same (global) updated parameters."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = (2, 2, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_two_processes(pid: int, port: int) -> None:
    """In a worker process: the checkout and tests/ on the path, then process `pid` of 2
    joins jax.distributed at 127.0.0.1:`port` (8 devices in all)."""
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    import jax
    import ml_collections

    from dsparse_jax.parallel import distributed

    dist = ml_collections.ConfigDict(
        {
            "mesh": {
                "distributed": "on",
                "coordinator_address": f"127.0.0.1:{port}",
                "num_processes": 2,
                "process_id": pid,
            }
        }
    )
    assert distributed.initialize(dist)
    assert jax.process_count() == 2 and jax.device_count() == 8


def worker(pid: int, port: int, out: str, mesh: tuple) -> None:
    """One process: initialise jax.distributed, run one RL step, write metrics and a
    digest of the updated parameters (sums of every leaf) as JSON."""
    join_two_processes(pid, port)
    import jax
    import jax.numpy as jnp
    import test_sharding as ts

    from dsparse_jax.train import phases

    phases.grade = ts.fake_score
    ctx = ts._ctx(_ctx(ts), mesh)
    setup, st, m = ts._one_step(ctx)
    assert setup.plan.multiprocess
    trees = {"params": st.theta.params, "lora": st.lora}
    sums = {name: [float(jnp.sum(x)) for x in jax.tree.leaves(t)] for name, t in trees.items()}
    local = {"params": [x.sharding.is_fully_addressable for x in jax.tree.leaves(trees["params"])]}
    with open(out, "w") as f:
        json.dump(
            {
                "metrics": m,
                "sums": sums,
                "process": jax.process_index(),
                "any_global": not all(local["params"]),
            },
            f,
        )
    jax.distributed.shutdown()


def _ctx(ts):
    """test_sharding.base_ctx's body (pytest wraps fixtures; call the function itself)."""
    fn = getattr(ts.base_ctx, "_fixture_function", None) or ts.base_ctx.__pytest_wrapped__.obj
    return fn()


def run_two_processes(script: str, tmp_path, timeout: int) -> list:
    """Runs `python script PID PORT OUT` for PID 0 and 1 (4 CPU devices each, one free
    coordinator port) and returns the JSON each wrote to its OUT."""
    port = _free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0",
    )
    paths = [tmp_path / f"p{pid}.json" for pid in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(script), str(pid), str(port), str(paths[pid])],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{os.path.basename(script)}: the two processes timed out")
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-4000:]
    return [json.load(open(path)) for path in paths]


@pytest.mark.slow
def test_two_processes_one_rl_step(tmp_path):
    got = run_two_processes(__file__, tmp_path, timeout=420)
    assert [g["process"] for g in got] == [0, 1]
    assert got[0]["any_global"]  # the state really spans both processes
    # Both processes saw the same global step.
    for k, v in got[0]["metrics"].items():
        if not k.startswith(("time_", "rollout_tokens_per_s")) and v == v:
            np.testing.assert_allclose(got[1]["metrics"][k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    np.testing.assert_allclose(got[0]["sums"]["params"], got[1]["sums"]["params"], rtol=1e-6)
    # And it is the single-device step (test_sharding's tolerance).
    ref = _reference()
    for k, v in ref["metrics"].items():
        if not k.startswith(("time_", "rollout_tokens_per_s")) and v == v:
            np.testing.assert_allclose(got[0]["metrics"][k], v, rtol=1e-4, atol=1e-5, err_msg=k)
    for name in ("params", "lora"):
        np.testing.assert_allclose(
            got[0]["sums"][name], ref["sums"][name], rtol=1e-4, atol=1e-4, err_msg=name
        )


def _reference():
    """The single-device step in this (8-device, one-process) test process."""
    import jax
    import jax.numpy as jnp
    import test_sharding as ts

    from dsparse_jax.train import phases

    mp = pytest.MonkeyPatch()
    mp.setattr(phases, "grade", ts.fake_score)
    try:
        setup, st, m = ts._one_step(_ctx(ts))
    finally:
        mp.undo()
    assert setup.plan is None
    return {
        "metrics": m,
        "sums": {
            name: [float(jnp.sum(x)) for x in jax.tree.leaves(t)]
            for name, t in (("params", st.theta.params), ("lora", st.lora))
        },
    }


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], MESH)
