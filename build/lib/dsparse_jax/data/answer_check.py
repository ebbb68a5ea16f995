"""Grading math answers the way GSM8K / MATH evaluations do. Never raises on any string.

    extract_answer(completion)  last \\boxed{...} (nested braces), else "#### N", else
                                "the answer is X" (optionally: the last number)
    reference_answer(raw)       a dataset's answer field: "#### N" (GSM8K), \\boxed (MATH
                                solutions) or the plain answer
    is_equivalent(pred, ref)    normalized string match, numeric equivalence (integers,
                                decimals, fractions, repeating decimals, thousands
                                separators, $ / % / unit words stripped), element-wise in
                                order for tuples, intervals and matrices, as sets for
                                solution lists (comma lists, "or" / "and" lists, a \\pm b),
                                then symbolic equivalence with sympy (logarithms to any
                                base, e, pi)
    grade(completion, ref)      extract + is_equivalent

The symbolic check runs in a separate worker process (python -m
dsparse_jax.data.answer_check) with a per-comparison timeout (default 3 s): a
pathological expression (e.g. 9^{9^{9^9}}) is killed with its worker and graded wrong,
and the worker restarts on the next call. Only a whitelisted character set and a fixed
set of function names reach sympy's parser.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import subprocess
import sys
import threading
import warnings
from fractions import Fraction

SYMBOLIC_TIMEOUT_S = 3.0
_MAX_LEN = 400  # longer answers are compared as strings only

# ------------------------------------------------------------------------- extraction


def _balanced(text: str, start: int) -> str | None:
    """Contents of the brace group opening at text[start] == '{', or None if unclosed."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            continue
        if c == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif c == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """{index of '{': index of its matching '}'} in one pass (escaped braces skipped)."""
    out, stack = {}, []
    for i, c in enumerate(text):
        if c in "{}" and i > 0 and text[i - 1] == "\\":
            continue
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            out[stack.pop()] = i
    return out


def extract_boxed(text: str) -> str | None:
    """Contents of the last complete \\boxed{...} / \\fbox{...} (or `\\boxed 5`)."""
    if not isinstance(text, str):
        return None
    closing = None
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)", text))):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            closing = _closing_braces(text) if closing is None else closing
            if j in closing:
                return text[j + 1 : closing[j]].strip()
        elif j > m.end():  # "\boxed 5"
            tok = re.match(r"[^\s$]+", text[j:])
            if tok:
                return tok.group(0)
    return None


_GSM = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*([^\n]+)", re.I)
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_gsm8k(text: str) -> str | None:
    """What follows the last '####' on its line (GSM8K reference format)."""
    if not isinstance(text, str):
        return None
    found = _GSM.findall(text)
    return found[-1].strip() if found and found[-1].strip() else None


def extract_answer(completion: str, fallback_last_number: bool = False) -> str | None:
    """The model's final answer, or None when it gave none in a recognised form."""
    try:
        if not isinstance(completion, str):
            return None
        for get in (extract_boxed, extract_gsm8k):
            got = get(completion)
            if got:
                return got
        found = _ANSWER_IS.findall(completion)
        if found:
            ans = found[-1].strip()
            ans = re.sub(r"\.\s*$", "", ans).strip().strip("$").strip()
            if ans:
                return ans
        if fallback_last_number:
            nums = _LAST_NUMBER.findall(completion)
            if nums:
                return nums[-1]
    except Exception:  # noqa: BLE001 -- never raise on arbitrary text
        return None
    return None


def reference_answer(raw) -> str:
    """A dataset answer field as the answer string: after '####', inside \\boxed, or as is."""
    if raw is None:
        return ""
    text = str(raw)
    return extract_gsm8k(text) or extract_boxed(text) or text.strip()


# ---------------------------------------------------------------------- normalization
_UNIT_WORDS = r"(?:\s+[a-zA-Z]{2,}\.?)+"
_MATH_WORDS = {"pi", "sqrt", "sin", "cos", "tan", "log", "ln", "exp", "infty", "oo"}
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm|operatorname)\s*\{([^{}]*)\}")


