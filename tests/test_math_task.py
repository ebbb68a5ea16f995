"""Variable-chain task: determinism, splits, correctness, lengths, tokens, rewards."""

import dataclasses
import re

import numpy as np
import pytest

from dsparse_jax.data import math_task as mt
from dsparse_jax.data.rewards.graders import batch_rewards, chain_reward, extract_answer

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


LONG = mt.ChainTaskConfig(num_vars=26, num_terms=56, name_digits=0, repeat_terms=True, agg_every=8)


def solve_long(prompt: str, cfg: mt.ChainTaskConfig) -> tuple[list[str], str]:
    """Independent solver of the long-chain variant: repeated terms, a vote line after
    every agg_every-th term (1 if more '+' than '-' so far, added to the total)."""
    defs, terms = prompt.split("\n")[0][6:].split(" "), prompt.split("\n")[1][5:].split(" ")
    values = {d[:-1]: int(d[-1]) for d in defs}
    total, plus, minus, lines = 0, 0, 0, []
    for j, t in enumerate(terms, start=1):
        v = values[t[1:]]
        total = (total + (v if t[0] == "+" else -v)) % cfg.modulus
        plus, minus = plus + (t[0] == "+"), minus + (t[0] == "-")
        lines.append(f"{t}{v} t={total}")
        if j % cfg.agg_every == 0:
            total = (total + (plus > minus)) % cfg.modulus
            lines.append(f"vote={int(plus > minus)} t={total}")
    return lines, str(total)


def test_long_chain_variant():
    """Repeated terms and vote lines: the solutions match an independent solver, the
    length bound is exact (56 terms: 534 tokens), terms repeat, both votes occur."""
    repeats, votes = 0, set()
    for p in mt.problems(LONG, "eval", 0, 30, seed=1):
        lines, answer = solve_long(p.prompt, LONG)
        assert p.solution == "\n".join(lines) + "\nanswer: " + answer and p.answer == answer
        assert len(p.prompt) == mt.max_prompt_chars(LONG)
        assert len(p.solution) == mt.max_solution_chars(LONG) == 534
        terms = p.prompt.split("\n")[1].split(" ")[1:]
        repeats += len(terms) - len({t[1:] for t in terms})
        votes |= {line[5] for line in lines if line.startswith("vote=")}
        assert chain_reward(p.solution, p.answer) == 1.0
    assert repeats > 0 and votes == {"0", "1"}
    # The length knob: 200 terms is a 2k-token completion.
    assert mt.max_solution_chars(dataclasses.replace(LONG, num_terms=200)) >= 1800
    with pytest.raises(ValueError, match="num_terms"):
        mt.ChainTaskConfig(num_vars=6, num_terms=7)  # without repeat_terms
    with pytest.raises(ValueError, match="agg_every"):
        mt.ChainTaskConfig(agg_every=-1)


def test_finite_training_set_repeats_in_epochs():
    cfg = dataclasses.replace(LONG, train_size=5)
    a = mt.problems(cfg, "train", 0, 5, seed=0)
    assert mt.problems(cfg, "train", 5, 5, seed=0) == a  # epoch 2 = epoch 1
    assert a == mt.problems(LONG, "train", 0, 5, seed=0)  # the first N of the stream
    assert mt.problems(cfg, "eval", 5, 5, seed=0) == mt.problems(LONG, "eval", 5, 5, seed=0)
    with pytest.raises(ValueError, match="train_size"):
        mt.ChainTaskConfig(train_size=-1)


def solve_names(prompt: str, cfg: mt.ChainTaskConfig) -> tuple[list[str], str]:
    """Independent solver of order="names": every variable once, in name order."""
    defs = {d[:-2]: (d[-2], int(d[-1])) for d in prompt[len("vars: ") : -1].split(" ")}
    order = sorted(defs, key=lambda n: (mt.NAME_LETTERS.index(n[0]), n[1:]))
    total, lead, lines = 0, 0, []
    for j, name in enumerate(order, start=1):
        sign, v = defs[name]
        total = (total + (v if sign == "+" else -v)) % cfg.modulus
        lead += 1 if sign == "+" else -1
        lines.append(f"{name}{sign}{v} :={total}")
        if cfg.agg_every and j % cfg.agg_every == 0:
            total = (total + (lead > 0)) % cfg.modulus
            lines.append(f"vote={int(lead > 0)} :={total}")
    return lines, str(total)


def test_names_order_with_upper_case_names():
    """order="names", letters=52 (the miniature's task): the solutions match an independent
    solver, the definitions are shuffled (not in name order), the lengths are exact
    (214-token prompts, 568-token solutions), both votes occur; the tokenizer adds A-Z
    after the 26-letter ids."""
    cfg = mt.ChainTaskConfig(
        num_vars=52, num_terms=52, name_digits=0, letters=52, agg_every=4, order="names"
    )
    tok = mt.build_tokenizer(cfg, seed=0)
    base = mt.build_tokenizer(mt.ChainTaskConfig(), seed=0)
    assert tok.vocab_size == 72 and base.vocab_size == 46
    assert [tok.id_to_piece(i) for i in range(45)] == [base.id_to_piece(i) for i in range(45)]
    votes, minus_rates = set(), []
    for p in mt.problems(cfg, "eval", 0, 20, seed=0):
        lines, answer = solve_names(p.prompt, cfg)
        assert p.solution == "\n".join(lines) + "\nanswer: " + answer and p.answer == answer
        assert len(tok.encode(p.prompt + p.solution)) == len(p.prompt + p.solution)
        assert len(p.prompt) == mt.max_prompt_chars(cfg) == 214
        assert len(p.solution) == mt.max_solution_chars(cfg) == 568
        names = [d[:-2] for d in p.prompt[6:-1].split(" ")]
        assert sorted(names) == sorted(mt.NAME_LETTERS) and names != list(mt.NAME_LETTERS)
        votes |= {line[5] for line in lines if line.startswith("vote=")}
        minus_rates.append(p.prompt.count("-") / 52)
    assert votes == {"0", "1"}
    assert min(minus_rates) < 0.45 and max(minus_rates) > 0.55  # 0.3 or 0.7 per problem
    # The length knob: two-token names, 200 terms is a 2.4k-token completion.
    long = dataclasses.replace(cfg, num_vars=200, num_terms=200, name_digits=1)
    lines, answer = solve_names(mt.make_problem(long, "train", 0, 0).prompt, long)
    assert len("\n".join(lines)) + 10 == mt.max_solution_chars(long) >= 2048
    for kw, field in [
        ({"letters": 30}, "letters"),
        ({"order": "alpha"}, "order"),
        ({"order": "names", "num_vars": 5, "num_terms": 4}, "order"),
    ]:
        with pytest.raises(ValueError, match=field):
            mt.ChainTaskConfig(**kw)
