"""The calculator tool: exact arithmetic from the syntax tree, and a one-line refusal of everything else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_llm.envs.calculator import MAX_EXPRESSION_CHARS, CalculatorError, calculate


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("123456789*987654321", "121932631112635269"),  # 123456789 * 987654321, by hand: exact beyond 2**53
        ("7/2", "3.5"),
        ("1/3", "1/3"),
        ("-1/3", "-1/3"),
        ("(2+3)*4", "20"),
        ("-2**3", "-8"),  # ** binds tighter than unary minus, as in Python
        ("(-2)**2", "4"),
        ("10//3", "3"),
        ("-7//2", "-4"),  # floor, not truncation
        ("10%3", "1"),
        ("0.1+0.2", "0.3"),  # decimals are exact: 1/10 + 2/10
        ("1/8", "0.125"),
        ("-1/8", "-0.125"),
        ("2**-3", "0.125"),
        ("1.5*4", "6"),
        ("2.5e-3", "0.0025"),
        ("1e3", "1000"),
        ("2**100", "1267650600228229401496703205376"),
        ("  6*7 = ", "42"),  # surrounding whitespace and a trailing "=" as models write them
        ("+5", "5"),
        ("22/7 - 1/7", "3"),
    ],
)
def test_values(expression: str, expected: str) -> None:
    assert calculate(expression) == expected


@given(st.integers(-(10**30), 10**30), st.integers(-(10**30), 10**30))
def test_integer_arithmetic_is_exact(a: int, b: int) -> None:
    assert calculate(f"{a}*{b}") == str(a * b)
    assert calculate(f"{a}+{b}") == str(a + b)
    assert calculate(f"{a}-{b}") == str(a - b)
    assert calculate(f"({a}) - ({b})") == str(a - b)


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os')",  # a call of a name
        "__import__('os').system('true')",
        "abs(-1)",
        "(1).__class__",  # an attribute
        "x",  # a name
        "x + 1",
        "1/0",
        "1//0",
        "1%0",
        "0**-1",
        "9**9**9",  # refused from the exponent's size, before any power is computed
        "2**100000",
        "10**1000*10**1000*10**1000*10**1000*10**1000",  # too many digits along the way
        "1e999999999",  # a literal's exponent checked before Fraction expands it
        "",
        "   =",
        "lambda: 1",
        "1 if 1 else 2",
        "[1, 2]",
        "'a' * 3",
        "True + 1",
        "1j",
        "2**0.5",  # not exact
        "7 ^ 2",  # strict Python syntax: ^ is xor, which is refused
        "1 < 2",
        "2 +",
        "1" * (MAX_EXPRESSION_CHARS + 1),
        "(" * 300 + "1" + ")" * 300,
    ],
)
def test_refusals(expression: str) -> None:
    with pytest.raises(CalculatorError) as info:
        calculate(expression)
    assert "\n" not in str(info.value) and str(info.value)


def test_error_is_a_value_error() -> None:
    assert issubclass(CalculatorError, ValueError)
