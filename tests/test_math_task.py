"""Variable-chain task: determinism, splits, correctness, lengths, tokens, rewards."""

import re

import numpy as np
import pytest

from dsparse_jax.data import math_task as mt
from dsparse_jax.data.rewards import batch_rewards, chain_reward, extract_answer

CFG = mt.ChainTaskConfig()


def solve(prompt: str, modulus: int) -> tuple[list[str], str]:
    """Independent solver: parses the prompt text, returns (solution lines, answer)."""
    m = re.fullmatch(r"vars: ((?:[a-z][0-9]*[0-9] ?)+)\nsum: ((?:[+-][a-z][0-9]* ?)+)\n", prompt)
    assert m, prompt
    values = {}
    for d in m.group(1).split(" "):
        name, v = d[:-1], d[-1]  # the value is the definition's last digit
        assert name not in values
        values[name] = int(v)
    total, lines = 0, []
    terms = m.group(2).split(" ")
    assert len(set(t[1:] for t in terms)) == len(terms)  # distinct variables
    for t in terms:
        sign = 1 if t[0] == "+" else -1
        total = (total + sign * values[t[1:]]) % modulus
        lines.append(f"{t}{values[t[1:]]} t={total}")
    return lines, str(total)


def test_deterministic():
    a = mt.problems(CFG, "train", 5, 10, seed=3)
    b = [mt.make_problem(CFG, "train", i, seed=3) for i in range(5, 15)]
    assert a == b
    assert mt.make_problem(CFG, "train", 5, seed=4) != a[0]
    assert len({p.prompt for p in a}) == len(a)


def test_splits_disjoint():
    train = {p.prompt for p in mt.problems(CFG, "train", 0, 500, seed=0)}
    evals = {p.prompt for p in mt.problems(CFG, "eval", 0, 500, seed=0)}
    assert len(train) == 500 and len(evals) == 500
    assert not train & evals
    with pytest.raises(ValueError, match="split"):
        mt.make_problem(CFG, "test", 0, seed=0)


@pytest.mark.parametrize(
    "cfg",
    [
        CFG,
        mt.ChainTaskConfig(num_vars=5, num_terms=5, modulus=7),
        mt.ChainTaskConfig(num_vars=260, num_terms=200, modulus=100),
        mt.ChainTaskConfig(num_vars=40, num_terms=30, min_terms=3, name_digits=2),
        mt.ChainTaskConfig(num_vars=26, num_terms=10, name_digits=0),
    ],
)
def test_solution_is_correct(cfg):
    for p in mt.problems(cfg, "eval", 0, 30, seed=1):
        lines, answer = solve(p.prompt, cfg.modulus)
        assert p.answer == answer
        assert p.solution == "\n".join(lines) + "\nanswer: " + answer
        assert len(p.prompt.split("\n")[0].split(" ")) == cfg.num_vars + 1
        assert len(p.prompt) <= mt.max_prompt_chars(cfg)
        assert len(p.solution) <= mt.max_solution_chars(cfg)
        assert chain_reward(p.solution, p.answer) == 1.0


def test_answers_are_spread():
    answers = [p.answer for p in mt.problems(CFG, "train", 0, 400, seed=0)]
    counts = np.bincount([int(a) for a in answers], minlength=10)
    assert counts.min() > 15  # roughly uniform over 0..9, no constant answer


def test_length_bounds_exact_and_linear():
    lens = {}
    for t in (10, 50, 100, 200):
        cfg = mt.ChainTaskConfig(num_vars=max(24, t), num_terms=t)
        p = mt.make_problem(cfg, "train", 0, seed=0)
        assert len(p.prompt) == mt.max_prompt_chars(cfg)
        assert len(p.solution) == mt.max_solution_chars(cfg) == 9 * t + 9
        lens[t] = len(p.solution)
    assert lens[200] - lens[100] == 2 * (lens[100] - lens[50]) == 900  # 9 tokens/term