def normalize(s: str) -> str:
    """Canonical string form of a final answer (MATH-style normalization)."""
    s = str(s).strip()
    s = s.replace("\n", " ").replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = s.replace("\\:", "").replace("\\ ", " ").replace("~", " ")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("°", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"^\\displaystyle", "", s)
    # \text{...}: a trailing unit is dropped, otherwise the words are kept.
    m = re.fullmatch(r"(.*?[\d}])\s*\\(?:text|mbox)\s*\{\s*[a-zA-Z ]+\s*\}\s*", s)
    if m:
        s = m.group(1)
    s = _TEXT_CMD.sub(r"\1", s)
    s = s.strip().rstrip(".").strip()
    # "x = 5" -> "5" (one variable on the left)
    m = re.fullmatch(r"[a-zA-Z](?:_\{?\w+\}?)?\s*=\s*(.+)", s)
    if m:
        s = m.group(1).strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s.replace(" ", "")):
        s = s.replace(",", "").replace(" ", "")
    return s


def _frac_arg(s: str, i: int) -> tuple[str | None, int]:
    """One \\frac argument starting at s[i]: a brace group or a single character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None, i
    if s[i] == "{":
        inner = _balanced(s, i)
        return (None, i) if inner is None else (inner, i + len(inner) + 2)
    return s[i], i + 1


_REPEATING = re.compile(r"(\d*)\.(\d*)\\overline\{?(\d+)\}?")


def parse_number(s: str) -> Fraction | None:
    """Exact value of a numeric answer: 12, -3.5, 1,234, 3/4, \\frac{3}{4}, 18 dollars."""
    try:
        if len(s) > _MAX_LEN:
            return None
        t = normalize(s).replace(" ", "") if not re.search(r"[a-zA-Z]{2,}\.?$", s) else None
        if t is None:  # trailing unit words: "18 dollars", "5 cm."
            m = re.fullmatch(r"\s*\\?\$?\s*([-+]?[\d,]*\.?\d+)(" + _UNIT_WORDS + r")\s*", s)
            if not m or set(re.findall(r"[a-zA-Z]+", m.group(2))) & _MATH_WORDS:
                return None
            t = normalize(m.group(1))
        neg = t.startswith("-")
        body = t[1:] if t[:1] in "+-" else t
        m = _REPEATING.fullmatch(body)
        if m:  # 0.1\overline{36} = 0.1363636...
            whole, fixed, cycle = m.group(1) or "0", m.group(2), m.group(3)
            val = Fraction(whole) + Fraction(int(fixed or "0"), 10 ** len(fixed))
            val += Fraction(int(cycle), 10 ** len(fixed) * (10 ** len(cycle) - 1))
            return -val if neg else val
        if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", body):
            body = body.replace(",", "")
        if re.fullmatch(r"\d+(\.\d*)?|\.\d+", body):
            val = Fraction(body)
        elif re.fullmatch(r"\d+(\.\d+)?/\d+(\.\d+)?", body):
            num, den = body.split("/")
            val = Fraction(num) / Fraction(den)
        elif body.startswith("\\frac"):
            num, j = _frac_arg(body, 5)
            den, j = _frac_arg(body, j)
            if num is None or den is None or j != len(body):
                return None
            a, b = parse_number(num), parse_number(den)
            if a is None or b is None or b == 0:
                return None
            val = a / b
        else:
            return None
        return -val if neg else val
    except (ValueError, ZeroDivisionError, ArithmeticError, TypeError, RecursionError):
        return None


def _split_top(s: str) -> list[str]:
    """Split on commas at bracket depth 0."""
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def _bracketed(s: str):
    """(open, inner, close) if s is one (...)/[...] group (tuples, intervals), else None."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        depth = 0
        for i, c in enumerate(s):
            depth += c in "(["
            depth -= c in ")]"
            if depth == 0 and i < len(s) - 1:
                return None
        return s[0], s[1:-1], s[-1]
    return None


# ---------------------------------------------------------------------- equivalence


def is_equivalent(pred, ref, timeout: float = SYMBOLIC_TIMEOUT_S, symbolic: bool = True) -> bool:
    """Whether answer `pred` equals reference `ref`. False on anything unparseable."""
    try:
        if pred is None or ref is None:
            return False
        pred, ref = str(pred), str(ref)
        if len(pred) > _MAX_LEN or len(ref) > _MAX_LEN:  # no regex / sympy work on huge text
            return pred.strip() == ref.strip()
        return _equivalent(pred, ref, timeout, symbolic, depth=0)
    except Exception:  # noqa: BLE001 -- never raise on arbitrary text
        return False


