"""Pluggable rewards (config reward.*): verl and tunix signatures, weights, and the failure
paths: a reward that raises, returns a non-number, hangs; too many errors in one step."""

import textwrap
import time

import numpy as np
import pytest

from dsparse_jax.config import schema
from dsparse_jax.config.validate import ConfigError, validate
from dsparse_jax.data.rewards import graders, rewarder, user
from dsparse_jax.data.task import Problem
from dsparse_jax.errors import UserError

REWARDS_PY = textwrap.dedent(
    """
    import signal
    import time


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0 if solution_str.strip().endswith(ground_truth) else 0.0


    def length_bonus(prompts, completions, **kwargs):
        assert kwargs["answer"] == kwargs["ground_truth"]
        return [min(len(c), 10) / 10 for c in completions]


    def raises_on_boom(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise ZeroDivisionError("boom row")
        return {"score": 0.5}


    def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
        return "yes" if "boom" in solution_str else 1


    def batch_raises_on_boom(prompts, completions, **kwargs):
        return [1 / 0 if "boom" in c else 1.0 for c in completions]


    def hangs_on_boom(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            time.sleep(1000)
        return 1.0


    def hangs_ignoring_alarm(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            time.sleep(1000)
        return 1.0


    def one_value_for_all(prompts, completions, **kwargs):
        return [1.0]


    def sees_extra_info(data_source, solution_str, ground_truth, extra_info=None):
        return float(data_source == "openai/gsm8k" and extra_info["index"] == 7)


    def wrong_signature(text):
        return 0.0
    """
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return str(path)


def _problems(n, answer="5"):
    return [Problem(prompt=f"q{i}", solution="", answer=answer) for i in range(n)]


def _rewarder(ref, **kw):
    return rewarder.Rewarder(fn=ref, **kw)


def test_split_ref():
    assert user.split_ref("r.py") == ("r.py", "compute_score", True)
    assert user.split_ref("a/b/r.py:fn") == ("a/b/r.py", "fn", True)
    assert user.split_ref("pkg.mod:fn") == ("pkg.mod", "fn", False)
    assert user.split_ref("pkg.mod.fn") == ("pkg.mod", "fn", False)
    with pytest.raises(UserError, match="config.reward.fn"):
        user.split_ref("nomodule")


def test_signature_detection():
    def verl(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0

    def tunix(prompts, completions, **kwargs):
        return []

    def neither(prompts, completions):
        return []

    assert user.signature_kind(verl) == user.VERL
    assert user.signature_kind(tunix) == user.BATCH
    with pytest.raises(UserError, match="expected verl's compute_score"):
        user.signature_kind(neither, "x.py:neither")


def test_verl_and_tunix_rewards_combined_with_weights(reward_file):
    r = _rewarder(f"{reward_file},{reward_file}:length_bonus,builtin", weights="1,0.5,2")
    try:
        texts = ["so 5", "so 4", "answer: 5"]
        out = r.score(_problems(3), texts)
    finally:
        r.close()
    verl = np.array([1.0, 0.0, 1.0])
    bonus = np.array([0.4, 0.4, 0.9])
    builtin = np.array([0.0, 0.0, 1.0])
    np.testing.assert_allclose(out.rewards, verl + 0.5 * bonus + 2 * builtin, rtol=1e-6)
    assert out.metrics["reward_errors"] == 0 and not out.errors.any()
    assert set(out.metrics) >= {"reward_compute_score", "reward_length_bonus", "reward_builtin"}


def test_module_spec_and_row_fields(reward_file, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    r = _rewarder("my_rewards:sees_extra_info")
    p = Problem("q", "", "5", grader="math", data_source="openai/gsm8k", extra_info={"index": 7})
    try:
        assert r.score([p, _problems(1)[0]], ["a", "b"]).rewards.tolist() == [1.0, 0.0]
    finally:
        r.close()


@pytest.mark.parametrize(
    "name, message",
    [
        ("raises_on_boom", "ZeroDivisionError: boom row"),
        ("not_a_number", "returned 'yes'"),
        ("batch_raises_on_boom", "ZeroDivisionError"),
    ],
)
def test_a_failing_row_scores_zero_is_counted_and_logged_once(reward_file, capsys, name, message):
    r = _rewarder(f"{reward_file}:{name}", max_error_fraction=0.5)
    try:
        texts = ["fine", "boom", "fine", "fine"]
        out = r.score(_problems(4), texts)
        again = r.score(_problems(4), texts)
    finally:
        r.close()
    ok = 0.5 if name == "raises_on_boom" else 1.0
    np.testing.assert_allclose(out.rewards, [ok, 0.0, ok, ok])
    assert out.errors.tolist() == [False, True, False, False]
    assert out.metrics["reward_errors"] == again.metrics["reward_errors"] == 1
    err = capsys.readouterr().err
    assert err.count("[reward] WARNING") == 1 and message in err  # once, with its traceback
    if name != "not_a_number":
        assert "Traceback" in err


def test_a_hanging_reward_is_cut_off(reward_file):
    r = _rewarder(f"{reward_file}:hangs_on_boom", timeout_s=0.5, max_error_fraction=0.5)
    try:
        t = time.time()
        out = r.score(_problems(3), ["ok", "boom", "ok"])
        assert time.time() - t < 5
    finally:
        r.close()
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.metrics["reward_errors"] == 1


def test_a_hang_that_ignores_the_alarm_kills_the_worker(reward_file, monkeypatch):
    monkeypatch.setattr(user, "_GRACE_S", 0.5)
    r = _rewarder(f"{reward_file}:hangs_ignoring_alarm", timeout_s=0.3, max_error_fraction=0.5)
    try:
        out = r.score(_problems(3), ["ok", "boom", "ok"])  # the worker restarts for row 2
        assert out.rewards.tolist() == [1.0, 0.0, 1.0]
        assert r.score(_problems(1), ["ok"]).rewards.tolist() == [1.0]
    finally:
        r.close()


def test_too_many_errors_stop_with_a_clear_message(reward_file):
    r = _rewarder(f"{reward_file}:raises_on_boom", max_error_fraction=0.25, error_min_rows=4)
    try:
        with pytest.raises(rewarder.RewardErrors) as e:
            r.score(_problems(4), ["boom", "boom", "ok", "ok"], where="RL step 3")
    finally:
        r.close()
    msg = str(e.value)
    assert "2 of the last 4 rows failed (at RL step 3)" in msg
    assert "config.reward.max_error_fraction=0.25" in msg and "ZeroDivisionError" in msg


def _batches(rate_every: int, batches: int, rows: int = 8):
    """Completions of `batches` batches where every rate_every-th row (over the run) is a
    'boom' row: a failure rate of 1 / rate_every."""
    out, i = [], 0
    for _ in range(batches):
        out.append(["boom" if (i + j) % rate_every == 0 else "ok" for j in range(rows)])
        i += rows
    return out


def test_a_rare_failure_survives_and_is_counted(reward_file):
    """6% of rows fail (1 in 16): an 8-row batch with a failure is 12%, above the 10%
    max_error_fraction, yet the run survives, since the rate is over the recent rows; every
    failure is in reward_errors."""
    r = _rewarder(f"{reward_file}:raises_on_boom")
    try:
        counts = [
            r.score(_problems(8), texts).metrics["reward_errors"] for texts in _batches(16, 40)
        ]
    finally:
        r.close()
    assert sum(counts) == 40 * 8 // 16 and max(counts) == 1


def test_a_frequent_failure_stops_once_enough_rows_are_scored(reward_file):
    """Half the rows fail: the run stops at the batch that brings the scored rows to
    reward.error_min_rows (64 = 8 batches of 8), not before."""
    r = _rewarder(f"{reward_file}:raises_on_boom")
    done = 0
    try:
        with pytest.raises(rewarder.RewardErrors, match="32 of the last 64 rows failed"):
            for texts in _batches(2, 20):
                r.score(_problems(8), texts)
                done += 1
    finally:
        r.close()
    assert done == 7


def test_a_batch_reward_with_the_wrong_count_stops_naming_it(reward_file):
    r = _rewarder(f"{reward_file}:one_value_for_all")
    try:
        with pytest.raises(UserError, match="one_value_for_all returned 1 values for 4 rows"):
            r.score(_problems(4), ["a", "b", "c", "d"])
    finally:
        r.close()


def test_bad_reward_specs_are_user_errors(reward_file, tmp_path):
    with pytest.raises(UserError, match="config.reward.fn: no such file"):
        _rewarder(str(tmp_path / "missing.py"))
    with pytest.raises(UserError, match="has no function 'nope'"):
        _rewarder(f"{reward_file}:nope")
    with pytest.raises(UserError, match="expected verl's compute_score"):
        _rewarder(f"{reward_file}:wrong_signature")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserError, match="cannot import .*ModuleNotFoundError"):
        _rewarder(str(tmp_path / "broken.py"))
    with pytest.raises(UserError, match="config.reward.weights"):
        _rewarder(reward_file, weights="1,2")


def test_reward_config_validation(reward_file, tmp_path):
    def check(**fields):
        c = schema.defaults()
        for k, v in fields.items():
            c.reward[k] = v
        validate(c)

    check(fn=f"{reward_file}:length_bonus,builtin", weights="0.5,1")
    for fields, match in [
        ({"fn": str(tmp_path / "missing.py")}, "config.reward.fn: no such file"),
        ({"fn": "nomodule"}, "config.reward.fn"),
        ({"fn": reward_file, "weights": "1,2"}, "config.reward.weights"),
        ({"grader": "sympy"}, "config.reward.grader"),
        ({"timeout_s": 0.0}, "config.reward.timeout_s"),
        ({"max_error_fraction": 1.5}, "config.reward.max_error_fraction"),
        ({"error_window": 0}, "config.reward.error_window"),
        ({"error_min_rows": 600}, "config.reward.error_min_rows"),
    ]:
        with pytest.raises(ConfigError, match=match):
            check(**fields)


# (reference, completion, in-house grade, math_verify grade)
GRADER_TABLE = [
    ("72", "so the answer is \\boxed{72}", 1, 1),
    ("72", "#### 72", 1, 1),
    ("72", "The answer is 72.", 1, 1),
    ("\\frac{5}{6}", "\\boxed{5/6}", 1, 1),
    ("0.5", "\\boxed{\\frac12}", 1, 1),
    ("1,000", "\\boxed{1000}", 1, 1),
    ("(1,2)", "\\boxed{(1, 2)}", 1, 1),
    ("2", "x = \\boxed{3}", 0, 0),
    ("72", "no answer here", 0, 0),
    ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1, 1),
    # math_verify falls back to the last number; the in-house grader asks for \\boxed{},
    # #### or "the answer is".
    ("72", "I think 72", 0, 1),
]


def test_math_verify_against_the_in_house_grader():
    pytest.importorskip("math_verify", reason="math-verify not installed")
    for ref, completion, ours, theirs in GRADER_TABLE:
        assert graders.reward(completion, ref, "math") == ours, (ref, completion)
        assert graders.reward(completion, ref, "math_verify") == theirs, (ref, completion)
    r = rewarder.Rewarder(grader="math_verify")
    probs = [Problem("q", "", ref, grader="math") for ref, *_ in GRADER_TABLE]
    got = r.score(probs, [c for _, c, *_ in GRADER_TABLE]).rewards
    assert got.tolist() == [float(t) for *_, t in GRADER_TABLE]
