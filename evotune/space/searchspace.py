"""Search spaces: the tunable knobs of a kernel family, read from a YAML file.

A space file names its kernel family and the parameters (each a short list of allowed values),
derived quantities computed from them, and constraints that rule out
configurations the kernel cannot run (too much shared memory, a tile that
does not split across warps, ...). Derived and constraint expressions are
written in a small subset of Python and evaluated by `safe_eval`, which vets
the syntax tree and compiles a translation of it in which every name is a key of
the evaluation's mapping and every operation a checked helper: the file's text is
never handed to eval/exec, nor can an expression reach a builtin.

Every validation error is one line, `<path>:<line>: <message>`, pointing at
the YAML node at fault. Expressions may read the parameters, the derived values,
and the context: the names the family's Problem declares (`context_names`, its
shape) plus the device limits below. Where the family declares its knobs
(`Problem.knob_domains`), a parameter must be one of them and its values ones the
template accepts. Every number an expression reads or computes stays within
±2**64, and expressions are bounded in length and depth, so no file can stall or
exhaust the tuner.

A file may start from another space, so that a variant or a subset of a family's space
states only how it differs (search_spaces/attention-small.yaml, attention-hopper.yaml):

    extends: attention        # a built-in space's name (<spaces_dir()>/attention.yaml), from any folder
    params:                   # override a knob by name (what an entry leaves out, e.g. doc, is the parent's;
      block_m: {values: [64, 128], default: 128}   # the parent's default stays where still allowed), or add one
    pin: {mma: wgmma}         # the knob keeps only that value, one of the parent's
    omit: [kv_splits]         # the knob leaves the configs (the template then uses its own default) and becomes
                              # a derived constant, first of all: the parent's default, which must be that same value
    derived: {...}            # redefine by name (in the parent's place) or add (last)
    constraints: [...]        # appended to the parent's, which all stay

`family` is still stated and must be the parent's; `description` and `variant` replace the parent's (whose
variant knob, left one value or omitted, is none). The parent may extend another in turn; a cycle is an error.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import itertools
import json
import keyword
import math
import operator
import os
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional, Iterable, Iterator, Mapping

import yaml

from .. import limits
from ..errors import EvotuneError, UsageError
from ..outputs import read_input
from ..paths import package_data_dir

# Kept under their old names for callers that import them from here; the numbers live in limits.
SMEM_LIMIT = limits.SMEM_PER_BLOCK
MAX_THREADS = limits.THREADS_PER_BLOCK
# Context names of every family: the device limits. A family adds its shape's names.
DEVICE_CONTEXT_NAMES = tuple(limits.DEVICE_LIMITS)


def device_context() -> dict:
    """The DEVICE_CONTEXT_NAMES on an H100 (evotune.limits)."""
    return dict(limits.DEVICE_LIMITS)


# The kernel families the loader knows: name -> a function returning the family's Problem (read for its
# `context_names` and `knob_domains()`). evotune.problems registers each built-in family when it is imported;
# the families import this module, so it must not import them back.
_FAMILIES: dict[str, Callable[[], object]] = {}


def register_family(name: str, problem: Callable[[], object]) -> None:
    """Make family `name` known to the loader; `problem()` returns its Problem (called only when a space needs it)."""
    _FAMILIES[name] = problem


def family_context_names(family: str) -> tuple[str, ...] | None:
    """The context names a space of `family` may read when its loader is not told them: a registered family's
    own; for a plugin family (`package.module:ATTR`, not imported here) None, meaning any name, checked when
    evaluated; for any other family every registered family's names."""
    if family in _FAMILIES:
        return tuple(_FAMILIES[family]().context_names)
    if ":" in family:
        return None
    if not _FAMILIES:  # checking against no names at all would call every shape name unknown
        raise EvotuneError(f"no kernel family is registered to check the names of a {family!r} space against: "
                           f"import evotune.problems first, or pass the context names")
    return tuple(dict.fromkeys(n for problem in _FAMILIES.values() for n in problem().context_names))


def family_knob_domains(family: str) -> Mapping[str, tuple | range] | None:
    """The knobs a space of `family` may have, with their allowed values, when its loader is not told them:
    a registered family's `knob_domains()`; None (not checked) for any other family, plugins included."""
    return _FAMILIES[family]().knob_domains() if family in _FAMILIES else None


def __getattr__(name: str):
    # The attention family's CONTEXT_NAMES and shape_context() lived here before families owned their shapes;
    # old imports of them reach the family through the registry.
    if name in ("CONTEXT_NAMES", "shape_context") and "attention" in _FAMILIES:
        attention = _FAMILIES["attention"]()
        return attention.context_names if name == "CONTEXT_NAMES" else attention.context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


TOP_KEYS = ("family", "extends", "description", "params", "pin", "omit", "derived", "constraints", "variant")
PARAM_KEYS = ("values", "default", "doc")
CONSTRAINT_KEYS = ("expr", "why")

# Bounds `**` so that an expression cannot stall the tuner computing a huge integer.
_MAX_EXPONENT = 64
# Every number a space's expressions read or compute lies within ±_MAX_MAGNITUDE: with bounded operands
# each operation is quick, where nested powers of unbounded ones took minutes.
_MAX_MAGNITUDE = 2**64
# An expression's length and nesting: the shipped ones are at most 165 characters and 8 deep.
_MAX_EXPRESSION_CHARS = 1000
_MAX_EXPRESSION_DEPTH = 64
# A space file's size and YAML nesting: the shipped ones are under 6 KB and 4 deep.
_MAX_FILE_BYTES = 1 << 20
_MAX_YAML_NESTING = 32
# Explicit YAML tags a space file may carry: the plain types (no python/*, binary, set, ...).
_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq"))


