"""The compiled expressions and the pruned enumeration of evotune.space.searchspace, against plainly written
references: the tree-walking interpreter the expressions had before they were compiled, and the naive loop over
every configuration (of each small built-in space, and of slices of the full attention space, whose every config
is too many for CI)."""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import math
import os
import random
from collections import Counter
from pathlib import Path
from typing import Mapping

import pytest
import yaml

from evotune.errors import UsageError
from evotune.problems import get_problem
from evotune.space import enumeration
from evotune.space.searchspace import (
    _BINOPS,
    _COMPARE,
    _COMPILED_GLOBALS,
    _FUNCTIONS,
    Config,
    ExpressionError,
    _compiled,
    _in_bounds,
    _number,
    _operand,
    _out_of_bounds,
    _parse,
    _short,
    _steps,
    _SYMBOLS,
    builtin_names,
    check_nonempty,
    load_builtin,
    load_space,
    safe_eval,
)

# --------------------------------------------------------------------------- references


def reference_eval(node: ast.expr, env: Mapping[str, object]):
    """The interpreter safe_eval used before expressions were compiled: the semantics they must keep."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExpressionError(f"unknown name {node.id!r}")
        return env[node.id]
    if isinstance(node, ast.BinOp):
        a, b = _number(reference_eval(node.left, env)), _number(reference_eval(node.right, env))
        value = _BINOPS[type(node.op)](a, b)
        if type(value) in (int, float) and -(2**64) <= value <= 2**64:
            return value
        raise _out_of_bounds(value, f"{_operand(a)} {_SYMBOLS[type(node.op)]} {_operand(b)}")
    if isinstance(node, ast.UnaryOp):
        value = reference_eval(node.operand, env)
        return not value if isinstance(node.op, ast.Not) else -_number(value)
    if isinstance(node, ast.BoolOp):
        want = isinstance(node.op, ast.Or)
        for value_node in node.values:
            value = reference_eval(value_node, env)
            if bool(value) == want:
                return value
        return value
    if isinstance(node, ast.Compare):
        left = reference_eval(node.left, env)
        for op, right_node in zip(node.ops, node.comparators):
            if isinstance(right_node, (ast.Tuple, ast.List)):
                right = tuple(reference_eval(e, env) for e in right_node.elts)
            else:
                right = reference_eval(right_node, env)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return reference_eval(node.body if reference_eval(node.test, env) else node.orelse, env)
    if isinstance(node, ast.Call):
        args = [reference_eval(a, env) for a in node.args]
        value = _FUNCTIONS[node.func.id][0](*args)
        if _in_bounds(value):
            return value
        raise _out_of_bounds(value, f"{node.func.id}({', '.join(_short(repr(a)) for a in args)})")
    raise AssertionError(f"unvetted node {type(node).__name__}")


def reference_safe_eval(expr: str, env: Mapping[str, object]):
    tree, _ = _parse(expr)
    try:
        return reference_eval(tree, env)
    except (ArithmeticError, TypeError, ValueError) as exc:
        raise ExpressionError(str(exc)) from None


_UNSET = object()
# Values a memo key may hold: equal values of these types behave alike in every expression (floats are left out,
# 0.0 == -0.0; the types are in the key, True == 1).
_PLAIN = (int, str, bool, type(None), object)


@functools.lru_cache(maxsize=None)
def _names_read(expr: str) -> tuple[str, ...]:
    """Every name `expr`'s tree mentions (read by this file's own walk of the tree, not the product's analysis)."""
    return tuple(sorted({node.id for node in ast.walk(_parse(expr)[0]) if isinstance(node, ast.Name)}))


