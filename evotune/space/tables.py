"""A space's derived values and constraints evaluated over many configs at once, exactly as one config at a time.

An expression is cut into units: a subtree that reads few knobs is one unit; a larger one that Python evaluates
operand by operand (arithmetic, a call, one comparison) is its operands' units and the operation on their values.
A unit's value depends only on what it reads, so it is computed once per distinct combination of the codes of
what it reads (a knob's code is its value's index, a unit's or derived value's the index of its value among those
it took), by the compiled expression (the checked helpers, the same errors), and looked up by numpy for every
config. Attention's smem_bytes reads 12 knobs (248,832 combinations); its units read at most a few each.
"""

from __future__ import annotations

import ast
import copy
import math
from typing import Callable, Mapping

import numpy as np

from .expressions import _compile_tree, _parse

# A unit's result where evaluating it raised (or what it reads did).
FAILED = -1
# A subtree reading at most this many knobs and derived values is one unit: its table is small.
_WHOLE_READS = 3


class Unit:
    """A piece of an expression, compiled: `reads` are (kind, ref, env key): ("p", knob index), ("d", derived
    index) or ("u", the Unit whose value it reads); `others`: the other names it reads (the context's, or unknown);
    `truth`: a constraint's last unit, whose result is 1 or 0."""

    __slots__ = ("evaluate", "reads", "others", "truth", "arithmetic")

    def __init__(self, evaluate: Callable, reads: tuple, others: tuple, truth: bool, arithmetic=None):
        self.evaluate, self.reads, self.others, self.truth = evaluate, reads, others, truth
        # (numpy's +, - or *, its two operands: ("read", index into reads) or ("constant", an int)), or None
        self.arithmetic = arithmetic


# +, - and * of ints under 2**31 in magnitude: numpy's int64 gives Python's value, within the bounds.
_NUMPY_OPERATORS = {ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply}
_SMALL = 1 << 31


def _arithmetic(node: ast.expr, keys: list[str]):
    """Unit.arithmetic for `node` where it is +, - or * of two read names or small int literals, else None."""
    if not isinstance(node, ast.BinOp) or type(node.op) not in _NUMPY_OPERATORS:
        return None
    operands = []
    for operand in (node.left, node.right):
        if isinstance(operand, ast.Name) and operand.id in keys:
            operands.append(("read", keys.index(operand.id)))
        elif isinstance(operand, ast.Constant) and type(operand.value) is int and abs(operand.value) < _SMALL:
            operands.append(("constant", operand.value))
        else:
            return None
    return _NUMPY_OPERATORS[type(node.op)], tuple(operands)


def _operands(node: ast.expr) -> list | None:
    """The operands Python evaluates, all of them and in this order, before `node`; None for a node that may skip
    some (and, or, if/else, a chain of comparisons)."""
    if isinstance(node, ast.BinOp):
        return [node.left, node.right]
    if isinstance(node, ast.UnaryOp):
        return [node.operand]
    if isinstance(node, ast.Call):
        return list(node.args)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        right = node.comparators[0]
        return [node.left] + (list(right.elts) if isinstance(right, (ast.Tuple, ast.List)) else [right])
    return None


def _with_operands(node: ast.expr, operands: list) -> ast.expr:
    node = copy.copy(node)
    if isinstance(node, ast.BinOp):
        node.left, node.right = operands
    elif isinstance(node, ast.UnaryOp):
        node.operand = operands[0]
    elif isinstance(node, ast.Call):
        node.args = operands
    else:
        right = node.comparators[0]
        node.left = operands[0]
        node.comparators = [type(right)(operands[1:], ast.Load()) if isinstance(right, (ast.Tuple, ast.List))
                            else operands[1]]
    return node


def units(expr: str, varying: Mapping[str, tuple[str, int]], truth: bool) -> tuple[Unit, ...]:
    """`expr` as units, each after those it reads; the last one's value is the expression's. `varying`: the names
    that vary between configs (knobs and derived values) -> ("p", index) or ("d", index); any other name is read
    from the context. A unit reads an operand's unit under the key "@k", which no name of a space file can be."""
    made: list[Unit] = []

    def unit(node: ast.expr, last: bool = False) -> ast.Name:
        reads = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in varying}
        operands = _operands(node)
        if operands is not None and len(reads) > _WHOLE_READS:
            node = _with_operands(node, [o if isinstance(o, (ast.Name, ast.Constant)) else unit(o) for o in operands])
        names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)})
        keyed = tuple((*varying[name], name) for name in names if name in varying) + \
            tuple(("u", made[int(name[1:])], name) for name in names if name.startswith("@"))
        others = tuple(name for name in names if name not in varying and not name.startswith("@"))
        arithmetic = None if truth and last else _arithmetic(node, [key for _, _, key in keyed])
        made.append(Unit(_compile_tree(node), keyed, others, truth and last, arithmetic))
        return ast.Name(f"@{len(made) - 1}", ast.Load())

    unit(_parse(expr)[0], last=True)
    return tuple(made)


def _value_key(value) -> tuple:
    """Equal for two values only where no expression can tell them apart: 1, 1.0 and True differ, as do 0.0 and
    -0.0; a NaN, or any other object a context may hold, is only itself."""
    kind = type(value)
    if kind in (int, bool, str):
        return kind, value
    if kind is float and value == value:
        return kind, repr(value)
    return kind, id(value)