# --------------------------------------------------------------------------- expressions


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
    tree, _ = _parse(expr)
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


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class Param:
    """One knob: its allowed values in order, a default among them, and a line of documentation."""

    name: str
    values: tuple
    doc: str
    default: object
    line: int


@dataclass(frozen=True)
class Constraint:
    """A boolean expression every admitted configuration satisfies, and why it must."""

    expr: str
    why: str
    line: int


@dataclass(frozen=True)
class Config:
    """One point of a space: a frozen, hashable mapping from parameter name to value."""

    items: tuple[tuple[str, object], ...]

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "Config":
        return cls(tuple(sorted(d.items())))

    def __getitem__(self, name: str):
        for key, value in self.items:
            if key == name:
                return value
        raise KeyError(name)

    def get(self, name: str, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def keys(self) -> list[str]:
        return [key for key, _ in self.items]

    def as_dict(self) -> dict:
        return dict(self.items)

    def key(self) -> str:
        """Short stable spelling, e.g. `block_m=64,block_n=64,...` (names sorted)."""
        return ",".join(f"{k}={v}" for k, v in self.items)

    def digest(self) -> str:
        """12 hex digits identifying the configuration (for file names and caches)."""
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:12]


def _same_value(a, b) -> bool:
    # Type-strict: True == 1 in Python, but a bool knob must not accept 1 nor an int knob True.
    return type(a) is type(b) and a == b


def _fmt(values) -> str:
    return ", ".join(map(str, values))


@dataclass(frozen=True)
class SearchSpace:
    """The parameters of a kernel family, the quantities derived from them, and the constraints on both."""

    family: str
    path: str
    description: str
    params: tuple[Param, ...]
    derived: tuple[tuple[str, str, int], ...]
    constraints: tuple[Constraint, ...]
    # The knob that selects a kernel variant (e.g. attention's mma), or None. The steered sampler draws
    # its value uniformly before the other knobs, so a variant that the constraints leave few admitted
    # configs is proposed as often as one with many.
    variant: Optional[str] = None
    # The space this one extends, or None: its derived values and constraints are stated in that file.
    parent: Optional["SearchSpace"] = None

    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    def size(self) -> int:
        """Number of configurations before constraints."""
        n = 1
        for p in self.params:
            n *= len(p.values)
        return n

    def default_config(self) -> Config:
        return Config.from_dict({p.name: p.default for p in self.params})

    def config(self, d: Mapping[str, object]) -> Config:
        """A Config from `d`; parameters it leaves out take their defaults. Raises UsageError on an unknown name or value."""
        by_name = {p.name: p for p in self.params}
        for name, value in d.items():
            if name not in by_name:
                raise UsageError(f"{self.family}: unknown parameter {name!r}; parameters: {_fmt(by_name)}")
            param = by_name[name]
            if not any(_same_value(value, v) for v in param.values):
                raise UsageError(
                    f"{self.family}: {name}={value!r} is not allowed; allowed: {_fmt(param.values)}"
                )
        return Config.from_dict({p.name: d.get(p.name, p.default) for p in self.params})

    def derive(self, cfg: Config, context: Mapping[str, object]) -> dict:
        """Context, parameters and derived values together (derived ones computed in file order)."""
        env = {**context, **cfg.as_dict()}
        for name, expr, line in self.derived:
            env[name] = self._eval(expr, env, line, name)
        return env

    def violations(self, cfg: Config, context: Mapping[str, object]) -> list[str]:
        """`why (expr)` for each constraint `cfg` fails under `context`; empty when it is admitted."""
        env = self.derive(cfg, context)
        return [f"{c.why} ({c.expr})" for c in self.constraints if not self._eval(c.expr, env, c.line, "constraint")]

    def admitted(self, cfg: Config, context: Mapping[str, object]) -> bool:
        return not self.violations(cfg, context)

    def all_configs(self) -> Iterator[Config]:
        """Every configuration, in the order of the file's parameters and values (the last parameter varies fastest)."""
        names = self.param_names()
        for combo in itertools.product(*(p.values for p in self.params)):
            yield Config.from_dict(dict(zip(names, combo)))

    def admitted_configs(self, context: Mapping[str, object]) -> list[Config]:
        """The configs `admitted` under `context`, in all_configs' order, found by a depth-first walk that drops
        a whole subtree at the first constraint it fails (_Enumeration). An expression that fails to evaluate
        for any config raises the error this naive loop would: [c for c in all_configs() if admitted(c)]."""
        return _Enumeration(self).admitted(context)

    def _eval(self, expr: str, env: Mapping[str, object], line: int, what: str):
        try:
            return safe_eval(expr, env)
        except ExpressionError as exc:
            raise UsageError(f"{self._file_stating(expr, line)}:{line}: {what}: {_short(expr)}: {exc}") from None

    def _file_stating(self, expr: str, line: int) -> str:
        """The file whose line `line` states `expr`: for a derived value or constraint inherited from an
        extended space, that space's."""
        space = self
        while space.parent is not None and (expr, line) in space.parent._stated():
            space = space.parent
        return space.path

    def _stated(self) -> set[tuple[str, int]]:
        return {(expr, line) for _, expr, line in self.derived} | {(c.expr, c.line) for c in self.constraints}


# `next` of an exhausted iterator of a parameter's values, in the walk.
_EXHAUSTED = object()

# Bounds of an enumeration, so that no space file can exhaust the memory or stall the tuner (counted, not timed).
# attention.yaml on the mission shape: 2.0 M steps of the walk (~10 s on a 2-core CI machine), 114,080 admitted
# configs of ~1.7 KB each (25 knobs).
MAX_ADMITTED = 1_000_000
MAX_ENUMERATION_STEPS = 50_000_000