def reference_admitted(space, context: Mapping[str, object], configs=None) -> list:
    """Every config in order (or those of `configs`, an iterable of the space's), each with all its derived values and
    all its constraints evaluated by the reference. An expression is a pure function of the names it mentions, so its
    value is worked out once per distinct tuple of their values (and types) and reused; an error is raised each time,
    never remembered. The same values as evaluating every expression of every config afresh, at a fraction of the
    cost on slices of the attention space, whose expressions each read a few of its knobs."""
    memo: dict = {}

    def evaluate(expr: str, names: tuple[str, ...], env: Mapping[str, object]):
        values = tuple([env.get(name, _UNSET) for name in names])
        key = (expr, values, tuple(map(type, values)))
        try:
            return memo[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable value
            return reference_safe_eval(expr, env)
        value = reference_safe_eval(expr, env)
        if all(type(v) in _PLAIN for v in values):
            memo[key] = value
        return value

    derived = [(name, expr, _names_read(expr)) for name, expr, _ in space.derived]
    constraints = [(c.expr, _names_read(c.expr)) for c in space.constraints]
    admitted = []
    for cfg in space.all_configs() if configs is None else configs:
        env = {**context, **cfg.as_dict()}
        for name, expr, names in derived:
            env[name] = evaluate(expr, names, env)
        if all([evaluate(expr, names, env) for expr, names in constraints]):
            admitted.append(cfg)
    return admitted


def _reference_shard(args) -> list:
    """reference_admitted over configs [start, stop) of the full attention space, in a worker process."""
    from itertools import islice

    context, start, stop = args
    space = load_builtin("attention")
    return reference_admitted(space, context, islice(space.all_configs(), start, stop))


def reference_admitted_in_parallel(space, context: Mapping[str, object]) -> list:
    """reference_admitted of the full attention space, its configs cut into contiguous shards, one per worker
    process (os.cpu_count(), at most 8), concatenated in order: the same list, in a fraction of the wall time (the
    naive loop takes ~30 core-minutes per shape per 18 million configs, and each knob the space gains multiplies
    them)."""
    import multiprocessing
    import os

    assert space.path == load_builtin("attention").path  # the workers load the built-in space themselves
    workers = max(1, min(8, os.cpu_count() or 1))
    size = space.size()
    bounds = [size * i // workers for i in range(workers + 1)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        shards = pool.map(_reference_shard, [(dict(context), a, b) for a, b in zip(bounds, bounds[1:])])
    return [cfg for shard in shards for cfg in shard]


def naive_admitted(space, context: Mapping[str, object]) -> list:
    """admitted_configs as it was: the per-config path over every config (errors carry file and line)."""
    return [cfg for cfg in space.all_configs() if space.admitted(cfg, context)]


def naive_check_nonempty(space, context: Mapping[str, object]) -> None:
    """check_nonempty as it was: violations() of each config until the first admitted one."""
    reasons: Counter[str] = Counter()
    for cfg in space.all_configs():
        failed = space.violations(cfg, context)
        if not failed:
            return
        reasons.update(failed)
    summary = ", ".join(f"{k}={v}" for k, v in context.items())
    commonest = f"; most often failed: {reasons.most_common(1)[0][0]}" if reasons else ""
    raise UsageError(f"{space.path}: no configuration is admitted for {summary}{commonest}")


def outcome(call):
    """('ok', value, its type) or ('raised', exception type, message): what a call did, to compare two calls."""
    try:
        value = call()
    except Exception as exc:  # noqa: BLE001 - any difference in what is raised is a difference
        return ("raised", type(exc), str(exc))
    return ("ok", value, type(value))


# --------------------------------------------------------------------------- compiled expressions


class Weird:
    """A value whose `==` returns text, not a bool: a comparison must still come out True or False."""

    def __eq__(self, other):
        return "yes"

    __hash__ = object.__hash__


ENV = {"x": 4, "y": -3, "z": 0, "f": 2.5, "s": "pad", "b": True, "big": 2**70, "nan": float("nan"),
       "huge_f": 1e30, "digits": "9" * 30, "w": Weird(), "neg": -(2**64)}

EXPRESSIONS = [
    # literals and names
    "1", "2.5", "'pad'", "True", "x", "s", "big", "missing", "__builtins__", "env", "_number", "_op_Add",
    # arithmetic, each operator, and the bounds on operands and results
    "1 + 2 * 3 - 4 // 3 % 2", "x / 8", "7 / 2", "x // y", "x % y", "f * x", "2 ** 10", "x ** 2", "2 ** -2",
    "2 ** 64", "2 ** 64 + 1", "neg - 1", "x - 2 ** 64 - 1", "big + 0", "big", "x * 2.0 ** 64", "f ** 64",
    "2 ** 65", "2 ** x ** 3", "2 ** -65", "(-8) ** 0.5", "y ** 0.5", "huge_f * huge_f", "nan + 1", "f ** 60",
    "1 // z", "1 / z", "1 % z", "1.0 / 0.0", "f // 0", "b + 1", "True * x", "-(2 ** 64)",
    # arithmetic on what is not a number, and which operand is checked first
    "s * 100", "100 * s", "s + s", "s + missing", "missing + s", "x + missing", "-s", "--x", "-b", "-big",
    "'a' * 3", "x * 'a'", "(s == 'pad') + 1",
    # comparisons, chained and lazy, and `in` on tuple and list literals
    "0 < x <= 4 < 5", "0 < x < 4", "x == 4", "x != 4", "x >= 5", "s == 'pad'", "s < 'q'", "s < 1",
    "x < 0 < missing", "x < 5 < missing", "w == 1", "w != 1", "1 == w == 1",
    "x in (4, 8)", "x not in [64, 128]", "s in ('pad', 'swizzle')", "x in (missing, 4)", "x in (1, 2) in (True,)",
    "x in []", "w in (1,)",
    # boolean operators return the deciding value and short-circuit
    "not x", "not z", "x and 64 // x", "z and 64 // z", "z or 'none'", "x or missing", "z and missing",
    "missing or x", "s and x", "0 or 0.0", "z == 0 or 64 // z > 1", "x and y and z", "z or '' or 0",
    # if/else evaluates one branch
    "16 if s == 'pad' else 0", "missing if z else 1", "1 if missing else 2", "1 // z if x else 0",
    # every allowed function, with its bound and its errors
    "min(x, 8, 3) + max(1, x) + abs(-2)", "min(s, x)", "max(s, 'q')", "max(x, 2) ** 64", "max(big, 1)",
    "min(nan, 1)", "abs(s)", "abs(neg)", "abs(y)", "ceil_div(x, 3)", "ceil_div(x, z)", "ceil_div(s, 2)",
    "ceil_div(f, 2)", "is_pow2(x)", "is_pow2(x + 1)", "is_pow2(s)", "is_pow2(2.0)", "is_pow2(b)",
    "int(7 / 2) + int(b)", "int(s)", "int(digits)", "int(huge_f)", "int(nan)", "int('12')", "bool(z)",
    "bool(s)", "bool(w == 1)", "max(min(x, 3), ceil_div(x, 2), abs(-x))",
    # nesting near the vetted limits
    "-" * 60 + "x", "(" * 30 + "x" + " + 1)" * 30, "x" + " + x" * 60, "x" + " ** 1" * 40,
    "not " * 60 + "x",
]


@pytest.mark.parametrize("expr", EXPRESSIONS)
def test_compiled_matches_reference(expr):
    """The compiled expression returns the reference interpreter's value and type, or raises its error."""
    assert outcome(lambda: safe_eval(expr, ENV)) == outcome(lambda: reference_safe_eval(expr, ENV))


def test_expressions_cover_every_construct():
    """The cases above use every node, operator, comparison and function the vetted subset admits."""
    used = set()
    for expr in EXPRESSIONS:
        for node in ast.walk(_parse(expr)[0]):
            used.add(type(node))
            if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp)):
                used.add(type(node.op))
            elif isinstance(node, ast.Compare):
                used.update(type(op) for op in node.ops)
            elif isinstance(node, ast.Call):
                used.add(node.func.id)
    wanted = {ast.Constant, ast.Name, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Call,
              ast.Tuple, ast.List, ast.USub, ast.Not, ast.And, ast.Or, *_BINOPS, *_COMPARE, *_FUNCTIONS}
    assert wanted - used == set()


