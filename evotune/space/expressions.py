"""The expression language of space files: derived values and constraints, written in a small subset of Python.

`safe_eval` vets an expression's syntax tree (`_check`) and compiles a translation of it (`_translate`) in which
every name is a key of the evaluation's mapping and every operation a checked helper: the file's text is never
handed to eval/exec, nor can an expression reach a builtin. Every number an expression reads or computes stays
within ±2**64, and expressions are bounded in length and depth, so no file can stall or exhaust the tuner.
"""

from __future__ import annotations

import ast
import operator
from functools import lru_cache
from typing import Callable, Mapping

from ..errors import UsageError

# Bounds `**` so that an expression cannot stall the tuner computing a huge integer.
_MAX_EXPONENT = 64
# Every number a space's expressions read or compute lies within ±_MAX_MAGNITUDE: with bounded operands
# each operation is quick, where nested powers of unbounded ones took minutes.
_MAX_MAGNITUDE = 2**64
# An expression's length and nesting: the shipped ones are at most 165 characters and 8 deep.
_MAX_EXPRESSION_CHARS = 1000
_MAX_EXPRESSION_DEPTH = 64

class ExpressionError(UsageError):
    """An expression uses a construct outside the allowed subset, or fails to evaluate."""


def _ceil_div(a, b):
    return -(-a // b)


def _is_pow2(x) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def _short(text: str, most: int = 80) -> str:
    """`text` cut to `most` characters, for messages quoting what a file says."""
    return text if len(text) <= most else text[: most - 3] + "..."


def _in_bounds(value) -> bool:
    """False for a number beyond ±_MAX_MAGNITUDE or not real (complex, inf, nan); True for anything else."""
    if isinstance(value, complex):
        return False
    return not isinstance(value, (int, float)) or -_MAX_MAGNITUDE <= value <= _MAX_MAGNITUDE


# name -> (function, fewest arguments, most arguments or None for no limit)
_FUNCTIONS = {
    "min": (min, 2, None),
    "max": (max, 2, None),
    "abs": (abs, 1, 1),
    "ceil_div": (_ceil_div, 2, 2),
    "is_pow2": (_is_pow2, 1, 1),
    "int": (int, 1, 1),
    "bool": (bool, 1, 1),
}


def _pow(a, b):
    if abs(b) > _MAX_EXPONENT:
        raise ValueError(f"exponent {b} is larger than {_MAX_EXPONENT}")
    return a**b


_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _pow,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
# The comparisons _check admits and what they mean; compiled expressions use Python's own, which mean the same.
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}


def _check(node: ast.AST, names: set[str], depth: int = 0) -> None:
    """Reject any construct outside the allowed subset; collect the variable names used into `names`."""
    if depth > _MAX_EXPRESSION_DEPTH:
        raise ExpressionError(f"nested more than {_MAX_EXPRESSION_DEPTH} deep")
    depth += 1
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float, str, bool):
            raise ExpressionError(f"literal {_short(repr(node.value))} is not allowed")
        if not _in_bounds(node.value):
            raise ExpressionError(f"literal {_short(repr(node.value))} is larger than 2**64 in magnitude")
    elif isinstance(node, ast.Name):
        names.add(node.id)
    elif isinstance(node, ast.BinOp):
        if type(node.op) not in _BINOPS:
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.left, names, depth)
        _check(node.right, names, depth)
    elif isinstance(node, ast.UnaryOp):
        if not isinstance(node.op, (ast.USub, ast.Not)):
            raise ExpressionError(f"operator {type(node.op).__name__} is not allowed")
        _check(node.operand, names, depth)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            _check(value, names, depth)
    elif isinstance(node, ast.Compare):
        _check(node.left, names, depth)
        for op, right in zip(node.ops, node.comparators):
            if isinstance(op, (ast.In, ast.NotIn)):
                if not isinstance(right, (ast.Tuple, ast.List)):
                    raise ExpressionError("the right side of `in` must be a tuple or list literal")
                for element in right.elts:
                    _check(element, names, depth)
            elif type(op) in _COMPARE:
                _check(right, names, depth)
            else:
                raise ExpressionError(f"comparison {type(op).__name__} is not allowed")
    elif isinstance(node, ast.IfExp):
        for part in (node.test, node.body, node.orelse):
            _check(part, names, depth)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS:
            raise ExpressionError(f"only {', '.join(_FUNCTIONS)} may be called")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise ExpressionError(f"{node.func.id}() takes plain positional arguments only")
        _, fewest, most = _FUNCTIONS[node.func.id]
        if len(node.args) < fewest or (most is not None and len(node.args) > most):
            wanted = str(fewest) if fewest == most else f"at least {fewest}"
            raise ExpressionError(f"{node.func.id}() takes {wanted} argument(s), got {len(node.args)}")
        for arg in node.args:
            _check(arg, names, depth)
    elif isinstance(node, (ast.Tuple, ast.List)):
        raise ExpressionError("tuples and lists are only allowed on the right side of `in`")
    else:
        raise ExpressionError(f"{type(node).__name__} is not allowed")


