"""The graders against a labelled table of 112 MATH and GSM8K completions
(tests/data/graded_answers.jsonl: completion, reference, label = whether the completion's
final answer is right). False positives (a wrong answer rewarded) are counted apart from
false negatives (a right answer missed). The default real-data grader (reward.grader=auto
-> math) was chosen by this measurement: it must reward no wrong answer and agree with
the labels at least as often as every other grader."""

import importlib.util
import json
import os

import pytest

from dsparse_jax.data.rewards import graders

TABLE = os.path.join(os.path.dirname(__file__), "data", "graded_answers.jsonl")
DEFAULT = "math"  # what reward.grader=auto uses on real data


def _rows():
    with open(TABLE) as f:
        return [json.loads(line) for line in f]


def confusion(grader: str) -> dict:
    """{"agree", "false_positives", "false_negatives"} of `grader` on the table (the notes of
    the rows it got wrong)."""
    fp, fn = [], []
    for r in _rows():
        got = graders.reward(r["completion"], r["reference"], grader) >= 1.0
        if got and not r["label"]:
            fp.append(r["note"])
        elif not got and r["label"]:
            fn.append(r["note"])
    return {"agree": len(_rows()) - len(fp) - len(fn), "false_positives": fp, "false_negatives": fn}


def test_the_table_is_large_and_mixed():
    rows = _rows()
    assert len(rows) >= 100
    assert {r["source"] for r in rows} == {"math", "gsm8k"}
    assert 0.3 < sum(r["label"] for r in rows) / len(rows) < 0.8  # both kinds of rows


def test_the_default_grader_never_rewards_a_wrong_answer():
    c = confusion(DEFAULT)
    print(json.dumps({DEFAULT: c}))
    assert c["false_positives"] == []
    assert len(c["false_negatives"]) <= 2  # the two completions with no answer form


@pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="math-verify not installed"
)
def test_the_default_is_the_best_grader_measured():
    results = {g: confusion(g) for g in ("math", "math_verify", "math_verify_extracted")}
    print(
        json.dumps(
            {
                g: {k: v if k == "agree" else len(v) for k, v in c.items()}
                for g, c in results.items()
            }
        )
    )
    best = max(c["agree"] for c in results.values() if not c["false_positives"])
    assert results[DEFAULT]["agree"] == best and not results[DEFAULT]["false_positives"]