def test_compiled_code_reaches_only_the_checked_helpers():
    """A compiled expression has no builtins and loads no global but the helpers; the file's names are keys."""
    assert _COMPILED_GLOBALS["__builtins__"] == {}
    for expr in EXPRESSIONS:
        function = _compiled(expr)
        assert function.__globals__ is _COMPILED_GLOBALS
        assert set(function.__code__.co_names) <= set(_COMPILED_GLOBALS) - {"__builtins__"}, expr
    for name in ("__builtins__", "env", "_number", "_op_Add", "_call_min"):
        with pytest.raises(ExpressionError, match=f"^unknown name '{name}'$"):
            safe_eval(name, {})


def test_compiled_expressions_are_cached():
    """The same text compiles once: the tuner evaluates a few expressions very many times."""
    assert _compiled("x + 1") is _compiled("x + 1")


# --------------------------------------------------------------------------- enumeration of built-in spaces


def contexts_of(family: str) -> dict[str, dict]:
    """Shape name -> context for the shapes each family is tested on: its presets and default shape, and attention's
    and softmax's variants."""
    problem = get_problem(family)
    names = list(problem.presets()) + [problem.default_shape]
    names += {"attention": ["4,32,4096,128:bf16:causal", "1,8,512,64:kv2", "1,1,64,64,80"],
              "softmax": ["100,1000:bf16", "1,1"]}.get(family, [])
    return {name: problem.context(problem.parse_shape(name)) for name in dict.fromkeys(names)}


@functools.lru_cache(maxsize=None)
def builtin(name: str):
    """load_builtin, once per name (a profile reads the whole of attention.yaml)."""
    return load_builtin(name)