@lru_cache(maxsize=None)
def _parse(expr: str) -> tuple[ast.expr, frozenset[str]]:
    """Parse and vet `expr` once (cached: the tuner evaluates the same few expressions thousands of times)."""
    if len(expr) > _MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is {len(expr)} characters long; at most {_MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"cannot parse {_short(expr)!r}: {exc.msg}") from None
    except (RecursionError, MemoryError):  # the parser's own limits on nesting
        raise ExpressionError(f"cannot parse {_short(expr)!r}: nested too deeply") from None
    names: set[str] = set()
    _check(tree.body, names)
    return tree.body, frozenset(names)


def expression_names(expr: str) -> frozenset[str]:
    """The variable names `expr` reads; raises ExpressionError if it does not parse or is not allowed."""
    return _parse(expr)[1]


def _number(value):
    # Arithmetic is limited to numbers so that e.g. 'x' * 10**9 cannot exhaust memory.
    if not isinstance(value, (int, float)):
        raise TypeError(f"arithmetic on {value!r}, which is not a number")
    return value


def _out_of_bounds(value, what: str) -> ValueError:
    """The error for `value`, which `what` computed and which is beyond ±2**64 or not real."""
    size = "not a real number" if isinstance(value, complex) else "larger than 2**64 in magnitude"
    return ValueError(f"{what} is {size}")


def _operand(value) -> str:
    return f"({value!r})" if value < 0 else repr(value)


def _unknown(name: str):
    raise ExpressionError(f"unknown name {name!r}")


def _checked_operator(node_type: type) -> Callable:
    """`a <op> b` for the operator `node_type` as the expressions compute it: `b` a number (the caller has
    checked `a`, before evaluating `b`, in the order Python reads them), the result within ±2**64."""
    op, symbol = _BINOPS[node_type], _SYMBOLS[node_type]

    def apply(a, b):
        value = op(a, b if isinstance(b, (int, float)) else _number(b))  # no call where it is a number
        if type(value) in (int, float) and -_MAX_MAGNITUDE <= value <= _MAX_MAGNITUDE:
            return value
        raise _out_of_bounds(value, f"{_operand(a)} {symbol} {_operand(b)}")

    return apply


def _checked_function(name: str) -> Callable:
    """The allowed function `name`, whose result must be within ±2**64 (int('9' * 30) is not)."""
    function = _FUNCTIONS[name][0]

    def apply(*args):
        value = function(*args)
        if _in_bounds(value):
            return value
        raise _out_of_bounds(value, f"{name}({', '.join(_short(repr(a)) for a in args)})")

    return apply


# The only globals a compiled expression sees: no builtins, and the checked helpers that _translate calls by
# these names. An expression's own names never become Python names (they are keys of `env`), so none can
# reach a global, a builtin or the function's argument.
_COMPILED_GLOBALS: dict[str, object] = {
    "__builtins__": {}, "_number": _number, "_unknown": _unknown,
    **{f"_op_{op.__name__}": _checked_operator(op) for op in _BINOPS},
    **{f"_call_{name}": _checked_function(name) for name in _FUNCTIONS},
}