def _too_many_steps(space: "SearchSpace") -> UsageError:
    return UsageError(f"{space.path}: enumerating its {space.size():,} configs takes more than "
                      f"{MAX_ENUMERATION_STEPS:,} steps on this shape; add constraints, or pin or omit knobs")


def _too_many_admitted(space: "SearchSpace") -> UsageError:
    return UsageError(f"{space.path}: admits more than {MAX_ADMITTED:,} configs on this shape (of {space.size():,}), "
                      f"more than evotune holds in memory; add constraints, or pin or omit knobs")


@dataclass(frozen=True)
class _Step:
    """A derived value or a constraint, compiled, with what it depends on in the walk."""

    name: Optional[str]  # the derived value's name; None for a constraint
    evaluate: Callable[[Mapping[str, object]], object]  # raw: errors are not wrapped into UsageError
    params: tuple[int, ...]  # the parameters it reads, directly or through derived values (indices, ascending)
    chain: tuple[int, ...]  # the derived values it reads, directly or through others (indices, in file order)

    @property
    def level(self) -> int:
        """How many parameters must be bound before it can be evaluated."""
        return self.params[-1] + 1 if self.params else 0


def _steps(space: SearchSpace) -> tuple[list[_Step], list[_Step]] | None:
    """The space's derived values and constraints as _Steps, or None where a name in them could mean another
    value in the walk's shared mapping than in `derive`'s (a derived value reading a later one's name, which then
    means the context's; a name used twice) or an expression does not compile: those spaces take the naive loop."""
    params = {name: i for i, name in enumerate(space.param_names())}
    derived_names = [name for name, _, _ in space.derived]
    if len(params) < len(space.params) or len(set(derived_names)) < len(derived_names) or \
            set(derived_names) & params.keys():
        return None
    seen: dict[str, int] = {}  # derived name -> index, of those before the one being read
    derived: list[_Step] = []

    def step(name: Optional[str], expr: str) -> _Step | None:
        reads, chain = set(), set()
        for read in expression_names(expr):
            if read in seen:
                reads.update(derived[seen[read]].params)
                chain.update((seen[read],) + derived[seen[read]].chain)
            elif read in params:
                reads.add(params[read])
            elif read in derived_names:  # a later derived value's name: the context's value, in derive()
                return None
        return _Step(name, _compiled(expr), tuple(sorted(reads)), tuple(sorted(chain)))

    try:
        for i, (name, expr, _) in enumerate(space.derived):
            derived.append(step(name, expr))
            if derived[-1] is None:
                return None
            seen[name] = i
        constraints = [step(None, c.expr) for c in space.constraints]
    except ExpressionError:  # a space built without the loader: the naive loop reports it with file and line
        return None
    return derived, constraints


@dataclass
class _Scan:
    """What evaluating every step once per combination of the parameters it reads found."""

    # The first config (value indices) at which the naive loop raises, or None where no expression fails.
    failure: Optional[tuple[int, ...]]
    # Per constraint: (how many configs of the whole space fail it, the first such config's value indices).
    falsy: list[tuple[int, Optional[tuple[int, ...]]]]