def test_config_validation():
    for kwargs, field in [
        ({"num_vars": 0}, "num_vars"),
        ({"num_vars": 261}, "num_vars"),
        ({"num_terms": 25}, "num_terms"),
        ({"modulus": 1}, "modulus"),
        ({"min_terms": 13}, "min_terms"),
        ({"name_digits": 5}, "name_digits"),
    ]:
        with pytest.raises(ValueError, match=field):
            mt.ChainTaskConfig(**kwargs)
    mt.ChainTaskConfig(num_vars=2600, num_terms=2600, name_digits=2)  # allowed
    with pytest.raises(ValueError, match="num_vars"):
        mt.ChainTaskConfig(num_vars=27, num_terms=3, name_digits=0)


def test_tokenizer_covers_everything():
    tok = mt.build_tokenizer(CFG, seed=0)
    assert tok.vocab_size == 46
    for ch in mt.ALPHABET:
        assert tok.encode(ch) != [tok.unk_id], repr(ch)
    # The vocabulary does not depend on the config or seed.
    other = mt.build_tokenizer(mt.ChainTaskConfig(num_vars=60, num_terms=50, modulus=97), 9)
    assert other.to_bytes() == tok.to_bytes()
    cfgs = [
        CFG,
        mt.ChainTaskConfig(num_vars=260, num_terms=100, modulus=1000),
        mt.ChainTaskConfig(num_vars=50, num_terms=20, name_digits=3),
    ]
    for cfg in cfgs:
        for p in mt.problems(cfg, "eval", 0, 20, seed=2):
            text = p.prompt + p.solution
            ids = tok.encode(text)
            assert tok.unk_id not in ids
            assert len(ids) == len(text)
            assert tok.encode(p.prompt) + tok.encode(p.solution) == ids
            assert tok.decode(ids) == text


def test_rewards():
    assert extract_answer("+a13 t=3\nanswer: 3") == "3"
    assert chain_reward("+a13 t=3\nanswer: 3", "3") == 1.0
    assert chain_reward("answer: 3", "3", format_reward=0.1) == 1.0
    assert chain_reward("answer:3  \nmore text", "3") == 1.0  # text after the line ignored
    assert chain_reward("+a13 t=3\nanswer: 4", "3") == 0.0
    assert chain_reward("+a13 t=3\nanswer: 4", "3", format_reward=0.1) == pytest.approx(0.1)
    assert chain_reward("answer: 03", "3", format_reward=0.1) == pytest.approx(0.1)
    # Only the first answer line counts.
    assert chain_reward("answer: 4\nanswer: 3", "3") == 0.0
    assert extract_answer("answer: x\nanswer: 3") is None
    # Missing or malformed answers get nothing, even with a format reward.
    for bad in [
        "",
        "+a13 t=3",
        "answer:",
        "answer: ",
        "answer: 3 4",
        "answer: -3",
        "the answer: 3",
        " answer: 3",
        "Answer: 3",
        "answer: ３",
        "answer: 3.0",
        "answer: " + "9" * 40,
    ]:
        assert extract_answer(bad) is None, bad
        assert chain_reward(bad, "3", format_reward=0.5) == 0.0, bad


def test_rewards_never_raise():
    rng = np.random.default_rng(0)
    junk = [
        "\x00\n\ud800",
        "🙂" * 1000,
        "answer: \U0001f600",
        "\nanswer:\n\n",
        None,
        17,
        "answer: 7" + "\n" * 100_000,
        "x" * 1_000_000 + "\nanswer: 7",
    ]
    junk += ["".join(chr(c) for c in rng.integers(0, 0x10FFFF, 50)) for _ in range(50)]
    for s in junk:
        assert chain_reward(s, "7", format_reward=0.2) in (0.0, 0.2, 1.0)
    assert chain_reward(junk[6], "7") == 1.0 and chain_reward(junk[7], "7") == 1.0
    r = batch_rewards(["answer: 1", "answer: 2", "nope"], ["1", "1", "1"], 0.25)
    assert r.dtype == np.float32 and r.tolist() == [1.0, 0.25, 0.0]
    with pytest.raises(ValueError):
        batch_rewards(["answer: 1"], ["1", "2"])