def _helper(name: str, args: list[ast.expr]) -> ast.Call:
    return ast.Call(ast.Name(name, ast.Load()), args, [])


def _translate(node: ast.expr) -> ast.expr:
    """The vetted expression `node` as a Python expression of `env` with the same value and the same errors:
    each name read from `env` (a missing one raises `unknown name`), arithmetic, `-` and calls through the
    checked helpers, and Python's own `and`, `or`, `not`, `if`/`else` and comparisons, whose semantics are
    the expressions'."""
    if isinstance(node, ast.Constant):
        return ast.Constant(node.value)
    if isinstance(node, ast.Name):
        key = ast.Constant(node.id)
        return ast.IfExp(ast.Compare(key, [ast.In()], [ast.Name("env", ast.Load())]),
                         ast.Subscript(ast.Name("env", ast.Load()), key, ast.Load()), _helper("_unknown", [key]))
    if isinstance(node, ast.BinOp):  # the left operand is checked before the right one is evaluated
        return _helper(f"_op_{type(node.op).__name__}", [_as_number(node.left), _translate(node.right)])
    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.Not):
            return ast.UnaryOp(ast.Not(), _translate(node.operand))
        return ast.UnaryOp(ast.USub(), _as_number(node.operand))  # -x of a bounded number is bounded
    if isinstance(node, ast.BoolOp):  # short-circuits, returning the deciding value, not a bool
        return ast.BoolOp(type(node.op)(), [_translate(value) for value in node.values])
    if isinstance(node, ast.Compare):
        rights = [ast.Tuple([_translate(e) for e in right.elts], ast.Load())
                  if isinstance(right, (ast.Tuple, ast.List)) else _translate(right) for right in node.comparators]
        chain = ast.Compare(_translate(node.left), [type(op)() for op in node.ops], rights)
        # A chain evaluates lazily like Python's but is always True or False, whatever `==` of a value returns.
        return ast.IfExp(chain, ast.Constant(True), ast.Constant(False))
    if isinstance(node, ast.IfExp):
        return ast.IfExp(_translate(node.test), _translate(node.body), _translate(node.orelse))
    if isinstance(node, ast.Call):
        return _helper(f"_call_{node.func.id}", [_translate(arg) for arg in node.args])
    raise AssertionError(f"unvetted node {type(node).__name__}")  # _check admits nothing else


def _as_number(node: ast.expr) -> ast.expr:
    """`node` translated, checked to be a number (_number) unless it cannot be anything else: a numeric literal,
    or arithmetic, whose result the helper checked to be an int or a float."""
    if isinstance(node, ast.BinOp) or isinstance(node, ast.Constant) and type(node.value) in (int, float, bool):
        return _translate(node)
    return _helper("_number", [_translate(node)])


@lru_cache(maxsize=None)
def _compiled(expr: str) -> Callable[[Mapping[str, object]], object]:
    """`expr`, vetted, as a function of `env` (cached): a Python function built from the translated tree, so an
    enumeration of a space's configs evaluates its expressions at native speed. The text of the file is never
    compiled, only the tree _translate builds from the vetted one."""
    return _compile_tree(_parse(expr)[0])


def _compile_tree(tree: ast.expr) -> Callable[[Mapping[str, object]], object]:
    """A vetted tree (or one whose subtrees were replaced by names, evotune.space.tables) as a function of `env`."""
    arguments = ast.arguments(posonlyargs=[], args=[ast.arg("env")], kwonlyargs=[], kw_defaults=[], defaults=[])
    function = ast.fix_missing_locations(ast.Expression(ast.Lambda(arguments, _translate(tree))))
    return eval(compile(function, "<space expression>", "eval"), _COMPILED_GLOBALS)


def safe_eval(expr: str, env: Mapping[str, object]):
    """Evaluate `expr` (the subset described in the module docstring) with the names in `env`.

    Raises ExpressionError for a disallowed construct, an unknown name or a failed operation.
    """
    evaluate = _compiled(expr)
    try:
        return evaluate(env)
    except (ArithmeticError, TypeError, ValueError) as exc:
        raise ExpressionError(str(exc)) from None