class _Enumeration:
    """A space's admitted configs by a depth-first walk in all_configs' order (last parameter fastest) that
    evaluates each derived value and constraint as soon as the parameters it reads are bound, and leaves out
    a whole subtree at the first constraint it fails.

    Errors: the naive loop computes every derived value and constraint of every config, so an expression that
    fails for a config raises even where another constraint rejects it. The walk skips rejected subtrees, so a
    scan first evaluates each expression once per combination of the parameters it reads (a few thousand
    evaluations for the built-in spaces): where one fails, the config the naive loop would have raised at (the
    first whose combination fails) is evaluated the naive way, which raises that same error."""

    def __init__(self, space: SearchSpace):
        self.space = space
        self.names = space.param_names()
        self.values = [p.values for p in space.params]
        steps = _steps(space)
        self.derived, self.constraints = steps if steps is not None else (None, None)

    def admitted(self, context: Mapping[str, object]) -> list[Config]:
        if self.derived is None:
            return self.naive(context)
        failure = self.scan(context).failure
        if failure is not None:
            self.space.violations(self.config_at(failure), context)  # raises the naive loop's error
            return self.naive(context)  # an expression failed once and not again (no memory?): as the naive loop
        return self.walk(context)

    def naive(self, context: Mapping[str, object]) -> list[Config]:
        if self.space.size() > MAX_ENUMERATION_STEPS:
            raise _too_many_steps(self.space)
        admitted = []
        for cfg in self.space.all_configs():
            if self.space.admitted(cfg, context):
                admitted.append(cfg)
                if len(admitted) > MAX_ADMITTED:
                    raise _too_many_admitted(self.space)
        return admitted

    def first_admitted(self, context: Mapping[str, object], scan: _Scan) -> Optional[Config]:
        """The first admitted config, or None; raises where a naive loop that stops at the first admitted config
        does: at the first config where an expression fails, if that comes before it.

        Where the walk fails at a combination, every config before that combination's first one was rejected,
        and the naive loop fails at or before that one: at scan.failure."""
        try:
            found = self.walk(context, first_only=True)
        except Exception:
            if scan.failure is None:
                raise
            found = []
        if found and (scan.failure is None or self.indices_of(found[0]) < scan.failure):
            return found[0]
        if scan.failure is not None:
            self.space.violations(self.config_at(scan.failure), context)  # raises the naive loop's error
        return None

    def config_at(self, indices: tuple[int, ...]) -> Config:
        return Config.from_dict({name: values[i] for name, values, i in zip(self.names, self.values, indices)})

    def indices_of(self, cfg: Config) -> tuple[int, ...]:
        return tuple(values.index(cfg[name]) for name, values in zip(self.names, self.values))

    def walk(self, context: Mapping[str, object], first_only: bool = False) -> list[Config]:
        """The admitted configs in order (only the first with `first_only`); every expression must evaluate.

        One mapping holds the context and the current path's values: a step reads only the context and the
        parameters and derived values it depends on, which are bound (and current) at its level."""
        n = len(self.names)
        steps_at = self.schedule()
        env = {**context}
        for name, evaluate in steps_at[0]:
            if name is not None:
                env[name] = evaluate(env)
            elif not evaluate(env):
                return []
        if n == 0:
            return [Config.from_dict({})]
        admitted: list[Config] = []
        path = [None] * n
        pending = [iter(self.values[0])]  # per bound level, the values still to try
        steps = 0
        while pending:
            level = len(pending)
            value = next(pending[-1], _EXHAUSTED)
            if value is _EXHAUSTED:
                pending.pop()
                continue
            steps += 1
            if steps > MAX_ENUMERATION_STEPS:
                raise _too_many_steps(self.space)
            path[level - 1] = env[self.names[level - 1]] = value
            for name, evaluate in steps_at[level]:
                if name is not None:
                    env[name] = evaluate(env)
                elif not evaluate(env):
                    break  # rejected: so is every config below
            else:
                if level < n:
                    pending.append(iter(self.values[level]))
                    continue
                admitted.append(Config.from_dict(dict(zip(self.names, path))))
                if first_only:
                    break
                if len(admitted) > MAX_ADMITTED:
                    raise _too_many_admitted(self.space)
        return admitted

    def schedule(self) -> list[list[tuple[Optional[str], Callable]]]:
        """Per level (parameters bound), the (derived name, or None for a constraint; function) to evaluate there:
        the level's derived values in file order, each constraint right after the last of them it reads, so that
        a config is rejected before the derived values it does not need are computed."""
        def last_read(step: _Step) -> int:  # the last derived value of its own level that `step` reads, or -1
            return max((j for j in step.chain if self.derived[j].level == step.level), default=-1)

        steps_at: list[list[_Step]] = []
        for level in range(len(self.names) + 1):
            checks = [step for step in self.constraints if step.level == level]
            steps_at.append([step for step in checks if last_read(step) == -1])
            for j, step in enumerate(self.derived):
                if step.level == level:
                    steps_at[level] += [step] + [check for check in checks if last_read(check) == j]
        return [[(step.name, step.evaluate) for step in steps] for steps in steps_at]

    def scan(self, context: Mapping[str, object]) -> _Scan:
        """Evaluate each step, with the derived values it reads, once per combination of the parameters it reads,
        in all_configs' order: where it fails, the naive loop fails first at that combination's first config."""
        failures, falsy = [], []
        work = 0
        for step in self.derived + self.constraints:
            env = {**context}
            work += math.prod(len(self.values[i]) for i in step.params)
            if work > MAX_ENUMERATION_STEPS:
                raise _too_many_steps(self.space)
            combos = itertools.product(*(self.values[i] for i in step.params))
            count, first = 0, None
            for k, combo in enumerate(combos):
                env.update(zip((self.names[i] for i in step.params), combo))
                try:
                    for j in step.chain:
                        env[self.derived[j].name] = self.derived[j].evaluate(env)
                    value = step.evaluate(env)
                    fails = step.name is None and not value  # as violations() reads a constraint's value
                except Exception:  # whatever the naive loop would raise there, it raises when evaluated again
                    failures.append(self.indices(step.params, k))
                    break
                if fails:
                    count, first = count + 1, first if first is not None else k
            if step.name is None:
                free = 1
                for i, values in enumerate(self.values):
                    free *= 1 if i in step.params else len(values)
                falsy.append((count * free, None if first is None else self.indices(step.params, first)))
        return _Scan(min(failures) if failures else None, falsy)

    def indices(self, params: tuple[int, ...], k: int) -> tuple[int, ...]:
        """The value indices of the first config with the `k`-th combination (last fastest) of `params`' values."""
        indices = [0] * len(self.names)
        for i in reversed(params):
            k, indices[i] = divmod(k, len(self.values[i]))
        return tuple(indices)

    def commonest_violation(self, scan: _Scan) -> Optional[str]:
        """The violation the naive loop over every config would count most often (`why (expr)`, as violations()
        spells it), the first one it met among equals; None when no constraint fails."""
        counts: dict[str, int] = {}
        first_met: dict[str, tuple] = {}
        for position, (constraint, (count, first)) in enumerate(zip(self.space.constraints, scan.falsy)):
            if count:
                reason = f"{constraint.why} ({constraint.expr})"
                counts[reason] = counts.get(reason, 0) + count
                first_met[reason] = min(first_met.get(reason, (first, position)), (first, position))
        return max(sorted(counts, key=first_met.__getitem__), key=counts.__getitem__, default=None)


# check_nonempty first tries this many configs the naive way: most spaces admit one of them, sooner than a scan.
_NAIVE_FIRST = 256


