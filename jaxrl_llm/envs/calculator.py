"""Exact arithmetic on a model's expression, read from its syntax tree (never eval'd): integers and decimals as
exact fractions, + - * / // % ** and parentheses.

    calculate("123456789 * 987654321")  -> "121932631112635269"
    calculate("0.1 + 0.2")              -> "0.3"        (exact, not 0.30000000000000004)
    calculate("1/3")                    -> "1/3"
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 1000  # |b| in a ** b
# Of any numerator or denominator along the way (bounds time and memory); under Python's 4300-digit limit on
# converting an int to a string.
MAX_RESULT_DIGITS = 4000
# Bits of a number with MAX_RESULT_DIGITS decimal digits: checked before a power is computed, not after.
_MAX_BITS = int(MAX_RESULT_DIGITS * math.log2(10)) + 1

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message is one line."""


def calculate(expression: str) -> str:
    """The exact value of an arithmetic expression: an integer, a terminating decimal, or "p/q"."""
    text = expression.strip()
    if text.endswith("="):  # "2 + 2 =" as models write it
        text = text[:-1].strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression too long ({len(text)} characters; at most {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte, or an integer of over 4300 digits
        raise CalculatorError(f"not an arithmetic expression: {text[:80]!r}") from e
    except (RecursionError, MemoryError) as e:
        raise CalculatorError("expression nested too deeply") from e
    try:
        return _format(_evaluate(tree.body, text))
    except RecursionError as e:
        raise CalculatorError("expression nested too deeply") from e


def _evaluate(node: ast.expr, source: str) -> Fraction:
    """The value of one node of the tree, as a fraction; anything but arithmetic raises `CalculatorError`."""
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"unsupported value {node.value!r}: only numbers")
        return _literal(node, source)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, source), _evaluate(node.right, source)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"unsupported operator {type(node.op).__name__}: use + - * / // % **")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        return _check(op(left, right))
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}): only numbers, + - * / // % ** and "
                          f"parentheses")


_DECIMAL = re.compile(r"(?P<mantissa>[0-9_]*\.?[0-9_]*)(?:[eE](?P<exponent>[+-]?[0-9_]+))?")


def _literal(node: ast.Constant, source: str) -> Fraction:
    """A number as written: "0.1" is exactly 1/10, not the float nearest to it."""
    if isinstance(node.value, int):
        return _check(Fraction(node.value))
    text = (ast.get_source_segment(source, node) or repr(node.value)).replace("_", "")
    match = _DECIMAL.fullmatch(text)
    if match is None:
        raise CalculatorError(f"unsupported number {text!r}")
    # "1e999999999" would make Fraction build a billion-digit power of ten: its exponent is checked first.
    if match["exponent"] is not None and abs(int(match["exponent"])) > MAX_RESULT_DIGITS:
        raise CalculatorError(f"number {text!r} too large or too small (exponent beyond {MAX_RESULT_DIGITS})")
    return _check(Fraction(text))


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    """`base ** exponent` for an integer exponent within bounds, refused before it is computed when too large."""
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents (the result of a fractional power is not exact)")
    n = exponent.numerator
    if abs(n) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {n} too large (at most {MAX_EXPONENT} in absolute value)")
    if base == 0 and n < 0:
        raise CalculatorError("division by zero")
    # The result's bits are about |n| times the base's: refuse before computing, not after.
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if bits > 1 and abs(n) * (bits - 1) > _MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_RESULT_DIGITS} digits)")
    return base**n


def _check(value: Fraction) -> Fraction:
    """`value`, unless its numerator or denominator has more than MAX_RESULT_DIGITS digits."""
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise CalculatorError(f"result too large (more than {MAX_RESULT_DIGITS} digits)")
    return value


def _format(value: Fraction) -> str:
    """An integer as an integer, a fraction as an exact decimal when it has one, else as "p/q"."""
    if value.denominator == 1:
        return str(value.numerator)
    q = value.denominator
    twos = fives = 0
    while q % 2 == 0:
        q //= 2
        twos += 1
    while q % 5 == 0:
        q //= 5
        fives += 1
    if q != 1:  # a prime other than 2 and 5 in the denominator: the decimal does not terminate
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    try:
        digits = str(scaled).rjust(places + 1, "0")
    except ValueError:  # more digits than Python converts: the fraction is the shorter answer anyway
        return f"{value.numerator}/{value.denominator}"
    sign = "-" if value < 0 else ""
    return f"{sign}{digits[:-places]}.{digits[-places:]}".rstrip("0").rstrip(".")