def _equivalent(pred: str, ref: str, timeout: float, symbolic: bool, depth: int) -> bool:
    a, b = normalize(pred), normalize(ref)
    if not a or not b:
        return False
    if a == b or a.replace(" ", "") == b.replace(" ", ""):
        return True
    x, y = parse_number(pred), parse_number(ref)
    if x is not None and y is not None:
        return x == y or abs(float(x) - float(y)) <= 1e-9 * max(1.0, abs(float(y)))
    ma, mb = _matrix(pred), _matrix(ref)  # raw: normalize reads a row break as a space
    if ma is not None or mb is not None:  # matrices / vectors: same shape, entries in order
        return (
            ma is not None
            and mb is not None
            and [len(r) for r in ma] == [len(r) for r in mb]
            and all(
                _equivalent(p, q, timeout, symbolic, depth + 1)
                for ra, rb in zip(ma, mb)
                for p, q in zip(ra, rb)
            )
        )
    if depth < 2:
        alts = [_alternatives(pred), _alternatives(ref)]
        if alts[0] or alts[1]:  # a \pm b, "x = 2 or x = 3": the set of values
            ea, eb = (alt or _split_top(normalize(raw)) for alt, raw in zip(alts, (pred, ref)))
            return _same_elements(ea, eb, timeout, symbolic, depth)
        sets = [s[2:-2] for s in (a, b) if s.startswith("\\{") and s.endswith("\\}")]
        if len(sets) == 2:  # \{1, 2\}: a set, any order
            return _same_elements(
                _split_top(sets[0]), _split_top(sets[1]), timeout, symbolic, depth
            )
        ga, gb = _bracketed(a), _bracketed(b)
        if ga and gb:  # tuples / intervals: brackets and elements in order
            ea, eb = _split_top(ga[1]), _split_top(gb[1])
            if len(ea) == len(eb) and (ga[0], ga[2]) == (gb[0], gb[2]):
                return all(_equivalent(p, q, timeout, symbolic, depth + 1) for p, q in zip(ea, eb))
            return False
        ea, eb = _split_top(a), _split_top(b)
        if len(ea) > 1 or len(eb) > 1:  # solution sets: any order
            return _same_elements(ea, eb, timeout, symbolic, depth)
    if not symbolic or len(a) > _MAX_LEN or len(b) > _MAX_LEN:
        return False
    sa, sb = latex_to_sympy(a), latex_to_sympy(b)
    if sa is None or sb is None:
        return False
    return _symbolic_equal(sa, sb, timeout)


_MATRIX = re.compile(r"\\begin\{([pbBvV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}", re.S)


def _matrix(s: str) -> list[list[str]] | None:
    """The rows of entries of a \\begin{pmatrix} ... \\end{pmatrix} (bmatrix, matrix,
    array, ...) answer, else None."""
    m = _MATRIX.fullmatch(s.strip())
    if m is None:
        return None
    rows = [r for r in re.split(r"\\\\", m.group(2)) if r.strip()]
    return [[e.strip() for e in r.split("&")] for r in rows]


_OR = re.compile(r"\s*(?:,\s*)?\b(?:or|and)\b\s*")
_PM = re.compile(r"\\(pm|mp)")


def _alternatives(s: str) -> list[str] | None:
    """The values of an answer that lists alternatives, else None: "a \\pm b" -> [a+b, a-b]
    (\\pm once), "x = 2 or x = 3" / "2 and 3" -> ["2", "3"] (each part normalized)."""
    t = _TEXT_CMD.sub(r" \1 ", str(s))
    if len(_PM.findall(t)) == 1:
        left, sign, right = _PM.split(t)
        left, right = left.strip(), right.strip()
        first, second = ("+", "-") if sign == "pm" else ("-", "+")
        if not right:
            return None
        make = (lambda op: f"{left}{op}{right}") if left else (lambda op: f"{op}{right}")
        return [normalize(make(first)), normalize(make(second).lstrip("+"))]
    parts = [p for p in _OR.split(t) if p.strip()]
    if len(parts) < 2 or any(re.search(r"[a-zA-Z]{3,}", normalize(p)) for p in parts):
        return None
    return [normalize(p) for p in parts]