def check_nonempty(space: SearchSpace, context: Mapping[str, object]) -> None:
    """Raise UsageError when no configuration of `space` is admitted under `context`, naming the commonest reason.

    As the naive loop at the end, which stops at the first admitted config; past its first _NAIVE_FIRST configs,
    by the walk and the scan of _Enumeration, which count each constraint's failures without visiting every
    config (all of them fail when none is admitted)."""
    for cfg in itertools.islice(space.all_configs(), _NAIVE_FIRST):
        if not space.violations(cfg, context):
            return
    enumeration = _Enumeration(space)
    if enumeration.derived is not None:
        scan = enumeration.scan(context)
        if enumeration.first_admitted(context, scan) is not None:
            return
        if scan.failure is None:
            raise _nothing_admitted(space, context, enumeration.commonest_violation(scan))
    # A space the walk cannot take, or an expression that failed once and not again: the naive loop decides.
    if space.size() > MAX_ENUMERATION_STEPS:
        raise _too_many_steps(space)
    reasons: Counter[str] = Counter()
    for cfg in space.all_configs():
        failed = space.violations(cfg, context)
        if not failed:
            return
        reasons.update(failed)
    raise _nothing_admitted(space, context, reasons.most_common(1)[0][0] if reasons else None)


def _nothing_admitted(space: SearchSpace, context: Mapping[str, object], commonest: Optional[str]) -> UsageError:
    summary = ", ".join(f"{k}={v}" for k, v in context.items())
    most_often = f"; most often failed: {commonest}" if commonest else ""
    return UsageError(f"{space.path}: no configuration is admitted for {summary}{most_often}")


# --------------------------------------------------------------------------- loading