def small_cases() -> list[tuple[str, str]]:
    """(space, shape) pairs for the small built-in spaces (at most 5000 configs): a family with one or two such spaces
    takes every shape it is tested on; one with more (attention's profiles, slices of one root with one walk) gives
    each space its first shape and two or more in turn, so that every shape meets some space and every space three
    or more shapes (the full product, ~100 reference loops, took ~100 s of CI's 2 cores)."""
    by_family: dict[str, list[str]] = {}
    for name in builtin_names():
        space = builtin(name)
        if space.size() <= 5000:
            by_family.setdefault(space.family, []).append(name)
    cases = []
    for family, names in by_family.items():
        shapes = list(contexts_of(family))
        if len(names) <= 2:
            cases += [(name, shape) for name in names for shape in shapes]
            continue
        rest = shapes[1:]
        per = max(2, -(-len(rest) // len(names)))  # enough that the turns reach every shape
        for i, name in enumerate(names):
            picks = [shapes[0]] + [rest[(per * i + j) % len(rest)] for j in range(per)] if rest else [shapes[0]]
            cases += [(name, shape) for shape in dict.fromkeys(picks)]
    return cases


SMALL = small_cases()


def test_small_cases_meet_every_shape_and_space():
    """Every small built-in space is checked, and every shape of its family by some small space."""
    family = {name: builtin(name).family for name, _ in SMALL}
    assert set(family) == {name for name in builtin_names() if builtin(name).size() <= 5000}
    for name in family:
        assert set(contexts_of(family[name])) <= {shape for n, shape in SMALL if family[n] == family[name]}


@pytest.mark.parametrize("name, shape", SMALL, ids=[f"{n}-{s}" for n, s in SMALL])
def test_small_spaces_enumerate_like_the_reference(name, shape):
    """Every small built-in space admits, under the shapes small_cases gives it, the reference's configs in its
    order."""
    space = builtin(name)
    context = contexts_of(space.family)[shape]
    assert space.admitted_configs(context) == reference_admitted(space, context)


# The shapes the full attention space is checked under: the mission's, and a large causal d128 bf16 one.
ATTENTION_SHAPES = ["mission", "4,32,4096,128:bf16:causal"]
FULL_ENUMERATION = os.environ.get("EVOTUNE_FULL_ENUMERATION") == "1"


@pytest.mark.slow
@pytest.mark.skipif(not FULL_ENUMERATION, reason="every config of the full attention space against the reference: "
                    "~30 core-minutes per shape per 18 million configs (55 million with kv_cluster); run it with "
                    "EVOTUNE_FULL_ENUMERATION=1 (CI checks slices of the space instead)")
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_enumerates_like_the_reference(shape):
    """The full attention space admits the reference's configs in its order, every one of its configs checked
    (18,432,000 with the kv_load knob, 55,296,000 with kv_cluster; each knob the space gains multiplies them). The
    reference runs in parallel shards: ~30 core-minutes per shape per 18 million configs, too long for CI, which runs
    the test of slices below instead.
    Opt-in: EVOTUNE_FULL_ENUMERATION=1, e.g. after a change to the walk or to the full space's constraints."""
    space = load_builtin("attention")
    context = contexts_of("attention")[shape]
    assert space.admitted_configs(context) == reference_admitted_in_parallel(space, context)


@functools.lru_cache(maxsize=None)
def attention_admitted(shape: str) -> tuple[Config, ...]:
    """The full attention space's admitted configs on `shape` (a named context), enumerated once per session by the
    pruned walk alone: the naive loop over every config would take hours, so reaching it fails the test."""
    space = load_builtin("attention")
    real_naive = enumeration._Enumeration.naive
    enumeration._Enumeration.naive = lambda self, context: pytest.fail("the naive loop ran on the full space")
    try:
        return tuple(space.admitted_configs(contexts_of("attention")[shape]))
    finally:
        enumeration._Enumeration.naive = real_naive


# A slice's configs at most: the reference takes ~10 s for 150,000 on one core, whatever the full space's size.
# 20,000 keeps the coverage asserted below (every value of every knob, every admitted (knob, value) pair inside a
# slice): 7 slices on the mission shape, 9 on the causal one, 126,144 and 160,960 configs through the reference in
# all, with 12,256 and 10,460 of the full space's admitted configs inside them (50,000 a slice took 313,344 and
# 405,120 configs for 11,704 and 13,758 admitted: the same coverage at 2.5 times the cost on CI's 2-core machine).
SLICE_MOST = 20_000
# Slices built around admitted configs of the full space, alternately of each variant (mma), and how many
# configs each is built around; then come the slices that complete the coverage (chosen_slices).
SLICES_AROUND_ADMITTED = 6
CONFIGS_PER_SLICE = 4
SLICE_SEED = 2024


def slice_size(values: Mapping[str, tuple]) -> int:
    return math.prod(len(v) for v in values.values())


def inside(cfg: Config, values: Mapping[str, tuple]) -> bool:
    """Whether every knob of `cfg` takes one of the slice's values."""
    return all(value in values[name] for name, value in cfg.items)


def pairs_of(configs) -> set[tuple[str, object]]:
    """The (knob, value) pairs the configs take."""
    return {pair for cfg in configs for pair in cfg.items}


def grown_slice(space, around: list[Config], first: list[tuple[str, object]], rng: random.Random) -> dict:
    """A slice of `space`: knob -> its values in the space's order. It takes the values of the configs `around`
    (each whole, where the slice stays within SLICE_MOST configs; the first always), then each (knob, value) of
    `first` and then every other one in a random order, where the slice stays within SLICE_MOST configs."""
    picked: dict[str, set] = {p.name: set() for p in space.params}

    def add(pairs) -> None:
        grown = {name: set(values) for name, values in picked.items()}
        for name, value in pairs:
            grown[name].add(value)
        if slice_size(grown) <= SLICE_MOST:
            picked.update(grown)

    for cfg in around:
        add(cfg.items)
    rest = [(p.name, v) for p in space.params for v in p.values]
    rng.shuffle(rest)
    for pair in first + rest:
        add([pair])
    return {p.name: tuple(v for v in p.values if v in picked[p.name]) for p in space.params}


def chosen_slices(space, admitted: list[Config], rng: random.Random) -> list[dict]:
    """Slices of `space`, `admitted` its admitted configs (in order) under the shape: first SLICES_AROUND_ADMITTED
    built around CONFIGS_PER_SLICE admitted configs each, alternately of each variant (the wgmma variant has ~1% of
    the admitted configs; random slices of a space that admits well under 1% of its configs would admit almost none).
    Then, until every value of every knob is in a slice and every (knob, value) that an admitted config takes is
    taken by an admitted config inside a slice, one slice around an admitted config with a value still missing
    (or a random one), taking the values no slice has yet first."""
    variant = next(p for p in space.params if p.name == (space.variant or space.params[0].name))
    slices = []
    for i in range(SLICES_AROUND_ADMITTED):
        pool = [cfg for cfg in admitted if cfg[variant.name] == variant.values[i % len(variant.values)]] or admitted
        slices.append(grown_slice(space, rng.sample(pool, min(CONFIGS_PER_SLICE, len(pool))), [], rng))
    every_pair = [(p.name, v) for p in space.params for v in p.values]
    admitted_pairs = pairs_of(admitted)
    inside_pairs = pairs_of(cfg for cfg in admitted if any(inside(cfg, s) for s in slices))
    while True:
        sliced = {(name, v) for s in slices for name, values in s.items() for v in values}
        unsliced = [pair for pair in every_pair if pair not in sliced]
        missing = [pair for pair in every_pair if pair in admitted_pairs and pair not in inside_pairs]
        if not unsliced and not missing:
            return slices
        assert len(slices) < 100  # each slice adds a pair to `sliced` or to `inside_pairs`
        name, value = missing[0] if missing else rng.choice(unsliced)
        around = rng.choice([cfg for cfg in admitted if cfg[name] == value] if missing else admitted)
        rng.shuffle(unsliced)
        slices.append(grown_slice(space, [around], unsliced, rng))
        inside_pairs |= pairs_of(cfg for cfg in admitted if inside(cfg, slices[-1]))


@functools.lru_cache(maxsize=None)
def _space_document(path: str) -> dict:
    """The space file at `path` as plain data, read once (slice_space copies it for each slice)."""
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))


