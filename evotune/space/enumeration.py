"""A space's admitted configs under a context: the pruned walk over its knobs, the scan that finds where the naive
loop over every config would raise, and check_nonempty; each bounded in memory and steps."""

from __future__ import annotations

import gc
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from ..errors import UsageError
from . import tables
from .expressions import ExpressionError, _compiled, expression_names
from .config import Config  # SearchSpace (model.py, which calls this walk) is only named in annotations here

# `next` of an exhausted iterator of a parameter's values, in the walk.
_EXHAUSTED = object()

# Bounds of an enumeration, so that no space file can exhaust the memory or stall the tuner (counted, not timed).
# attention.yaml on the mission shape: 2.9 M steps of the walk (0.8 s by blocks on a 2-core CI machine; 6 s one
# config at a time), 114,080 admitted configs of ~1.7 KB each (25 knobs).
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
    index: int  # its place among the derived values, or among the constraints
    units: tuple  # the expression as evotune.space.tables units, to evaluate it over many configs at once

    @property
    def level(self) -> int:
        """How many parameters must be bound before it can be evaluated."""
        return self.params[-1] + 1 if self.params else 0


def _steps(space: "SearchSpace") -> tuple[list[_Step], list[_Step]] | None:
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

    def step(name: Optional[str], expr: str, index: int) -> _Step | None:
        reads, chain = set(), set()
        for read in expression_names(expr):
            if read in seen:
                reads.update(derived[seen[read]].params)
                chain.update((seen[read],) + derived[seen[read]].chain)
            elif read in params:
                reads.add(params[read])
            elif read in derived_names:  # a later derived value's name: the context's value, in derive()
                return None
        varying = {**{n: ("p", i) for n, i in params.items()}, **{n: ("d", j) for n, j in seen.items()}}
        return _Step(name, _compiled(expr), tuple(sorted(reads)), tuple(sorted(chain)), index,
                     tables.units(expr, varying, truth=name is None))

    try:
        for i, (name, expr, _) in enumerate(space.derived):
            derived.append(step(name, expr, i))
            if derived[-1] is None:
                return None
            seen[name] = i
        constraints = [step(None, c.expr, i) for i, c in enumerate(space.constraints)]
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


# Configs (or combinations) evaluated together at most: bounds the memory of a block (~100 B a row).
_BLOCK_ROWS = 1 << 18


class _Block:
    """Rows of configs that share their first knobs (or combinations of a step's knobs, in the scan): per knob
    bound, its values' indices; per derived value computed, its codes (evotune.space.tables); each row's number."""

    def __init__(self, params: dict, derived: dict, numbers):
        self.params, self.derived, self.numbers = params, derived, numbers

    def column(self, kind: str, index: int):
        return self.params[index] if kind == "p" else self.derived[index]

    def keep(self, mask) -> None:
        self.params = {i: a[mask] for i, a in self.params.items()}
        self.derived = {j: a[mask] for j, a in self.derived.items()}
        self.numbers = self.numbers[mask]

    def kept(self, mask) -> "_Block":
        block = _Block(self.params, self.derived, self.numbers)
        block.keep(mask)
        return block

    def rows(self, start: int, stop: int) -> "_Block":
        return _Block({i: a[start:stop] for i, a in self.params.items()},
                      {j: a[start:stop] for j, a in self.derived.items()}, self.numbers[start:stop])

    def expanded(self, level: int, width: int) -> "_Block":
        """Each row followed by knob `level`'s `width` values in order (the last knob varies fastest)."""
        import numpy as np

        rows = len(self.numbers)
        params = {i: np.repeat(a, width) for i, a in self.params.items()}
        params[level] = np.tile(np.arange(width, dtype=np.int64), rows)
        return _Block(params, {j: np.repeat(a, width) for j, a in self.derived.items()},
                      np.arange(rows * width, dtype=np.int64))