class _Reader:
    """Builds a SearchSpace from the composed YAML node tree, so each error can name its node's line."""

    def __init__(self, path: str, context_names: Iterable[str] | None = None,
                 knob_domains: Mapping[str, tuple | range] | None = None, extended_by: tuple[str, ...] = ()):
        self.path = path
        self.context_names = None if context_names is None else tuple(context_names)
        self.knob_domains = knob_domains
        self.extended_by = extended_by  # the files that extend this one, outermost first (to refuse cycles)
        self.any_context = False  # set by space(): True where the context names are not known
        self.constructor = yaml.constructor.SafeConstructor()

    def fail(self, node: yaml.Node, message: str):
        raise UsageError(f"{self.path}:{node.start_mark.line + 1}: {message}")

    def mapping(self, node: yaml.Node, what: str, allowed: tuple[str, ...] | None = None):
        """(key, key node, value node) triples of a mapping node; rejects duplicate and, given `allowed`, unknown keys."""
        if not isinstance(node, yaml.MappingNode):
            self.fail(node, f"{what} must be a mapping")
        seen: set[str] = set()
        entries = []
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                self.fail(key_node, f"keys of {what} must be names")
            key = key_node.value
            if key in seen:
                self.fail(key_node, f"duplicate key {key!r} in {what}")
            if allowed is not None and key not in allowed:
                self.fail(key_node, f"unknown key {key!r} in {what}; allowed: {_fmt(allowed)}")
            seen.add(key)
            entries.append((key, key_node, value_node))
        return entries

    def scalar(self, node: yaml.Node, what: str):
        if not isinstance(node, yaml.ScalarNode):
            self.fail(node, f"{what} must be a single value")
        try:
            return self.constructor.construct_object(node)
        except (ValueError, OverflowError) as exc:  # an int of over 4300 digits, a date like 2024-13-45
            self.fail(node, f"cannot read {what} {_short(node.value)!r}: {str(exc).split(';')[0]}")

    def string(self, node: yaml.Node, what: str) -> str:
        value = self.scalar(node, what)
        if not isinstance(value, str):
            self.fail(node, f"{what} must be text, got {value!r}")
        return value

    def expression(self, node: yaml.Node, what: str, known: set[str]) -> str:
        if not isinstance(node, yaml.ScalarNode) or not node.value.strip():
            self.fail(node, f"{what} must be an expression")
        expr = node.value  # the raw text: `x: 4` is the expression "4", not the int 4
        try:
            unknown = sorted(expression_names(expr) - known)
        except ExpressionError as exc:
            self.fail(node, f"{what}: {exc}")
        if unknown and not self.any_context:  # with any context, an unknown name fails when evaluated
            self.fail(node, f"{what}: unknown name {unknown[0]!r} in {_short(expr)!r}")
        return expr

    def new_name(self, node: yaml.Node, name: str, what: str, taken: Mapping[str, str]) -> None:
        """Check that `name` can be used in expressions and does not hide anything else they can use."""
        if not name.isidentifier() or keyword.iskeyword(name):
            self.fail(node, f"{what} name {name!r} is not a valid identifier")
        if name in taken:
            self.fail(node, f"{what} {name!r} shadows {taken[name]}")

    def top(self, root: yaml.Node | None) -> dict:
        """The top-level mapping's value nodes by key, with the required keys present."""
        if root is None:
            raise UsageError(f"{self.path}:1: empty file; expected a mapping with {_fmt(TOP_KEYS)}")
        if not isinstance(root, yaml.MappingNode):
            self.fail(root, f"the top level must be a mapping with {_fmt(TOP_KEYS)}")
        top = {key: value for key, _, value in self.mapping(root, "the top level", TOP_KEYS)}
        # A space that extends another takes its params from there.
        for required in ("family",) if "extends" in top else ("family", "params"):
            if required not in top:
                self.fail(root, f"missing top-level key {required!r}")
        return top

    def space(self, root: yaml.Node | None) -> SearchSpace:
        top = self.top(root)
        parent = self.parent(top["extends"]) if "extends" in top else None
        family = self.string(top["family"], "family")
        if parent is not None and family != parent.family:
            self.fail(top["family"], f"family {family!r} is not {parent.family!r}, the family of the space it "
                                     f"extends ({parent.path})")
        description = self.string(top["description"], "description") if "description" in top else \
            (parent.description if parent else "")

        names = self.context_names if self.context_names is not None else family_context_names(family)
        self.any_context = names is None
        context = tuple(DEVICE_CONTEXT_NAMES) + tuple(names or ())
        # `taken`: names a parameter or derived value may not reuse, and why; `known`: names expressions may read.
        taken = {name: "a context name" for name in context}
        taken.update({name: "a function" for name in _FUNCTIONS})
        taken.update({name: "a derived name" for name, _, _ in (parent.derived if parent else ())})
        known = set(context)

        params, omitted = self.all_params(top, parent, taken, family)
        taken.update({p.name: "a parameter" for p in params})
        taken.update({name: "an omitted parameter" for name, _, _ in omitted})
        known.update(p.name for p in params)
        derived = self.derived(top.get("derived"), omitted, parent, taken, known)
        constraints = (parent.constraints if parent else ()) + \
            (() if _is_empty(top.get("constraints")) else tuple(self.constraints(top["constraints"], known)))
        variant = self.variant(top.get("variant"), params, parent)
        return SearchSpace(family, self.path, description, tuple(params), tuple(derived), constraints, variant,
                           parent)

    def parent(self, node: yaml.Node) -> SearchSpace:
        """The space `extends:` names: a built-in space (`<spaces_dir()>/<name>.yaml`), read as this file is."""
        name = self.string(node, "extends")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) or name.endswith((".yaml", ".yml")):
            self.fail(node, f"extends {_short(name)!r}: write a built-in space name, such as attention (not a path)")
        path = spaces_dir() / f"{name}.yaml"
        if not path.is_file():
            self.fail(node, f"extends {name!r}: no such built-in space; available: "
                            f"{_fmt(builtin_names()) or 'none'} (in {spaces_dir()})")
        chain = self.extended_by + (self.path,)
        if any(Path(p).resolve() == path.resolve() for p in chain):
            self.fail(node, f"extends {name!r} makes a cycle: {' -> '.join(chain + (str(path),))}")
        return _read(path, lambda reader, root: reader.space(root), self.context_names, self.knob_domains, chain)

    def all_params(self, top: dict, parent: SearchSpace | None, taken: Mapping[str, str],
                   family: str) -> tuple[list[Param], list[tuple[str, str, int]]]:
        """The parameters (the parent's, in order, as this file overrides, pins and omits them, then its own new
        ones), and the omitted ones as derived constants."""
        own = [] if parent is not None and _is_empty(top.get("params")) else self.params(top["params"], taken, parent)
        domains = self.knob_domains if self.knob_domains is not None else family_knob_domains(family)
        if domains is not None and own:
            self.check_knobs(top["params"], own, family, domains)
        if parent is None:
            for key in ("pin", "omit"):
                if key in top:
                    self.fail(top[key], f"{key}: only a space that extends another can {key} its knobs")
            return own, []
        merged = {p.name: p for p in parent.params}
        merged.update({p.name: p for p in own})  # an override keeps the parent's place; a new knob comes last
        pins = [] if _is_empty(top.get("pin")) else self.pins(top["pin"], parent, own)
        merged.update({p.name: p for p in pins})
        omitted = [] if _is_empty(top.get("omit")) else self.omitted(top["omit"], parent, own + pins)
        for name, _, _ in omitted:
            del merged[name]
        if not merged:
            self.fail(top["omit"], "omit leaves no parameter; a space needs at least one")
        return list(merged.values()), omitted

    def params(self, node: yaml.Node, taken: Mapping[str, str], parent: SearchSpace | None = None) -> list[Param]:
        """The parameters under `node`; one that the extended space `parent` has takes what `node` leaves out of
        it (values, default, doc) from there."""
        if _is_empty(node):
            self.fail(node, "params is empty; a space needs at least one parameter")
        inherited = {p.name: p for p in parent.params} if parent else {}
        params = []
        for name, key_node, value_node in self.mapping(node, "params"):
            base = inherited.get(name)
            if base is None:
                self.new_name(key_node, name, "parameter", taken)
            what = f"parameter {name!r}"
            fields = {key: value for key, _, value in self.mapping(value_node, what, PARAM_KEYS)}
            if "values" not in fields and base is None:
                self.fail(key_node, f"{what} has no `values`")
            values = self.values(fields["values"], what) if "values" in fields else base.values
            if "default" in fields:
                default = self.scalar(fields["default"], f"default of {what}")
                if not any(_same_value(default, v) for v in values):
                    self.fail(fields["default"], f"default {default!r} of {what} is not one of {_fmt(values)}")
            elif base is None:
                default = values[0]
            elif any(_same_value(base.default, v) for v in values):
                default = base.default
            else:
                self.fail(fields["values"], f"default {base.default!r} of {what} in {parent.path} is not one of "
                                            f"{_fmt(values)}; give a default")
            doc = self.string(fields["doc"], f"doc of {what}") if "doc" in fields else (base.doc if base else "")
            params.append(Param(name, values, doc, default, key_node.start_mark.line + 1))
        return params

    def pins(self, node: yaml.Node, parent: SearchSpace, overridden: list[Param]) -> list[Param]:
        """The parent's knobs that `pin:` leaves one value each, one of the parent's values."""
        inherited = {p.name: p for p in parent.params}
        pinned = []
        for name, key_node, value_node in self.mapping(node, "pin"):
            if any(p.name == name for p in overridden):
                self.fail(key_node, f"pin {name!r}: the knob is also under params; pin it or override it, not both")
            if name not in inherited:
                self.fail(key_node, f"pin {name!r}: {parent.path} has no parameter {name!r}; "
                                    f"its parameters: {_fmt(inherited)}")
            value = self.scalar(value_node, f"pin of {name!r}")
            base = inherited[name]
            if not any(_same_value(value, v) for v in base.values):
                self.fail(value_node, f"pin {name!r}: {value!r} is not one of its values in {parent.path}: "
                                      f"{_fmt(base.values)}")
            pinned.append(Param(name, (value,), base.doc, value, key_node.start_mark.line + 1))
        return pinned

    def omitted(self, node: yaml.Node, parent: SearchSpace, kept: list[Param]) -> list[tuple[str, str, int]]:
        """The knobs `omit:` names, which leave the configs, as derived constants (name, the parent's default, line):
        derived rather than a new kind of name, so what reads a space's derived values needs nothing more."""
        if not isinstance(node, yaml.SequenceNode):
            self.fail(node, "omit must be a list of parameter names")
        inherited = {p.name: p for p in parent.params}
        omitted: dict[str, tuple[str, str, int]] = {}
        for item in node.value:
            name = self.string(item, "a name under omit")
            if name not in inherited:
                self.fail(item, f"omit {name!r}: {parent.path} has no parameter {name!r}; "
                                f"its parameters: {_fmt(inherited)}")
            if any(p.name == name for p in kept):
                self.fail(item, f"omit {name!r}: the knob is also pinned or under params: omit it or keep it")
            if name in omitted:
                self.fail(item, f"omit {name!r}: named twice")
            omitted[name] = (name, repr(inherited[name].default), item.start_mark.line + 1)
            try:
                expression_names(omitted[name][1])
            except ExpressionError as exc:  # a string default too long to be an expression
                self.fail(item, f"omit {name!r}: its default cannot be a derived constant: {exc}")
        return list(omitted.values())

    def derived(self, node: yaml.Node | None, omitted: list[tuple[str, str, int]], parent: SearchSpace | None,
                taken: dict[str, str], known: set[str]) -> list[tuple[str, str, int]]:
        """The derived values in evaluation order: the knobs this file omits (the parent's expressions read them),
        the parent's (one this file redefines keeps its place, so it reads only the names before it), then this
        file's new ones."""
        merged = {entry[0]: entry for entry in omitted + list(parent.derived if parent else ())}
        # What this file may redefine: the parent's derived values, each with the names before it.
        before = {name: set(list(merged)[:i]) for i, name in enumerate(merged) if i >= len(omitted)}
        known.update(merged)
        for name, key_node, value_node in ([] if _is_empty(node) else self.mapping(node, "derived")):
            if name in before:
                visible = (known - merged.keys()) | before[name]
            else:
                self.new_name(key_node, name, "derived", taken)
                visible = known
            expr = self.expression(value_node, f"derived {name!r}", visible)
            merged[name] = (name, expr, key_node.start_mark.line + 1)
            taken[name] = "a derived name"
            known.add(name)
        return list(merged.values())

    def variant(self, node: yaml.Node | None, params: list[Param], parent: SearchSpace | None) -> str | None:
        """The variant knob this file names, else the parent's where this file leaves it more than one value."""
        by_name = {p.name: p for p in params}
        if node is not None:
            variant = self.string(node, "variant")
            if variant not in by_name:
                self.fail(node, f"variant {variant!r} is not a parameter")
            return variant
        inherited = parent.variant if parent else None
        # Pinned or omitted, the knob selects nothing any more.
        return inherited if inherited in by_name and len(by_name[inherited].values) > 1 else None

    def check_knobs(self, node: yaml.Node, params: list[Param], family: str, domains: Mapping) -> None:
        """Each parameter is a knob the family's template reads, and each value this file lists one the template
        accepts."""
        nodes = {name: value_node for name, _, value_node in self.mapping(node, "params")}
        for param in params:
            if param.name not in domains:
                near = difflib.get_close_matches(param.name, list(domains), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise UsageError(f"{self.path}:{param.line}: parameter {param.name!r} is not a knob of the {family} "
                                 f"family (its knobs: {_fmt(domains)}){hint}")
            domain = domains[param.name]
            fields = {key: value for key, _, value in self.mapping(nodes[param.name], "parameter")}
            listed = fields["values"].value if "values" in fields else ()  # values an override inherits were checked
            for value, item in zip(param.values, listed):
                if not _in_domain(value, domain):
                    self.fail(item, f"{value!r} is not a value of knob {param.name!r} that the {family} template "
                                    f"accepts: {_describe(domain)}")

    def values(self, node: yaml.Node, what: str) -> tuple:
        if not isinstance(node, yaml.SequenceNode):
            self.fail(node, f"values of {what} must be a list")
        if not node.value:
            self.fail(node, f"values of {what} is empty")
        values: list = []
        for item in node.value:
            value = self.scalar(item, f"a value of {what}")
            if type(value) not in (int, str, bool):
                self.fail(item, f"values of {what} must be integers, strings or booleans, got {value!r}")
            if type(value) is int and not _in_bounds(value):
                self.fail(item, f"a value of {what} is larger than 2**64 in magnitude")
            if values and type(value) is not type(values[0]):
                self.fail(item, f"values of {what} mix {type(values[0]).__name__} and {type(value).__name__}")
            if value in values:
                self.fail(item, f"duplicate value {value!r} in {what}")
            values.append(value)
        return tuple(values)

    def constraints(self, node: yaml.Node, known: set[str]) -> list[Constraint]:
        if not isinstance(node, yaml.SequenceNode):
            self.fail(node, "constraints must be a list of {expr, why} mappings")
        constraints = []
        for item in node.value:
            fields = {key: value for key, _, value in self.mapping(item, "a constraint", CONSTRAINT_KEYS)}
            for required in CONSTRAINT_KEYS:
                if required not in fields:
                    self.fail(item, f"constraint has no `{required}`")
            expr = self.expression(fields["expr"], "constraint", known)
            why = self.string(fields["why"], "why of a constraint")
            constraints.append(Constraint(expr, why, fields["expr"].start_mark.line + 1))
        return constraints


def config_fault(d: Mapping[str, object], domains: Mapping[str, tuple | range] | None) -> str | None:
    """What makes the knob values `d` (a recorded config) not a config of a family whose knobs are `domains`
    (Problem.knob_domains; None: undeclared, nothing checked), in a few words; None if nothing. Knobs it leaves
    out are fine: the template uses their defaults."""
    if domains is None:
        return None
    for name, value in d.items():
        if name not in domains:
            return f"{_short(str(name), 40)!r} is not a knob of this family"
        if not _in_domain(value, domains[name]):
            return f"{name}={_short(repr(value), 40)} is not {_describe(domains[name])}"
    return None


def _in_domain(value, domain) -> bool:
    """`value` is in `domain` (a tuple, or a range of ints), type-strictly: True is not 1."""
    if isinstance(domain, range):
        return type(value) is int and value in domain
    return any(_same_value(value, v) for v in domain)


def _describe(domain) -> str:
    """A domain in words, e.g. `one of plain, pad, swizzle` or `an integer from 0 to 4`."""
    if not isinstance(domain, range):  # in YAML's spelling: true and false
        return "one of " + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in domain)
    last = domain[-1]
    if domain.step == 1:
        return f"an integer from {domain.start} to {last}"
    return f"a multiple of {domain.step} from {domain.start} to {last}" if domain.start % domain.step == 0 else \
        f"an integer from {domain.start} to {last} in steps of {domain.step}"