def slice_space(full, values: Mapping[str, tuple], path: Path):
    """The slice `values` of the space `full` as a space file of its own at `path`, read as any space file is:
    `full`'s file with only each knob's values changed (and its default, where the slice leaves it out)."""
    document = copy.deepcopy(_space_document(full.path))
    assert list(document["params"]) == full.param_names()  # the file states every knob (it extends no space)
    for name, param in document["params"].items():
        param["values"] = list(values[name])
        if "default" in param and param["default"] not in values[name]:
            param["default"] = values[name][0]
    path.write_text(yaml.safe_dump(document, sort_keys=False, width=1 << 16, allow_unicode=True), encoding="utf-8")
    space = load_space(path)
    # The same space but for the knobs' values, as read (not as written above).
    assert (space.family, space.variant, space.param_names()) == (full.family, full.variant, full.param_names())
    assert [p.values for p in space.params] == [values[name] for name in full.param_names()]
    assert [(name, expr) for name, expr, _ in space.derived] == [(name, expr) for name, expr, _ in full.derived]
    assert [(c.expr, c.why) for c in space.constraints] == [(c.expr, c.why) for c in full.constraints]
    return space


@pytest.mark.slow
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_enumerates_like_the_reference_in_slices(shape, tmp_path):
    """Slices of the full attention space (each knob left a subset of its values, in order; chosen_slices), each a
    space file of its own, admit the reference's configs in its order (the walk agrees with the naive loop on every
    config of the slice), and just those of the full space's admitted configs that are inside the slice, in the same
    order (the full space's walk agrees with the slice's there, so with the naive loop). Slices rather than the
    whole space: a handful of slices of at most SLICE_MOST configs each, so the cost is bounded whatever the full
    space's size; the exhaustive test above is opt-in."""
    full = load_builtin("attention")
    context = contexts_of("attention")[shape]
    full_admitted = list(attention_admitted(shape))
    slices = chosen_slices(full, full_admitted, random.Random(SLICE_SEED))
    admitted_in_slices = []
    for i, values in enumerate(slices):
        assert slice_size(values) <= SLICE_MOST
        space = slice_space(full, values, tmp_path / f"slice{i}.yaml")
        admitted = space.admitted_configs(context)
        assert admitted == reference_admitted(space, context), f"slice {i}: {values}"
        assert admitted == [cfg for cfg in full_admitted if inside(cfg, values)], f"slice {i}: {values}"
        admitted_in_slices += admitted
    # Not vacuous: every value of every knob is in a slice, every value an admitted config takes is taken by an
    # admitted config of a slice, and the slices admit many configs.
    assert {(name, v) for s in slices for name, values in s.items() for v in values} == \
        {(p.name, v) for p in full.params for v in p.values}
    assert pairs_of(admitted_in_slices) == pairs_of(full_admitted)
    assert len(admitted_in_slices) > 1000


