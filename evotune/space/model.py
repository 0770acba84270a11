"""The data model of a search space: SearchSpace, Param, Constraint and Config, frozen and hashable; the device
context every family's expressions may read; the knob domains a family declares, as checks of a value."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

from .. import limits
from ..errors import UsageError
from .config import Config
from .expressions import ExpressionError, _short, safe_eval

# Kept under their old names for callers that import them from here; the numbers live in limits.
SMEM_LIMIT = limits.SMEM_PER_BLOCK
MAX_THREADS = limits.THREADS_PER_BLOCK
# Context names of every family: the device limits. A family adds its shape's names.
DEVICE_CONTEXT_NAMES = tuple(limits.DEVICE_LIMITS)


def device_context() -> dict:
    """The DEVICE_CONTEXT_NAMES on an H100 (evotune.limits)."""
    return dict(limits.DEVICE_LIMITS)


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
    """A boolean expression every admitted configuration satisfies, and why it must. `evidence` is set for a
    measured prior (a space's `measured:` section): a region pruned because it was measured to lose, not because
    it is invalid; it names where the measurement is."""

    expr: str
    why: str
    line: int
    evidence: str = ""

    @property
    def measured(self) -> bool:
        return bool(self.evidence)


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
        from .enumeration import _Enumeration  # the walk imports this model

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
    """`value` is in `domain` (a tuple, or a range of ints; None: any value, a knob whose values the family does not
    bound), type-strictly: True is not 1."""
    if domain is None:
        return True
    if isinstance(domain, range):
        return type(value) is int and value in domain
    return any(_same_value(value, v) for v in domain)


def _describe(domain) -> str:
    """A domain in words, e.g. `one of plain, pad, swizzle` or `an integer from 0 to 4`."""
    if domain is None:
        return "any value"
    if not isinstance(domain, range):  # in YAML's spelling: true and false
        return "one of " + ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in domain)
    last = domain[-1]
    if domain.step == 1:
        return f"an integer from {domain.start} to {last}"
    return f"a multiple of {domain.step} from {domain.start} to {last}" if domain.start % domain.step == 0 else \
        f"an integer from {domain.start} to {last} in steps of {domain.step}"
