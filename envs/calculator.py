"""A safe, bounded arithmetic evaluator: the calculator tool of ``calc-tools``.

Never ``eval``: the text is parsed with ``ast`` and only numbers, ``+ - * / ** // %``, unary signs and
parentheses are allowed (a name, a call, an attribute, a string is refused before anything runs). Each
operation is bounded before it is computed, so no input can take long or hold much memory: the text's
length, the number of nodes, integers of at most ``MAX_BITS`` bits, exponents of at most ``MAX_EXPONENT``,
finite floats, and a wall-clock deadline checked at every node.
"""
from __future__ import annotations

import ast
import math
import operator
import time
import warnings

MAX_CHARS = 300
MAX_NODES = 200
MAX_BITS = 512  # integers below 2**512 (~1.3e154)
MAX_EXPONENT = 4096
TIME_LIMIT_S = 0.05

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, *_BIN, *_UNARY)
_NAMES = {ast.BitXor: "^ (write ** for a power)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
          ast.RShift: ">>", ast.MatMult: "@"}


class CalcError(ValueError):
    """Why an expression was refused or could not be computed (the tool's error observation)."""


def evaluate(expression: str, time_limit_s: float = TIME_LIMIT_S) -> int | float:
    """The value of ``expression``; ``CalcError`` for anything unsafe, malformed, too big or too slow."""
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be text, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalcError(f"expression of {len(text)} characters (at most {MAX_CHARS})")
    try:
        with warnings.catch_warnings():  # "1if 1" warns on stderr before it is refused
            warnings.simplefilter("ignore")
            tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError(f"not an arithmetic expression: {text[:60]!r}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise CalcError(f"expression of {len(nodes)} parts (at most {MAX_NODES})")
    for node in nodes:
        if isinstance(node, (ast.BinOp, ast.UnaryOp)):
            op = type(node.op)
            if op not in _BIN and op not in _UNARY:
                raise CalcError(f"operator {_NAMES.get(op, op.__name__)} is not allowed; allowed: + - * / ** // %")
        elif isinstance(node, ast.Constant):
            if type(node.value) not in (int, float):
                raise CalcError(f"only numbers are allowed, got {node.value!r:.40}")
        elif not isinstance(node, _ALLOWED) and not isinstance(node, (ast.operator, ast.unaryop)):
            raise CalcError(f"{type(node).__name__.lower()} is not allowed: only numbers, + - * / ** // % "
                            "and parentheses")
    deadline = time.monotonic() + time_limit_s
    return _value(tree.body, deadline)


def _check(x: int | float) -> int | float:
    if isinstance(x, int):
        if x.bit_length() > MAX_BITS:
            raise CalcError(f"result too large (more than {MAX_BITS} bits)")
    elif isinstance(x, float):
        if not math.isfinite(x):
            raise CalcError("result too large (not a finite number)")
    else:  # a negative number to a fractional power is complex
        raise CalcError("result is not a real number")
    return x


def _pow(a: int | float, b: int | float) -> int | float:
    if abs(b) > MAX_EXPONENT:
        raise CalcError(f"exponent {b!r:.30} too large (at most {MAX_EXPONENT} in size)")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and (abs(a).bit_length() - 1) * b > MAX_BITS:
        raise CalcError(f"result too large (more than {MAX_BITS} bits)")
    if isinstance(a, float) or isinstance(b, float) or b < 0:
        if a != 0 and b * math.log2(abs(float(a))) > 1023:
            raise CalcError("result too large (not a finite number)")
    return a ** b


def _value(node: ast.AST, deadline: float) -> int | float:
    if time.monotonic() > deadline:
        raise CalcError("took too long")
    if isinstance(node, ast.Constant):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp):
        return _check(_UNARY[type(node.op)](_value(node.operand, deadline)))
    assert isinstance(node, ast.BinOp)  # evaluate() allowed nothing else
    a, b = _value(node.left, deadline), _value(node.right, deadline)
    op = type(node.op)
    try:
        if op is ast.Pow:
            return _check(_pow(a, b))
        return _check(_BIN[op](a, b))
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("result too large (not a finite number)") from None


def format_number(x: int | float) -> str:
    """How the tool writes a value: integers exactly, other numbers to 12 significant digits."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"