def test_attention_mission_admits_its_count():
    """The full attention space admits 135,584 configs on the mission shape, through the pruned walk (the naive loop
    over its 165 billion configs never runs). How long the enumeration takes is measured by
    `python tools/suite_timings.py`, not asserted here (docs/PERFORMANCE.md)."""
    admitted = attention_admitted("mission")
    # 10216 before the pdl knob, which doubles the mission shape's configs (20432); the epilogue knob adds the 560
    # wgmma configs with epilogue = tma (its constraint pins the 19872 mma.sync ones to regs); the key_merge knob the
    # 4320 mma.sync configs with key groups and key_merge = split; the kv_load knob the 2688 mma.sync configs with head
    # dim 64, swizzled tiles, no producer warps and kv_load = tma; the kv_cluster knob the 1392 + 1248 of those with
    # clusters of 2 and 4 (no K/V split, parts of whole 8-row swizzle atoms); the kv_load value tma_split the 2688
    # configs where tma is admitted without a cluster; the exp2_fma knob the 19904 mma.sync configs with 32 keys a warp or
    # more and exp2_fma = 1, and every mma.sync config, 32208, again with exp2_fma = 2; the rescale knob the 1120 wgmma
    # configs twice more (new_max, lazy); the softmax_overlap knob the 3360 wgmma configs again (true); the
    # lean_addressing knob the 6720 wgmma configs again (true); the p_operand knob the 7296 wgmma configs with P in
    # shared memory (64-, 128- and, only so, 1920 of 192-key tiles); the empty_warpgroups knob the 4992 wgmma configs
    # with 192-row tiles and no ping-pong again (skip: 512 rows leave the last tile's third warpgroup empty);
    # block_m 256 with 16 compute warps 4032 wgmma configs of four consumer warpgroups (the 192-row tile's 4992, skip
    # aside, less the 176-key tiles, whose S accumulators do not fit four warpgroups' registers) (114080); stages 5 to 8,
    # the Hopper kernel's deep ring, 21504 wgmma configs more (only wgmma's mbarrier ring has more than four slots).
    assert len(admitted) == 135584


# The order of the full attention space's admitted configs: sha256 of their keys, one a line, as the depth-first walk
# gave them before the enumeration went by blocks and tables (issue 39); exhaustive searches visit them in this order.
# Since stages 5-8 joined the root space (the depth-first walk gives the same list: checked when they joined):
ADMITTED_ORDER = {"mission": (135584, "915c22c35d6e0132"), "4,32,4096,128:bf16:causal": (64824, "45e2dc9728aa1cf1")}


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_attention_admits_the_walks_configs_in_its_order(shape):
    """The full attention space's admitted configs are, in order, those the depth-first walk gave (their digest)."""
    admitted = attention_admitted(shape)
    digest = hashlib.sha256("\n".join(cfg.key() for cfg in admitted).encode()).hexdigest()[:16]
    assert (len(admitted), digest) == ADMITTED_ORDER[shape]


