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

Switches for long chains (configs/mini_longchain.py uses letters=52, agg_every=4 and
order="names"):
  letters = 52: names from a-z then A-Z, 52 single-token names (the tokenizer gains A-Z).
  agg_every = A > 0: after every A-th term a vote line "vote=<v> t=<total>" (":=" with
    order="names"), where v = 1
    if strictly more '+' than '-' terms came so far, else 0, and v is added to the running
    total: a soft aggregate of every earlier sign, where a term line needs one exact
    lookup. Both feed the final answer.
  order = "names": no `sum:` line. The terms are all num_terms variables in name order
    (a, b, ..., z, A, ..., or a0, a1, ...), so the next term is the next name (a local
    step, not a search); each definition carries its sign ("k-7") and the definitions are
    shuffled, so a line's sign and value are one induction-head lookup into a random page
    of the prompt. Each problem draws its '-' rate, 0.3 or 0.7, so the vote is rarely a
    near tie. A term line is "<name><sign><value> :=<total>" (":=", not "t=": every
    letter is a name here, and t's lookup must not match the totals).
  repeat_terms (order="sum"): the terms are drawn with replacement, so num_terms is not
    bounded by num_vars; a name may then recur on the sum line and the next term can no
    longer be found by matching the previous one (much harder to learn).

    order="names", agg_every=2:
    prompt:   "vars: c+4 a-7 b+2\n"
    solution: "a-7 :=3\nb+2 :=5\nvote=0 :=5\nc+4 :=9\nanswer: 9"
A vote line is len("vote=") + 5 + d tokens (d digits of the total), so the solution has
(7 + n + d) * num_terms + (10 + d) * (num_terms // agg_every) + 8 + d tokens.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from dsparse_jax.data.task import Problem
from dsparse_jax.data.tokenizers.base import Tokenizer, train_tokenizer

NAME_LETTERS = string.ascii_lowercase + string.ascii_uppercase  # the first `letters` are used
ANSWER_PREFIX = "answer: "
VOTE_NAME = "vote"  # vote lines start with "vote=" (no term line does)
# A line's running total follows this marker, per order. With order="names" every letter
# is a variable name, so a "t=" marker would make the lookup of variable t ambiguous: an
# induction head matching " t" found ~20 "t=" totals besides the one definition (the
# miniature's SFT learned every lookup but t's; docs/miniature.md).
TOTAL_MARK = {"sum": "t=", "names": ":="}
SPLITS = {"train": 0, "eval": 1}
# Every character any problem can contain (keywords only use lowercase letters).
ALPHABET = string.ascii_lowercase + string.digits + "+-=: \n"
UPPER_ALPHABET = ALPHABET + string.ascii_uppercase  # tasks with letters = 52


@dataclasses.dataclass(frozen=True)
class ChainTaskConfig:
    """Shape of the variable-chain problems; the chain task (a data.task.Task).

    num_vars: variables defined in the prompt (1..26 * 10**name_digits).
    num_terms: terms in the sum (1..num_vars); sets the solution length, 10
      tokens per term by default.
    modulus: running totals are reduced mod this (>= 2); values are 0..9.
    min_terms: if set, each problem draws its term count uniformly from
      [min_terms, num_terms]; None means always num_terms.
    name_digits: digits after the letter in a variable name (0..4; 0 = single
      letters, at most 26 variables: the easiest lookups, the CPU default).
    letters: name letters, 26 (a-z, the default) or 52 (a-z then A-Z: 52 single-token
      names; the tokenizer then has the upper-case letters too).
    repeat_terms: draw the terms with replacement (num_terms may exceed num_vars; a
      name then occurs several times on the sum line, so the next term can no longer be
      found by matching the previous one: a harder task).
    agg_every: a vote line after every agg_every-th term (0: none; see the module doc).
    order: "sum" (the terms in the order of a `sum:` line) | "names" (every variable
      once, in name order, the signs on the definitions: see the module doc).
    train_size: 0 = an endless stream of training problems; N > 0 = a finite training
      set of N problems, train index i being problem i mod N (epochs; prompts recur).
    """

    num_vars: int = 24
    num_terms: int = 12
    modulus: int = 10
    min_terms: int | None = None
    name_digits: int = 1
    letters: int = 26
    repeat_terms: bool = False
    agg_every: int = 0
    order: str = "sum"
    train_size: int = 0

    @property
    def max_vars(self) -> int:
        return self.letters * 10**self.name_digits

    def problems(self, split: str, start: int, count: int, seed: int) -> list[Problem]:
        return problems(self, split, start, count, seed)

    def prompt_buffer(self) -> int:
        """BOS + the longest prompt (one token per character)."""
        return 1 + max_prompt_chars(self)

    def completion_budget(self) -> int:
        """The longest solution + EOS."""
        return max_solution_chars(self) + 1

    def describe(self) -> str:
        return f"{self.num_terms} terms"

    def with_terms(self, num_terms: int) -> ChainTaskConfig:
        """The task with num_terms terms (and as many variables with order="names")."""
        if self.order == "names":
            return dataclasses.replace(self, num_terms=num_terms, num_vars=num_terms)
        return dataclasses.replace(self, num_terms=num_terms)

    def __post_init__(self):
        if self.letters not in (26, 52):
            raise ValueError(f"letters must be 26 or 52, got {self.letters}")
        if not 0 <= self.name_digits <= 4:
            raise ValueError(f"name_digits must be in [0, 4], got {self.name_digits}")
        if not 1 <= self.num_vars <= self.max_vars:
            raise ValueError(
                f"num_vars must be in [1, {self.max_vars}] for "
                f"name_digits={self.name_digits}, got {self.num_vars}"
            )
        if self.num_terms < 1 or (not self.repeat_terms and self.num_terms > self.num_vars):
            raise ValueError(
                f"num_terms must be in [1, num_vars={self.num_vars}] (any positive count "
                f"with repeat_terms), got {self.num_terms}"
            )
        if self.agg_every < 0:
            raise ValueError(f"agg_every must be >= 0 (0: no vote lines), got {self.agg_every}")
        if self.order not in ("sum", "names"):
            raise ValueError(f"order must be 'sum' or 'names', got {self.order!r}")
        if self.order == "names" and (
            self.num_vars != self.num_terms or self.repeat_terms or self.min_terms is not None
        ):
            raise ValueError(
                "order='names' uses every variable once: num_vars must equal num_terms "
                f"({self.num_vars} != {self.num_terms}), without repeat_terms or min_terms"
            )
        if self.train_size < 0:
            raise ValueError(f"train_size must be >= 0 (0: endless), got {self.train_size}")
        if self.modulus < 2:
            raise ValueError(f"modulus must be >= 2, got {self.modulus}")
        if self.min_terms is not None and not 1 <= self.min_terms <= self.num_terms:
            raise ValueError(
                f"min_terms must be None or in [1, num_terms="
                f"{self.num_terms}], got {self.min_terms}"
            )


# The ChainTaskConfig fields a run config sets (config.task; modulus and min_terms keep
# their defaults in runs).
CONFIG_FIELDS = (
    "num_vars",
    "num_terms",
    "name_digits",
    "letters",
    "repeat_terms",
    "agg_every",
    "order",
    "train_size",
)


def from_config(task_section) -> ChainTaskConfig:
    """The task of a run config's `task` section (any mapping with CONFIG_FIELDS)."""
    return ChainTaskConfig(**{f: task_section[f] for f in CONFIG_FIELDS})


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
    if split == "train" and cfg.train_size:
        index %= cfg.train_size
    rng = _rng(split, index, seed)
    layout = _names_layout if cfg.order == "names" else _sum_layout
    prompt, terms = layout(cfg, rng)
    total, lines, lead = 0, [], 0  # lead: number of '+' terms minus '-' terms so far
    mark = TOTAL_MARK[cfg.order]
    for j, (head, minus, value) in enumerate(terms, start=1):
        total = (total - value if minus else total + value) % cfg.modulus
        lines.append(f"{head} {mark}{total}")
        lead += -1 if minus else 1
        if cfg.agg_every and j % cfg.agg_every == 0:
            vote = int(lead > 0)
            total = (total + vote) % cfg.modulus
            lines.append(f"{VOTE_NAME}={vote} {mark}{total}")
    answer = str(total)
    solution = "\n".join(lines) + "\n" + ANSWER_PREFIX + answer
    return Problem(prompt=prompt, solution=solution, answer=answer)


def _name(cfg: ChainTaskConfig, i: int) -> str:
    """Name number i: its letter, then its name_digits digits (a, b, ... or a0, a1, ...)."""
    base = 10**cfg.name_digits
    digits = f"{i % base:0{cfg.name_digits}d}" if cfg.name_digits else ""
    return NAME_LETTERS[i // base] + digits


def _sum_layout(cfg: ChainTaskConfig, rng):
    """order="sum": (prompt, [(line head, minus, value)]) of a `vars:` + `sum:` problem."""
    num_terms = cfg.num_terms
    if cfg.min_terms is not None:
        num_terms = int(rng.integers(cfg.min_terms, cfg.num_terms + 1))
    name_ids = rng.choice(cfg.max_vars, size=cfg.num_vars, replace=False)
    names = [_name(cfg, i) for i in name_ids]
    values = rng.integers(0, 10, size=cfg.num_vars)
    term_idx = rng.choice(cfg.num_vars, size=num_terms, replace=cfg.repeat_terms)
    signs = rng.integers(0, 2, size=num_terms)  # 0: '+', 1: '-'
    defs = " ".join(f"{n}{v}" for n, v in zip(names, values))
    terms = [("-" if s else "+") + names[i] for s, i in zip(signs, term_idx)]
    prompt = f"vars: {defs}\nsum: {' '.join(terms)}\n"
    return prompt, [
        (f"{t}{values[i]}", bool(s), int(values[i])) for t, s, i in zip(terms, signs, term_idx)
    ]


def _names_layout(cfg: ChainTaskConfig, rng):
    """order="names": the first num_terms names in name order, each with a sign and a
    value, defined in a shuffled `vars:` line ("k-7"); a problem's '-' rate is 0.3 or 0.7."""
    n = cfg.num_terms
    values = rng.integers(0, 10, size=n)
    minus = rng.random(n) < rng.choice([0.3, 0.7])
    heads = [
        f"{_name(cfg, i)}{'-' if m else '+'}{v}" for i, (m, v) in enumerate(zip(minus, values))
    ]
    prompt = f"vars: {' '.join(heads[i] for i in rng.permutation(n))}\n"
    return prompt, [(h, bool(m), int(v)) for h, m, v in zip(heads, minus, values)]


def problems(cfg: ChainTaskConfig, split: str, start: int, count: int, seed: int) -> list[Problem]:
    """Problems start, start+1, ..., start+count-1 of `split`."""
    return [make_problem(cfg, split, i, seed) for i in range(start, start + count)]


def max_prompt_chars(cfg: ChainTaskConfig) -> int:
    """Exact upper bound on len(prompt) (exact length when min_terms is None)."""
    n = cfg.name_digits
    if cfg.order == "names":  # "vars:" and " k-7" per variable, "\n"
        return len("vars:\n") + (4 + n) * cfg.num_terms
    # " k37" per definition, " +k3" per term.
    return len("vars:\nsum:\n") + (3 + n) * cfg.num_vars + (3 + n) * cfg.num_terms


def max_solution_chars(cfg: ChainTaskConfig) -> int:
    """Upper bound on len(solution), reached when every total has the most digits."""
    d = len(str(cfg.modulus - 1))
    # Per term: sign, name, value digit, ' t=', total, '\n'; per vote: 'vote=', vote digit,
    # ' t=', total, '\n'.
    per_term = 1 + (1 + cfg.name_digits) + 1 + 3 + d + 1
    per_vote = len(VOTE_NAME) + 1 + 1 + 3 + d + 1
    votes = cfg.num_terms // cfg.agg_every if cfg.agg_every else 0
    return cfg.num_terms * per_term + votes * per_vote + len(ANSWER_PREFIX) + d


def alphabet(cfg: ChainTaskConfig) -> str:
    """Every character a problem of cfg can contain."""
    return ALPHABET if cfg.letters == 26 else UPPER_ALPHABET


def tokenizer_corpus(cfg: ChainTaskConfig, seed: int, n: int = 2000) -> list[str]:
    """`n` train problems (prompt + solution), plus the alphabet so every char is seen."""
    texts = [p.prompt + p.solution for p in problems(cfg, "train", 0, n, seed)]
    return [alphabet(cfg)] + texts


def build_tokenizer(cfg: ChainTaskConfig, seed: int, n: int = 200) -> Tokenizer:
    """Char-level tokenizer for the task: 46 ids, the same for every cfg and seed with 26
    letters (72 with letters = 52).

    Ids: pad 0, unk 1, bos 2, eos 3, then the alphabet's characters other than space
    in order (4..44: ALPHABET; then A-Z with 52 letters), then space as SentencePiece's
    '▁' (last). Pinning the characters as user symbols keeps ids stable, so a checkpoint
    stays valid when num_terms changes (curricula).
    """
    chars = alphabet(cfg)
    symbols = [c for c in chars if c != " "]  # space is always learned as '▁'
    return train_tokenizer(
        tokenizer_corpus(cfg, seed, n),
        vocab_size=len(chars) + 4,
        model_type="char",
        user_defined_symbols=symbols,
    )