def _is_empty(node: yaml.Node | None) -> bool:
    """True for an absent section, a bare `key:` (null) and an empty `{}` or `[]`."""
    if node is None:
        return True
    if isinstance(node, yaml.ScalarNode):
        return node.tag == "tag:yaml.org,2002:null"
    return not node.value


def load_space(path: str | os.PathLike, context_names: Iterable[str] | None = None,
               knob_domains: Mapping[str, tuple | range] | None = None) -> SearchSpace:
    """Read and validate a search-space YAML file; raises UsageError `<path>:<line>: <message>` on any problem.

    Expressions may read `context_names` (the family Problem's context, without the device
    limits, which are always there); by default those `family_context_names` gives the file's family.
    The parameters must be knobs of `knob_domains` (a Problem's `knob_domains()`) with values in
    their domains; by default those `family_knob_domains` gives (a plugin's are not checked then).
    A space the file extends is read with the same names and domains.
    """
    return _read(path, lambda reader, root: reader.space(root), context_names, knob_domains)


def space_family(path: str | os.PathLike) -> str:
    """The family a search-space file names (read before its Problem, which knows the context names, is loaded)."""
    return _read(path, lambda reader, root: reader.string(reader.top(root)["family"], "family"))


def _read(path, parse, context_names=None, knob_domains=None, extended_by=()):
    path = str(path)
    try:  # bounded as read (not as stat says), and never a FIFO or a device (outputs.read_input)
        text = read_input(path, "space file", _MAX_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: cannot read: {exc}") from None
    reader = _Reader(path, context_names, knob_domains, extended_by)
    try:
        _vet_yaml(path, text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        return parse(reader, root)
    except yaml.MarkedYAMLError as exc:  # syntax errors, and unsupported tags met while constructing values
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(str(exc.problem or exc.context).split())
        where = f"{path}:{mark.line + 1}" if mark else path
        raise UsageError(f"{where}: YAML error: {message}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: YAML error: {' '.join(str(exc).split())}") from None


def _vet_yaml(path: str, text: str) -> None:
    """Refuse explicit tags other than the plain types, and nesting deeper than _MAX_YAML_NESTING, at their line.

    Runs on the parser's events, before the (recursive) composer sees the file."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1
        tag = getattr(event, "tag", None)
        if tag not in (None, "!") and tag not in _PLAIN_TAGS:
            shown = tag.replace("tag:yaml.org,2002:", "!!", 1)
            raise UsageError(f"{path}:{line}: YAML error: tag {_short(shown)!r} is not allowed in a space file "
                             f"(plain values only)")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > _MAX_YAML_NESTING:
                raise UsageError(f"{path}:{line}: YAML error: nested more than {_MAX_YAML_NESTING} deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def spaces_dir() -> Path:
    """The folder of built-in spaces: $EVOTUNE_SPACES, else the packaged `search_spaces` folder."""
    override = os.environ.get("EVOTUNE_SPACES")
    return Path(override) if override else package_data_dir("search_spaces")


def resolve_space(text: str) -> str:
    """`--space` as given: a file's path, or a built-in space's bare name (`attention-hopper3`), which names
    <spaces_dir()>/<name>.yaml in a checkout and after a wheel install alike. A file that exists wins."""
    bare = not (os.sep in text or (os.altsep and os.altsep in text) or text.endswith((".yaml", ".yml")))
    if os.path.lexists(text) or not bare:
        return text
    builtin = spaces_dir() / f"{text}.yaml"
    if builtin.is_file():
        return str(builtin)
    raise UsageError(f"--space {_short(text)}: no such file, nor a built-in space of that name (built-in: "
                     f"{_fmt(builtin_names()) or 'none'})")


def builtin_names() -> list[str]:
    """Names of the built-in spaces, sorted."""
    return sorted(p.stem for p in spaces_dir().glob("*.yaml"))


def load_builtin(name: str, context_names: Iterable[str] | None = None) -> SearchSpace:
    """Load `<spaces_dir()>/<name>.yaml`; raises UsageError listing the available names when there is none."""
    path = spaces_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UsageError(f"unknown search space {name!r}; available: {_fmt(builtin_names()) or 'none'} (in {spaces_dir()})")
    return load_space(path, context_names)