@pytest.mark.parametrize("name", ["attention-small", "attention-hopper3", "softmax"])
def test_blocks_smaller_than_a_level_keep_the_order(name, monkeypatch):
    """With blocks of a few rows (a level's rows cut into many pieces, the scan's combinations too), the admitted
    configs are the depth-first walk's, in its order."""
    space = load_builtin(name)
    context = next(iter(contexts_of(space.family).values()))
    walked = enumeration._Enumeration(space).walk(context)
    monkeypatch.setattr(enumeration, "_BLOCK_ROWS", 7)
    assert space.admitted_configs(context) == walked and len(walked) > 100


def test_context_value_under_a_parameter_name():
    """A context key that is also a parameter's name is overridden by the parameter, as in derive()."""
    space = load_builtin("attention-small")
    context = {**contexts_of("attention")["mission"], "block_m": 4096, "threads": 1}
    assert space.admitted_configs(context) == reference_admitted(space, context)


# --------------------------------------------------------------------------- spaces written for the test


def space_of(tmp_path: Path, body: str, family: str = "t"):
    path = tmp_path / "space.yaml"
    path.write_text(f"family: {family}\n" + body)
    return load_space(path, context_names=("cap", "head_dim"))


def same_outcome(tmp_path, body: str, context: Mapping[str, object]) -> tuple:
    """admitted_configs and check_nonempty each do (return or raise) what their naive versions do, in blocks of the
    default size and of a few rows."""
    space = space_of(tmp_path, body)
    fast = outcome(lambda: space.admitted_configs(context))
    assert fast == outcome(lambda: naive_admitted(space, context))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(enumeration, "_BLOCK_ROWS", 2)
        assert outcome(lambda: space.admitted_configs(context)) == fast
    for naive_first in (0, enumeration._NAIVE_FIRST):  # the walk and scan alone, and after the naive configs
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(enumeration, "_NAIVE_FIRST", naive_first)
            assert outcome(lambda: check_nonempty(space, context)) == \
                outcome(lambda: naive_check_nonempty(space, context))
    return fast


AB = "params:\n  a: {values: [0, 1, 2]}\n  b: {values: [0, 1]}\n"


def test_error_in_a_config_an_earlier_constraint_rejects(tmp_path):
    """A derived value that fails only where a constraint on fewer parameters rejects still raises, as before."""
    fast = same_outcome(tmp_path, AB + "derived:\n  x: 64 // (a + b)\nconstraints:\n  - {expr: a > 0, why: w}\n",
                        {"cap": 1})
    assert fast[0] == "raised" and fast[1] is UsageError and "x: 64 // (a + b): integer division" in fast[2]


@pytest.mark.parametrize("body", [
    # the first config that fails is not the first config; a constraint fails before a derived value does
    "params:\n  a: {values: [1, 2, 3]}\n  b: {values: [0, 1, 2]}\nderived:\n  x: 12 // (a - 2)\n"
    "constraints:\n  - {expr: b < cap, why: w}\n  - {expr: 6 // (b - 1) > -10, why: v}\n",
    # two failures in one config: the derived value's is raised, then the first constraint's
    AB + "derived:\n  x: 1 // b\nconstraints:\n  - {expr: 1 // a > 0, why: w}\n",
    AB + "constraints:\n  - {expr: b == 1, why: w}\n  - {expr: 1 // a > 0, why: v}\n  - {expr: 2 // b > 0, why: u}\n",
    # a constraint's value whose truth is fine but a later constraint reads a missing name
    AB + "constraints:\n  - {expr: a > 5, why: w}\n  - {expr: a < head_dim, why: v}\n",
    # arithmetic on text, only for some values
    "params:\n  a: {values: [x, y]}\n  b: {values: [0, 1]}\nconstraints:\n  - {expr: b == 0 or a + 1 > 0, why: w}\n",
    # an admitted config before the first failing one: check_nonempty returns, admitted_configs raises
    "params:\n  a: {values: [1, 0]}\nconstraints:\n  - {expr: 64 // a > 0, why: w}\n",
    # the failing config first, none admitted before it: both raise
    "params:\n  a: {values: [0, 1]}\nconstraints:\n  - {expr: 64 // a > 0, why: w}\n",
    # an error under a prefix the walk would reject first, with an admitted config after it
    AB + "constraints:\n  - {expr: a != 1, why: w}\n  - {expr: 2 // (a - 1 + 2 * b) >= 0, why: v}\n",
    # expressions of more than three knobs, cut into units (evotune.space.tables): ints past 2**31 and bools, whose
    # arithmetic numpy does not do; a product past 2**64 raises
    "params:\n  a: {values: [2, 4294967296]}\n  b: {values: [3, -8589934592]}\n  c: {values: [true, false]}\n"
    "  d: {values: [1, -1, 0]}\nderived:\n  x: a * b * d + c * a + b - d + c\n"
    "constraints:\n  - {expr: x + a * b > d * c - 7, why: w}\n",
    "params:\n  a: {values: [2, 4294967296]}\n  b: {values: [3, 8589934592]}\n  c: {values: [1, 2]}\n"
    "  d: {values: [1, 2]}\nconstraints:\n  - {expr: a * b * a * c + d > 0, why: w}\n",
], ids=["late", "derived-first", "constraint-order", "missing-name", "text", "admitted-first", "failing-first",
        "pruned-error", "units", "units-overflow"])
