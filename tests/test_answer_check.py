"""Answer grading: extraction, numeric and symbolic equivalence, robustness, timeout."""

import time

import pytest

from dsparse_jax.data import answer_check as ac

# (completion, reference field as stored in the dataset, expected grade)
GRADE_CASES = [
    # GSM8K style: reference "... #### N"
    ("She has 3 + 4 = 7 apples.\n#### 7", "3+4=7\n#### 7", True),
    ("So the total is \\boxed{72}.", "Natalia sold 48/2 = 24 clips.\n#### 72", True),
    ("#### 1,234", "#### 1234", True),
    ("The answer is \\boxed{1234}", "#### 1,234", True),
    ("\\boxed{\\$18}", "#### 18", True),
    ("\\boxed{18 dollars}", "#### 18", True),
    ("\\boxed{18.00}", "#### 18", True),
    ("\\boxed{18.5}", "#### 18", False),
    ("\\boxed{-5}", "#### -5", True),
    ("\\boxed{5}", "#### -5", False),
    ("The answer is 42.", "#### 42", True),
    ("Final answer: 42", "#### 42", True),
    ("I think it is 42", "#### 42", False),  # no recognised answer form
    ("\\boxed{20\\%}", "#### 20", True),
    ("\\boxed{10} is wrong, the final answer is \\boxed{12}", "#### 12", True),
    ("\\boxed{12} then \\boxed{10}", "#### 12", False),  # the last box counts
    ("\\boxed{5 \\text{ cm}}", "#### 5", True),
    ("\\boxed{x = 3}", "#### 3", True),
    ("\\boxed{3,000,000}", "#### 3000000", True),
    ("\\boxed{0.5}", "#### .5", True),
    # MATH style: reference is a solution with \boxed{...}
    ("\\boxed{\\frac{1}{2}}", "so $x=\\boxed{\\frac12}$.", True),
    ("\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", True),
    ("\\boxed{1/2}", "\\boxed{\\dfrac{1}{2}}", True),
    ("\\boxed{\\tfrac{3}{4}}", "\\boxed{0.75}", True),
    ("\\boxed{\\frac{2}{3}}", "\\boxed{0.67}", False),
    ("\\boxed{-\\frac{3}{2}}", "\\boxed{\\frac{-3}{2}}", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\boxed{\\frac{\\sqrt3}{2}}", True),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\boxed{\\frac{1}{\\sqrt{2}}}", True),
    ("\\boxed{2\\sqrt{2}}", "\\boxed{\\sqrt{8}}", True),
    ("\\boxed{2\\sqrt{3}}", "\\boxed{\\sqrt{8}}", False),
    ("\\boxed{x^2+2x+1}", "\\boxed{(x+1)^2}", True),
    ("\\boxed{x^2+2x}", "\\boxed{(x+1)^2}", False),
    ("\\boxed{\\pi r^2}", "\\boxed{r^2\\pi}", True),
    ("\\boxed{2\\pi}", "\\boxed{6.28}", False),
    ("\\boxed{(1, 2)}", "\\boxed{(1,2)}", True),
    ("\\boxed{(2, 1)}", "\\boxed{(1,2)}", False),  # ordered pair
    ("\\boxed{(0, \\frac{1}{2}]}", "\\boxed{(0,0.5]}", True),  # interval
    ("\\boxed{[0, \\frac{1}{2}]}", "\\boxed{(0,0.5]}", False),  # bracket differs
    ("\\boxed{3, 1, 2}", "\\boxed{1,2,3}", True),  # solution set, any order
    ("\\boxed{1, 2}", "\\boxed{1,2,3}", False),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\boxed{(3,\\frac{\\pi}{2})}", True),
    ("\\boxed{90^\\circ}", "\\boxed{90}", True),
    ("\\boxed{\\text{(C)}}", "\\boxed{\\text{(C)}}", True),
    ("\\boxed{\\text{(B)}}", "\\boxed{\\text{(C)}}", False),
    ("\\boxed{\\frac{a+b}{2}}", "\\boxed{\\frac{a}{2}+\\frac{b}{2}}", True),
    ("\\boxed{\\sqrt[3]{27}}", "\\boxed{3}", True),
    ("\\boxed{\\infty}", "\\boxed{\\infty}", True),
    ("\\boxed{{1 \\over 2}}", "\\boxed{\\frac{1}{2}}", False),  # unsupported macro: no credit
    ("\\boxed{\\frac{10}{4}}", "\\boxed{\\frac{5}{2}}", True),
    ("\\boxed{2.5}", "\\boxed{\\frac52}", True),
    ("\\boxed{10^{3}}", "\\boxed{1000}", True),
    ("\\boxed 5", "\\boxed{5}", True),
    ("\\boxed{\\{1, 2\\}}", "\\boxed{1, 2}", False),
    ("\\boxed{\\{2, 1\\}}", "\\boxed{\\{1,2\\}}", True),  # set braces: any order
    ("\\boxed{\\{1, 3\\}}", "\\boxed{\\{1,2\\}}", False),
    ("\\boxed{N+1}", "\\boxed{1+N}", True),  # letters are symbols, not sympy's N()
    ("\\boxed{\\$1,000.00}", "#### 1000", True),
    ("\\boxed{\\frac{1}{3}}", "\\boxed{0.333}", False),  # no rounding credit
    ("\\boxed{unclosed", "\\boxed{5}", False),
    ("", "#### 5", False),
]