class _Enumeration:
    """A space's admitted configs by a depth-first walk in all_configs' order (last parameter fastest) that
    evaluates each derived value and constraint as soon as the parameters it reads are bound, and leaves out
    a whole subtree at the first constraint it fails.

    Errors: the naive loop computes every derived value and constraint of every config, so an expression that
    fails for a config raises even where another constraint rejects it. The walk skips rejected subtrees, so a
    scan first evaluates each expression once per combination of the parameters it reads (a few thousand
    evaluations for the built-in spaces): where one fails, the config the naive loop would have raised at (the
    first whose combination fails) is evaluated the naive way, which raises that same error."""

    def __init__(self, space: "SearchSpace"):
        self.space = space
        self.names = space.param_names()
        self.values = [p.values for p in space.params]
        steps = _steps(space)
        self.derived, self.constraints = steps if steps is not None else (None, None)

    def admitted(self, context: Mapping[str, object]) -> list[Config]:
        if self.derived is None:
            return self.naive(context)
        table = tables.Tables(self.values, [step.units[-1] for step in self.derived], context)
        failure = self.scan(context, table).failure
        if failure is not None:
            self.space.violations(self.config_at(failure), context)  # raises the naive loop's error
            return self.naive(context)  # an expression failed once and not again (no memory?): as the naive loop
        admitted = self.walk_in_blocks(table)
        return admitted if admitted is not None else self.walk(context)  # past a bound: the walk's error

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
        steps_at = [[(step.name, step.evaluate) for step in steps] for steps in self.schedule()]
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

    def schedule(self) -> list[list[_Step]]:
        """Per level (parameters bound), the derived values and constraints to evaluate there:
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
        return steps_at

    def scan(self, context: Mapping[str, object], table: Optional[tables.Tables] = None) -> _Scan:
        """Evaluate each step, with the derived values it reads, once per combination of the parameters it reads,
        in all_configs' order: where it fails, the naive loop fails first at that combination's first config.
        By tables (each unit once per distinct combination of what it reads), in blocks of _BLOCK_ROWS."""
        if table is None:
            table = tables.Tables(self.values, [step.units[-1] for step in self.derived], context)
        failures, falsy = [], []
        work = 0
        for step in self.derived + self.constraints:
            work += math.prod(len(self.values[i]) for i in step.params)
            if work > MAX_ENUMERATION_STEPS:
                raise _too_many_steps(self.space)
            count, first, failed = self.scan_step(table, step)
            if failed is not None:
                failures.append(self.indices(step.params, failed))
            if step.name is None:
                free = 1
                for i, values in enumerate(self.values):
                    free *= 1 if i in step.params else len(values)
                falsy.append((count * free, None if first is None else self.indices(step.params, first)))
        return _Scan(min(failures) if failures else None, falsy)

    def scan_step(self, table: tables.Tables, step: _Step) -> tuple[int, Optional[int], Optional[int]]:
        """Over the combinations of step.params' values (last fastest, numbered from 0): (how many a constraint
        fails before the first that raises, the first it fails, the first that raises: None where none does)."""
        import numpy as np

        sizes = [len(self.values[i]) for i in step.params]
        total, count, first = math.prod(sizes), 0, None
        for start in range(0, total, _BLOCK_ROWS):
            numbers = np.arange(start, min(total, start + _BLOCK_ROWS), dtype=np.int64)
            digits = np.unravel_index(numbers, sizes) if sizes else ()
            block = _Block(dict(zip(step.params, digits)), {}, numbers)
            failed = None
            for each in [self.derived[j] for j in step.chain] + [step]:
                result = table.step(each.units, block.column, len(numbers))
                bad = result == tables.FAILED
                if bad.any():  # the first combination that raises here; the others go on without those that did
                    failed = min(failed, int(block.numbers[bad.argmax()])) if failed is not None else \
                        int(block.numbers[bad.argmax()])
                    block, result = block.kept(~bad), result[~bad]
                if each.name is not None:
                    block.derived[each.index] = result
            if step.name is None:
                falsy_numbers = block.numbers[result == 0]
                if failed is not None:
                    falsy_numbers = falsy_numbers[falsy_numbers < failed]
                count += len(falsy_numbers)
                first = first if first is not None or not len(falsy_numbers) else int(falsy_numbers[0])
            if failed is not None:
                return count, first, failed
        return count, first, None

    def walk_in_blocks(self, table: tables.Tables) -> Optional[list[Config]]:
        """walk's admitted configs, in its order, by blocks of configs that share their first knobs, each knob's
        values and each step evaluated for a whole block (numpy, by the tables the scan filled); None where the
        walk would pass a bound (MAX_ENUMERATION_STEPS, MAX_ADMITTED). Every expression evaluates (the scan)."""
        import numpy as np

        n = len(self.names)
        steps_at = self.schedule()
        root = _Block({}, {}, np.zeros(1, np.int64))
        if not self.passes(table, steps_at[0], root):
            return []
        if n == 0:
            return [Config.from_dict({})]
        stack, leaves, visited, admitted = [(0, root)], [], 0, 0
        while stack:
            level, block = stack.pop()
            rows = len(block.numbers)
            if level == n:
                leaves.append(block)
                admitted += rows
                if admitted > MAX_ADMITTED:
                    return None
                continue
            width = len(self.values[level])
            if rows > 1 and rows * width > _BLOCK_ROWS:  # in pieces, the first one on top
                per = max(1, _BLOCK_ROWS // width)
                stack += [(level, block.rows(start, start + per)) for start in reversed(range(0, rows, per))]
                continue
            visited += rows * width
            if visited > MAX_ENUMERATION_STEPS:
                return None
            child = block.expanded(level, width)
            if self.passes(table, steps_at[level + 1], child):
                stack.append((level + 1, child))
        return self.configs(leaves)

    @staticmethod
    def passes(table: tables.Tables, steps: list[_Step], block: "_Block") -> bool:
        """Evaluate `steps` on the block's rows, in the walk's order, keeping the rows every constraint admits
        (in place); False when none is left."""
        for step in steps:
            result = table.step(step.units, block.column, len(block.numbers))
            if (result == tables.FAILED).any():
                raise AssertionError("an expression failed in the walk after a clean scan")
            if step.name is not None:
                block.derived[step.index] = result
            elif not result.all():
                block.keep(result == 1)
                if not len(block.numbers):
                    return False
        return True

    def configs(self, leaves: list["_Block"]) -> list[Config]:
        """The Configs of the leaves' rows, in order."""
        order = sorted(range(len(self.names)), key=self.names.__getitem__)  # Config's items are sorted by name
        pairs = [[(self.names[i], value) for value in self.values[i]] for i in order]  # shared by the configs
        out: list[Config] = []
        collecting = gc.isenabled()
        gc.disable()  # a collection per 700 new tuples would rescan the growing list: 1.0 of 1.4 s on CI's CPU
        try:
            for block in leaves:
                columns = [[by_code[code] for code in block.params[i].tolist()] for i, by_code in zip(order, pairs)]
                out += [Config(items) for items in zip(*columns)]
        finally:
            if collecting:
                gc.enable()
        return out

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


def check_nonempty(space: "SearchSpace", context: Mapping[str, object]) -> None:
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


def _nothing_admitted(space: "SearchSpace", context: Mapping[str, object], commonest: Optional[str]) -> UsageError:
    summary = ", ".join(f"{k}={v}" for k, v in context.items())
    most_often = f"; most often failed: {commonest}" if commonest else ""
    return UsageError(f"{space.path}: no configuration is admitted for {summary}{most_often}")