def test_errors_are_raised_where_the_naive_loop_raises(tmp_path, body):
    """With failing expressions, each call raises the naive loop's error (same config, same expression) or
    returns what it returns."""
    same_outcome(tmp_path, body, {"cap": 2})


@pytest.mark.parametrize("constraints", [
    ["a > 5", "b > 5"],  # a tie: the first met
    ["b > 5", "a > 5"],
    ["b > 1", "a > 1"],  # a > 1 fails three configs, b > 1 fails two; b's is met first
    ["a > 1 and b > 0", "b > 0", "b > 0"],  # one reason twice adds up
    ["a + b > 10", "cap < 0"],  # a constraint on the context alone fails every config
    ["b == 0", "b == 1"],  # b == 1 is first met at the second config
], ids=["tie", "tie-swapped", "counts", "duplicate", "context", "first-met-later"])
def test_commonest_reason_is_the_naive_loops(tmp_path, constraints):
    """Where nothing is admitted, check_nonempty names the constraint the naive loop counted most often."""
    body = "params:\n  a: {values: [0, 1]}\n  b: {values: [0, 1, 2]}\nconstraints:\n" + \
        "".join(f"  - {{expr: '{expr}', why: w}}\n" for expr in constraints)
    fast = same_outcome(tmp_path, body, {"cap": 1})
    assert fast[0] == "ok" and fast[1] == []


def test_head_dim_80_names_the_head_dim_constraint():
    """check_nonempty on the attention spaces for head_dim 80 (nothing admitted) says what the naive loop said."""
    problem = get_problem("attention")
    context = problem.context(problem.parse_shape("1,1,64,64,80"))
    for name in ("attention-small", "attention-hopper"):
        space = load_builtin(name)
        assert outcome(lambda: check_nonempty(space, context)) == outcome(lambda: naive_check_nonempty(space, context))
    with pytest.raises(UsageError, match=r"most often failed: the Hopper kernel is written for head dims 64, 96"):
        check_nonempty(load_builtin("attention"), context)


def test_derived_value_reading_a_later_ones_name(tmp_path):
    """In a plugin family's space (any context name), a derived value may read a later derived value's name,
    which is then the context's: such a space takes the naive loop, with the same result."""
    path = tmp_path / "space.yaml"
    path.write_text("family: nosuchpackage_xyz.fam:Family\nparams:\n  p: {values: [1, 2, 3]}\n"
                    "derived:\n  a: b + p\n  b: p * 10\nconstraints:\n  - {expr: a + b < 25, why: w}\n")
    space = load_space(path)
    assert _steps(space) is None
    for context in ({"b": 1}, {"b": 20}):
        assert space.admitted_configs(context) == reference_admitted(space, context) == naive_admitted(space, context)
    assert outcome(lambda: space.admitted_configs({})) == outcome(lambda: naive_admitted(space, {}))


def test_spaces_with_no_constraint_or_only_context_ones(tmp_path):
    """A space with no constraint admits every config; one whose only constraint reads the context admits all
    or none."""
    assert same_outcome(tmp_path, AB, {"cap": 1})[1] == list(space_of(tmp_path, AB).all_configs())
    body = AB + "constraints:\n  - {expr: cap > 1, why: w}\n"
    assert same_outcome(tmp_path, body, {"cap": 2})[1] == list(space_of(tmp_path, body).all_configs())
    assert same_outcome(tmp_path, body, {"cap": 1})[1] == []