@pytest.mark.parametrize("completion,reference,expected", GRADE_CASES)
def test_grade_table(completion, reference, expected):
    ref = ac.reference_answer(reference)
    assert ac.grade(completion, ref) is expected, (completion, ref)


def test_table_is_large_enough():
    assert len(GRADE_CASES) >= 40
    assert sum(e for _, _, e in GRADE_CASES) >= 15
    assert sum(not e for _, _, e in GRADE_CASES) >= 15


@pytest.mark.parametrize(
    "text,want",
    [
        ("a \\boxed{\\frac{1}{\\sqrt{2}}} b", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{a} and \\boxed{b{c}}", "b{c}"),
        ("\\boxed{a} and \\boxed{b", "a"),  # the last complete box
        ("no box", None),
    ],
)
def test_extract_boxed(text, want):
    assert ac.extract_boxed(text) == want


def test_reference_answer_forms():
    assert ac.reference_answer("blah\n#### 1,000") == "1,000"
    assert ac.reference_answer("so \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert ac.reference_answer("  17 ") == "17"
    assert ac.reference_answer(None) == ""
    assert ac.reference_answer(5) == "5"


def test_parse_number():
    from fractions import Fraction

    assert ac.parse_number("1,234.5") == Fraction(2469, 2)
    assert ac.parse_number("-\\frac{3}{4}") == Fraction(-3, 4)
    assert ac.parse_number("\\frac34") == Fraction(3, 4)
    assert ac.parse_number("7 apples") == 7
    assert ac.parse_number("2 pi") is None
    assert ac.parse_number("x") is None
    assert ac.parse_number("1/0") is None


def test_fallback_last_number_is_opt_in():
    assert ac.extract_answer("it is 41 or 42") is None
    assert ac.extract_answer("it is 41 or 42", fallback_last_number=True) == "42"


@pytest.mark.parametrize(
    "junk",
    [
        "",
        "}}}{{{",
        "\\boxed{",
        "\\frac{",
        "\\frac{1}{0}",
        "\\sqrt[",
        "((((((",
        "#### ",
        "\\boxed{__import__('os').system('echo hi')}",
        "\x00\xff\u2603",
        "1/0",
        "0/0",
        "\\boxed{" * 500 + "1" + "}" * 500,
        "9" * 5000,
        "\\left(\\right)",
        "|x|",
        "$$$$",
    ],
)
def test_never_raises(junk):
    for ref in ("5", junk, "\\frac{1}{2}", "x^2"):
        assert isinstance(ac.grade(junk, ref), bool)
        assert isinstance(ac.is_equivalent(junk, ref), bool)
        assert isinstance(ac.math_reward(junk, ref), float)


def test_huge_inputs_are_fast():
    """Degenerate rollouts (runaway digits, thousands of unclosed boxes) grade quickly."""
    t = time.time()
    for junk in ("9" * 20000 + "x bb", "\\boxed{" * 20000, "{" * 50000, "1," * 20000):
        assert ac.grade(junk, "5") is False
        assert ac.grade("\\boxed{%s}" % junk, junk) in (True, False)
    assert time.time() - t < 2.0


def test_pathological_expression_times_out():
    """A power tower sympy cannot finish: killed after the timeout, graded wrong."""
    ac.is_equivalent("x+1", "1+x")  # warm the worker up (sympy import)
    # Not caught by the size heuristic (three-digit exponents), still hopeless to expand.
    a, b = "(x+1)^{999}*(x-1)^{998}", "(x^2-1)^{998}*(x+1)+y-y+1"
    assert ac.latex_to_sympy(a) is not None
    t = time.time()
    assert ac.is_equivalent(a, b, timeout=1.0) is False
    assert time.time() - t < 5.0
    assert ac.is_equivalent("\\frac{x^2-1}{x-1}", "x+1")  # the worker came back


@pytest.mark.parametrize(
    "pred,ref,want",
    [
        # matrices and vectors: same shape, entries in order
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", True),
        (r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", False),
        (
            r"\begin{pmatrix} 1 & 3 \\ 2 & 4 \end{pmatrix}",
            r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}",
            False,
        ),
        (
            r"\begin{bmatrix} \frac12 \\ -1 \end{bmatrix}",
            r"\begin{pmatrix} 0.5 \\ -1 \end{pmatrix}",
            True,
        ),
        # \pm and "or" / "and" lists: the set of values
        (r"\pm 2", "2, -2", True),
        (r"1 \pm \sqrt{2}", r"1+\sqrt2, 1-\sqrt2", True),
        (r"1 + \sqrt{2}", r"1 \pm \sqrt{2}", False),
        (r"x=2 \text{ or } x=3", "3, 2", True),
        (r"2 \text{ or } 4", "2, 3", False),
        # repeating decimals
        (r"0.\overline{36}", r"\frac{4}{11}", True),
        (r"0.1\overline{6}", r"\frac16", True),
        ("0.33", r"\frac13", False),
        # logarithms and exact constants
        (r"\log_2 8", "3", True),
        (r"\log_2 3", r"\frac{\ln 3}{\ln 2}", True),
        (r"\log_2 8", "4", False),
        (r"\exp(2)", "e^2", True),
        ("3.14", r"\pi", False),
        # commands outside the symbolic subset are never multiplied out as letters
        (r"\alpha", r"\beta", False),
    ],
)
def test_equivalent_forms_and_ordered_answers(pred, ref, want):
    assert ac.is_equivalent(pred, ref) is want
