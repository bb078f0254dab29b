"""The calculator tool: exact arithmetic on an expression, without ``eval``.

    calculate("2 * (3 + 4) / 5")   # '14/5' as text: '2.8'

Numbers (integers and decimals), + - * / // % ** and parentheses. Results are exact
(fractions) and printed as an integer when whole, else as a decimal rounded to 10
significant digits. Exponents are bounded so that no expression can take long.
"""

from __future__ import annotations

import ast
from fractions import Fraction

MAX_EXPONENT = 64
MAX_DIGITS = 200
MAX_LENGTH = 500


class CalculatorError(ValueError):
    pass


_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}


def _eval(node) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if b.denominator != 1 or abs(b) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
            if a == 0 and b < 0:
                raise CalculatorError("division by zero")
            out = a ** int(b)
        elif type(node.op) in _BINOPS:
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
                raise CalculatorError("division by zero")
            out = _BINOPS[type(node.op)](a, b)
        else:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        if len(str(out.numerator)) + len(str(out.denominator)) > MAX_DIGITS:
            raise CalculatorError("the result is too large")
        return out
    raise CalculatorError(f"{type(node).__name__} is not arithmetic")


def format_number(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.10g}"


def calculate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text; raises CalculatorError if invalid."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be text, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}") from None
    return format_number(_eval(tree))