def _same_elements(ea, eb, timeout, symbolic, depth) -> bool:
    """The two lists match as multisets of equivalent answers."""
    if len(ea) != len(eb):
        return False
    left = list(eb)
    for p in ea:
        hit = next(
            (i for i, q in enumerate(left) if _equivalent(p, q, timeout, symbolic, depth + 1)), None
        )
        if hit is None:
            return False
        left.pop(hit)
    return True


# ------------------------------------------------------------ LaTeX -> sympy source
_FUNCS = {
    "sqrt",
    "sin",
    "cos",
    "tan",
    "log",
    "exp",
    "pi",
    "oo",
    "asin",
    "acos",
    "atan",
    "sec",
    "csc",
    "cot",
    "Abs",
    "E",
    "I",
}
_LATEX_NAMES = {
    "\\pi": " pi ",
    "\\infty": " oo ",
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
    "\\ln": " log ",
    "\\log": " log ",
    "\\sin": " sin ",
    "\\cos": " cos ",
    "\\tan": " tan ",
    "\\exp": " exp ",
    "\\arcsin": " asin ",
    "\\arccos": " acos ",
    "\\arctan": " atan ",
    "\\sec": " sec ",
    "\\csc": " csc ",
    "\\cot": " cot ",
}


def _replace_cmd_args(s: str, cmd: str, nargs: int, fmt) -> str | None:
    """Rewrites every `cmd{a}{b}` (or single-char args) with fmt(args), innermost-safe."""
    for _ in range(200):
        i = s.find(cmd)
        if i < 0:
            return s
        j = i + len(cmd)
        opt = None
        if cmd == "\\sqrt" and j < len(s) and s[j] == "[":
            k = s.find("]", j)
            if k < 0:
                return None
            opt, j = s[j + 1 : k], k + 1
        args = []
        for _ in range(nargs):
            arg, j = _frac_arg(s, j)
            if arg is None:
                return None
            args.append(arg)
        s = s[:i] + fmt(args, opt) + s[j:]
    return None


# \log_b x, \log_{b}(x), \ln x, \log{x}: the base and a simple argument (a group, or a
# number / letters with an optional power).
_LOG = re.compile(
    r"\\(?:log|ln)(?:_\{?([0-9a-zA-Z.]+)\}?)?\s*"
    r"(\{[^{}]*\}|\([^()]*\)|[0-9a-zA-Z.]+(?:\^\{?[0-9a-zA-Z.]+\}?)?)"
)


def _log_source(m) -> str:
    arg = m.group(2)
    arg = arg[1:-1] if arg[0] in "{(" else arg
    return f"(log({arg})/log({m.group(1)}))" if m.group(1) else f"log({arg})"


def latex_to_sympy(s: str) -> str | None:
    """sympy-parsable source of a LaTeX math answer, or None if outside the subset."""
    s = s.replace("\\left", "").replace("\\right", "")
    s = _replace_cmd_args(s, "\\frac", 2, lambda a, _: f"(({a[0]})/({a[1]}))")
    if s is None:
        return None
    s = _replace_cmd_args(
        s, "\\sqrt", 1, lambda a, n: f"(({a[0]})**(1/({n})))" if n else f"sqrt({a[0]})"
    )
    if s is None:
        return None
    s = _LOG.sub(_log_source, s)
    for k in sorted(_LATEX_NAMES, key=len, reverse=True):
        s = s.replace(k, _LATEX_NAMES[k])
    if re.search(r"\\[a-zA-Z]", s):  # a command outside the subset (\begin, \alpha, ...)
        return None
    s = s.replace("{", "(").replace("}", ")").replace("^", "**").replace("\\", " ")
    s = re.sub(r"\|([^|]+)\|", r"Abs(\1)", s)
    if not re.fullmatch(r"[0-9a-zA-Z+\-*/(). ]*", s) or "__" in s or not s.strip():
        return None
    if re.search(r"\*\*\s*\(?\s*\d{4,}", s) or s.count("**") > 4:
        return None  # huge powers: not worth a sympy call

    def ident(m):
        w = m.group(0)
        if w == "e":  # a lone e is Euler's number
            return "E"
        return w if w in _FUNCS else "*".join(w)  # xy -> x*y

    return re.sub(r"[a-zA-Z]+", ident, s)


