"""The default RL task: a procedurally generated "variable chain" sum.

A problem defines `num_vars` variables (names: a letter then `name_digits`
digits, e.g. "k3"; single letters with the default 0 digits) with values 0..9,
then asks for a signed sum over `num_terms` distinct defined variables, modulo
`modulus`. Definitions and terms each come in their own random order and every
sign is random, the first one included. A definition is the name immediately
followed by its value digit ("k7": k = 7; "k37" with name_digits=1: k3 = 7).

    prompt:   "vars: k7 b2 q5 z4\nsum: -b +k +q\n"
    solution: "-b2 t=8\n+k7 t=5\n+q5 t=0\nanswer: 0"

Solution format: one line per term, in expression order, "<sign><name><value>
t=<running total>", the running total starting from 0 and reduced mod `modulus`
after each term (-2 mod 10 = 8 above), then "answer: <final total>" with no
newline after it. The prompt ends with "\n" right where the solution begins.
Each solution line needs three far-apart facts: which term comes next (the
expression line), that term's value (the definitions) and the previous total, so
attention has to reach back across the whole context. Writing the value right
after the name, in the definition and in the solution, makes the lookup a plain
induction-head copy (find the earlier occurrence of the name, copy the token
after it), which a tiny model learns in a few hundred SFT steps; with a
separator ("k=7") it needs a two-token match and was not learned in 900 steps.

Lengths in characters (= tokens with the char-level tokenizer), with
n = name_digits and d = number of digits of (modulus - 1):
    prompt   = 11 + (3 + n) * num_vars + (3 + n) * num_terms
    solution <= (7 + n + d) * num_terms + 8 + d   (exact if modulus <= 10,
                                                   min_terms None)
So 8 tokens per term with single-letter names (the main job's default, at most
26 terms), 9 with name_digits=1 (99 tokens at 10 terms, 2349 at 260, its most);
name_digits=2 allows 2600 terms, 10 tokens each.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from dsparse_jax.data.tokenizer import Tokenizer, train_tokenizer

NAME_LETTERS = string.ascii_lowercase
ANSWER_PREFIX = "answer: "
SPLITS = {"train": 0, "eval": 1}
# Every character any problem can contain (keywords only use lowercase letters).
ALPHABET = string.ascii_lowercase + string.digits + "+-=: \n"


@dataclasses.dataclass(frozen=True)
class ChainTaskConfig:
    """Shape of the variable-chain problems.

    num_vars: variables defined in the prompt (1..26 * 10**name_digits).
    num_terms: terms in the sum (1..num_vars); sets the solution length, 10
      tokens per term by default.
    modulus: running totals are reduced mod this (>= 2); values are 0..9.
    min_terms: if set, each problem draws its term count uniformly from
      [min_terms, num_terms]; None means always num_terms.
    name_digits: digits after the letter in a variable name (0..4; 0 = single
      letters, at most 26 variables: the easiest lookups, the CPU default).
    """

    num_vars: int = 24
    num_terms: int = 12
    modulus: int = 10
    min_terms: int | None = None
    name_digits: int = 1

    @property
    def max_vars(self) -> int:
        return len(NAME_LETTERS) * 10**self.name_digits

    def __post_init__(self):
        if not 0 <= self.name_digits <= 4:
            raise ValueError(f"name_digits must be in [0, 4], got {self.name_digits}")
        if not 1 <= self.num_vars <= self.max_vars:
            raise ValueError(
                f"num_vars must be in [1, {self.max_vars}] for "
                f"name_digits={self.name_digits}, got {self.num_vars}"
            )
        if not 1 <= self.num_terms <= self.num_vars:
            raise ValueError(
                f"num_terms must be in [1, num_vars={self.num_vars}], got {self.num_terms}"
            )
        if self.modulus < 2:
            raise ValueError(f"modulus must be >= 2, got {self.modulus}")
        if self.min_terms is not None and not 1 <= self.min_terms <= self.num_terms:
            raise ValueError(
                f"min_terms must be None or in [1, num_terms="
                f"{self.num_terms}], got {self.min_terms}"
            )


@dataclasses.dataclass(frozen=True)
class Problem:
    """prompt + solution is the full text; answer is the final total as a string."""

    prompt: str
    solution: str
    answer: str


def _rng(split: str, index: int, seed: int) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {tuple(SPLITS)}, got {split!r}")
    if index < 0 or seed < 0:
        raise ValueError(f"index and seed must be >= 0, got index={index} seed={seed}")
    return np.random.default_rng(np.random.SeedSequence([seed, SPLITS[split], index]))


def make_problem(cfg: ChainTaskConfig, split: str, index: int, seed: int) -> Problem:
    """Problem number `index` of `split`; a pure function of (cfg, seed, split, index).

    Each (seed, split, index) has its own SeedSequence stream, so train and eval
    problems are independent draws (identical ones only by astronomical chance).
    """
    rng = _rng(split, index, seed)
    num_terms = cfg.num_terms
    if cfg.min_terms is not None:
        num_terms = int(rng.integers(cfg.min_terms, cfg.num_terms + 1))
    base = 10**cfg.name_digits
    name_ids = rng.choice(cfg.max_vars, size=cfg.num_vars, replace=False)
    digits = (
        (lambda i: "") if cfg.name_digits == 0 else (lambda i: f"{i % base:0{cfg.name_digits}d}")
    )
    names = [f"{NAME_LETTERS[i // base]}{digits(i)}" for i in name_ids]
    values = rng.integers(0, 10, size=cfg.num_vars)
    term_idx = rng.choice(cfg.num_vars, size=num_terms, replace=False)
    signs = rng.integers(0, 2, size=num_terms)  # 0: '+', 1: '-'

    defs = " ".join(f"{n}{v}" for n, v in zip(names, values))
    terms = [("-" if s else "+") + names[i] for s, i in zip(signs, term_idx)]
    prompt = f"vars: {defs}\nsum: {' '.join(terms)}\n"

    total, lines = 0, []
    for s, i, term in zip(signs, term_idx, terms):
        value = int(values[i])
        total = (total - value if s else total + value) % cfg.modulus
        lines.append(f"{term}{value} t={total}")
    answer = str(total)
    solution = "\n".join(lines) + "\n" + ANSWER_PREFIX + answer
    return Problem(prompt=prompt, solution=solution, answer=answer)


def problems(cfg: ChainTaskConfig, split: str, start: int, count: int, seed: int) -> list[Problem]:
    """Problems start, start+1, ..., start+count-1 of `split`."""
    return [make_problem(cfg, split, i, seed) for i in range(start, start + count)]


def max_prompt_chars(cfg: ChainTaskConfig) -> int:
    """Exact upper bound on len(prompt) (exact length when min_terms is None)."""
    n = cfg.name_digits
    # " k37" per definition, " +k3" per term.
    return len("vars:\nsum:\n") + (3 + n) * cfg.num_vars + (3 + n) * cfg.num_terms


def max_solution_chars(cfg: ChainTaskConfig) -> int:
    """Upper bound on len(solution), reached when every total has the most digits."""
    d = len(str(cfg.modulus - 1))
    # Per term: sign, name, value digit, ' t=', total, '\n'.
    per_term = 1 + (1 + cfg.name_digits) + 1 + 3 + d + 1
    return cfg.num_terms * per_term + len(ANSWER_PREFIX) + d


def tokenizer_corpus(cfg: ChainTaskConfig, seed: int, n: int = 2000) -> list[str]:
    """`n` train problems (prompt + solution), plus ALPHABET so every char is seen."""
    texts = [p.prompt + p.solution for p in problems(cfg, "train", 0, n, seed)]
    return [ALPHABET] + texts


def build_tokenizer(cfg: ChainTaskConfig, seed: int, n: int = 200) -> Tokenizer:
    """Char-level tokenizer for the task: 46 ids, the same for every cfg and seed.

    Ids: pad 0, unk 1, bos 2, eos 3, then the ALPHABET characters other than space
    in order (4..44), then space as SentencePiece's '▁' (45). Pinning the characters
    as user symbols keeps ids stable, so a checkpoint stays valid when num_terms
    changes (curricula).
    """
    symbols = [c for c in ALPHABET if c != " "]  # space is always learned as '▁'
    return train_tokenizer(
        tokenizer_corpus(cfg, seed, n),
        vocab_size=len(ALPHABET) + 4,
        model_type="char",
        user_defined_symbols=symbols,
    )