class Tables:
    """The units' values under one context, each computed once per distinct combination of what it reads."""

    def __init__(self, param_values: list[tuple], derived_units: list[Unit], context: Mapping[str, object]):
        self.param_values = param_values
        self.derived_units = derived_units  # derived value j is the value of its last unit
        self.context = dict(context)
        self.values: dict[int, list] = {}  # id(unit) -> its values, by code
        self.codes: dict[int, dict] = {}  # id(unit) -> _value_key -> code
        self.memo: dict[int, dict] = {}  # id(unit) -> codes of what it reads -> its result

    def step(self, step_units: tuple[Unit, ...], column: Callable[[str, int], np.ndarray], rows: int) -> np.ndarray:
        """The last unit's result on `rows` rows (codes, or 1/0 for a constraint; FAILED where evaluating raised),
        `column(kind, index)` the codes of a knob or derived value on them."""
        local: dict[int, np.ndarray] = {}
        for unit in step_units:
            cols = [local[id(ref)] if kind == "u" else column(kind, ref) for kind, ref, _ in unit.reads]
            local[id(unit)] = self.unit(unit, cols, rows)
        return local[id(step_units[-1])]

    def unit(self, unit: Unit, cols: list[np.ndarray], rows: int) -> np.ndarray:
        if not cols:
            return np.full(rows, self.results(unit, [()])[0], np.int64)
        failed = None
        for (kind, _, _), col in zip(unit.reads, cols):
            if kind == "u":
                failed = col == FAILED if failed is None else failed | (col == FAILED)
        if failed is not None and failed.any():  # an operand raised there: so does the unit, not evaluated
            out = np.full(rows, FAILED, np.int64)
            ok = ~failed
            if ok.any():
                out[ok] = self.unit(unit, [col[ok] for col in cols], int(ok.sum()))
            return out
        radices = [self.radix(kind, ref) for kind, ref, _ in unit.reads]
        total = math.prod(radices)
        if total >= 1 << 62:  # codes too many to combine into one int64
            uniq, inverse = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
            return self.evaluated(unit, uniq)[inverse.reshape(-1)]
        weights = [math.prod(radices[i + 1:]) for i in range(len(radices))]  # the last read varies fastest
        key = cols[0] * weights[0]
        for col, weight in zip(cols[1:], weights[1:]):
            key = key + col * weight
        if total <= max(4 * rows, 1 << 16):  # a dense lookup table: no sort
            seen = np.zeros(total, bool)
            seen[key] = True
            uniq = np.flatnonzero(seen)
            table = np.empty(total, np.int64)
            table[uniq] = self.evaluated(unit, self.decode(uniq, weights, radices))
            return table[key]
        uniq, inverse = np.unique(key, return_inverse=True)
        return self.evaluated(unit, self.decode(uniq, weights, radices))[inverse.reshape(-1)]

    @staticmethod
    def decode(keys: np.ndarray, weights: list[int], radices: list[int]) -> np.ndarray:
        return (keys[:, None] // np.asarray(weights, np.int64)) % np.asarray(radices, np.int64)

    def evaluated(self, unit: Unit, codes: np.ndarray) -> np.ndarray:
        """The unit's results for each row of `codes` (the codes of what it reads)."""
        if unit.arithmetic is not None:
            results = self.by_numpy(unit, codes)
            if results is not None:
                return results
        return np.asarray(self.results(unit, codes.tolist()), np.int64)

    def by_numpy(self, unit: Unit, codes: np.ndarray) -> np.ndarray | None:
        """An arithmetic unit's results computed by numpy, where every value its operands take is an int (not a
        bool) under 2**31 in magnitude; else None."""
        operator, operands = unit.arithmetic
        arrays = []
        for what, x in operands:
            if what == "constant":
                arrays.append(np.int64(x))
                continue
            kind, ref, _ = unit.reads[x]
            values = self.param_values[ref] if kind == "p" else \
                self.values.get(id(self.derived_units[ref] if kind == "d" else ref), [])
            if not all(type(v) is int and -_SMALL < v < _SMALL for v in values):
                return None
            arrays.append(np.asarray(values, np.int64)[codes[:, x]])
        uniq, inverse = np.unique(operator(*arrays), return_inverse=True)
        return np.asarray([self.intern(unit, value) for value in uniq.tolist()], np.int64)[inverse.reshape(-1)]

    def radix(self, kind: str, ref) -> int:
        if kind == "p":
            return len(self.param_values[ref])
        unit = self.derived_units[ref] if kind == "d" else ref
        return max(1, len(self.values.get(id(unit), ())))

    def value(self, kind: str, ref, code: int):
        if kind == "p":
            return self.param_values[ref][code]
        return self.values[id(self.derived_units[ref] if kind == "d" else ref)][code]

    def results(self, unit: Unit, combinations: list) -> list[int]:
        memo = self.memo.setdefault(id(unit), {})
        out = []
        for codes in map(tuple, combinations):
            result = memo.get(codes)
            if result is None:
                result = memo[codes] = self.compute(unit, codes)
            out.append(result)
        return out

    def compute(self, unit: Unit, codes: tuple) -> int:
        env = {name: self.context[name] for name in unit.others if name in self.context}  # what it reads, only
        for (kind, ref, key), code in zip(unit.reads, codes):
            env[key] = self.value(kind, ref, code)
        try:  # whatever evaluating one config would raise here, it raises when evaluated again
            value = unit.evaluate(env)
            return (1 if value else 0) if unit.truth else self.intern(unit, value)
        except Exception:  # noqa: BLE001 - any error is a failure of this combination
            return FAILED

    def intern(self, unit: Unit, value) -> int:
        codes = self.codes.setdefault(id(unit), {})
        key = _value_key(value)
        code = codes.get(key)
        if code is None:
            values = self.values.setdefault(id(unit), [])
            code = codes[key] = len(values)
            values.append(value)
        return code