# ----------------------------------------------------------- sympy worker (subprocess)
class _Worker:
    """A `python -m dsparse_jax.data.answer_check` process answering JSON lines."""

    def __init__(self):
        self.proc = None
        self.warm = False  # the running worker has answered once (sympy imported)
        self.lock = threading.Lock()
        self.cache: dict[tuple[str, str], bool] = {}
        self.warned = False

    def _start(self):
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("XLA_FLAGS", None)
        self.warm = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsparse_jax.data.answer_check"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
            bufsize=1,
        )

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.proc = None

    def equal(self, a: str, b: str, timeout: float) -> bool:
        key = (a, b)
        if key in self.cache:
            return self.cache[key]
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                self.proc.stdin.write(json.dumps([a, b]) + "\n")
                self.proc.stdin.flush()
                # The first call also pays the worker's start-up (sympy import).
                ready, _, _ = select.select(
                    [self.proc.stdout], [], [], timeout + (0.0 if self.warm else 10.0)
                )
                if not ready:
                    self._kill()
                    return False
                line = self.proc.stdout.readline()
                self.warm = True
                reply = json.loads(line) if line else {"error": "worker exited"}
            except (OSError, ValueError) as e:
                self._kill()
                reply = {"error": str(e)}
        if "error" in reply:
            if not self.warned:
                warnings.warn(f"answer_check: symbolic check unavailable ({reply['error']})")
                self.warned = True
            return False
        if len(self.cache) < 100_000:
            self.cache[key] = bool(reply["eq"])
        return bool(reply["eq"])


_WORKER = _Worker()
atexit.register(_WORKER._kill)  # pylint: disable=protected-access


def _symbolic_equal(a: str, b: str, timeout: float) -> bool:
    return _WORKER.equal(a, b, timeout)


def _sympy_equal(a: str, b: str) -> bool:
    """In the worker: sympy equivalence of two whitelisted expression sources."""
    import random  # pylint: disable=import-outside-toplevel

    import sympy  # pylint: disable=import-outside-toplevel
    from sympy.parsing.sympy_parser import (  # pylint: disable=import-outside-toplevel
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    tr = standard_transformations + (implicit_multiplication_application,)
    ns = {name: getattr(sympy, name) for name in _FUNCS}
    # Every other letter is a plain symbol (not sympy's N, S, O, Q objects).
    ns.update({c: sympy.Symbol(c) for c in set(re.findall(r"[a-zA-Z]", a + b)) - set(ns)})
    x, y = (
        parse_expr(a, transformations=tr, local_dict=ns),
        parse_expr(b, transformations=tr, local_dict=ns),
    )
    if sympy.simplify(x - y) == 0:
        return True
    free = sorted((x - y).free_symbols, key=str)
    rng = random.Random(0)
    for _ in range(4):
        point = {s: sympy.Rational(rng.randint(1, 97), rng.randint(1, 13)) for s in free}
        dx, dy = complex(x.evalf(30, subs=point)), complex(y.evalf(30, subs=point))
        if abs(dx - dy) > 1e-9 * max(1.0, abs(dy)):
            return False
    return bool(free)  # no free symbols and simplify failed: not equal


def _worker_main():
    for line in sys.stdin:
        try:
            a, b = json.loads(line)
            reply = {"eq": bool(_sympy_equal(a, b))}
        except Exception as e:  # noqa: BLE001
            reply = {"eq": False, "exc": type(e).__name__}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------- grading


def grade(
    completion: str,
    reference,
    timeout: float = SYMBOLIC_TIMEOUT_S,
    fallback_last_number: bool = False,
) -> bool:
    """True iff the completion's final answer is equivalent to `reference`."""
    pred = extract_answer(completion, fallback_last_number)
    return pred is not None and is_equivalent(pred, reference, timeout)


def math_reward(
    completion: str, reference, format_reward: float = 0.0, timeout: float = SYMBOLIC_TIMEOUT_S
) -> float:
    """1 if right, `format_reward` if an answer was given but is wrong, else 0."""
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if is_equivalent(pred, reference, timeout) else float(format_reward)


if __name__ == "__main__":
    _worker_main()
