"""harness/objectives_results: elapsed time is the RL steps' and evaluations' own time in
file order; each mark reads the last evaluation at or before it; dynamic sampling's runs
report their drawn groups' informative fraction."""

import json

from dsparse_jax.harness import objectives_results as O


def _write(path, records):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_marks_read_the_last_evaluation_before_them(tmp_path):
    ev = lambda step, acc, t: {"phase": "eval", "step": step, "greedy_accuracy": acc,
                               "mean_at_4": acc / 2, "time": t}  # fmt: skip
    rl = lambda step, mixed, t: {"phase": "rl", "step": step, "groups_mixed": mixed,
                                 "time_step": t}  # fmt: skip
    _write(
        tmp_path / "plain",
        [
            ev(0, 0.5, 10),
            rl(1, 0.5, 20),
            {"phase": "sft", "step": 9},
            rl(2, 1.0, 20),
            ev(2, 0.75, 10),
            rl(3, 0.0, 50),
        ],  # fmt: skip
    )
    s = O.summarize(str(tmp_path / "plain"), [30, 60, 200])
    assert s["rl_steps"] == 3 and s["elapsed_s"] == 110
    assert s["at"]["30"]["step"] == 0 and s["at"]["30"]["greedy_accuracy"] == 0.5
    assert s["at"]["60"] == {
        "step": 2,
        "elapsed_s": 60,
        "greedy_accuracy": 0.75,
        "mean_at_k": 0.375,
    }
    assert s["at"]["200"]["step"] == 2
    assert s["informative_groups"] == 0.5 and "dynamic_draws" not in s

    _write(
        tmp_path / "dapo",
        [
            rl(1, 1.0, 5)
            | {"groups_mixed_drawn": 0.25, "dynamic_draws": 2, "dynamic_extra_tokens": 80}
        ],
    )
    d = O.summarize(str(tmp_path / "dapo"), [1])
    assert d["informative_groups"] == 0.25 and d["dynamic_draws"] == 2 and d["at"] == {}
    assert "`dapo`" in O.markdown([s, d], [30, 60, 200])
