"""Reading a space file: YAML (bounded as read, plain tags only, nesting bounded) into a SearchSpace, with `extends`,
`pin` and `omit`; the registry of kernel families whose context names and knob domains a file is checked against;
the built-in spaces and `--space` names. Every error is one line, `<path>:<line>: <message>`."""

from __future__ import annotations

import difflib
import keyword
import os
import re
from pathlib import Path
from typing import Callable, Iterable, Mapping

import yaml

from ..errors import EvotuneError, UsageError
from ..outputs import read_input
from ..paths import package_data_dir
from .expressions import _FUNCTIONS, ExpressionError, _in_bounds, _short, expression_names
from .model import DEVICE_CONTEXT_NAMES, Constraint, Param, SearchSpace, _describe, _fmt, _in_domain, _same_value



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


TOP_KEYS = ("family", "extends", "description", "params", "pin", "omit", "derived", "constraints", "measured",
            "variant", "profiles")
# `measured:` holds measured priors, apart from the constraints (validity): each {expr, why, evidence} prunes like a
# constraint, but says it was measured to lose and names the measurement, so that it can be re-measured and is never
# mistaken for what the kernel cannot do.
# A profile of a root space (`profiles:` in the root file) names the knobs it searches (under params, with the
# values it searches, or {} for all of the root's) and those it pins; every other knob of the root stays at its
# default, so a knob added to the root reaches no profile that does not name it.
PROFILE_KEYS = ("description", "params", "pin", "constraints")
PROFILE_SEP = "#"  # `<root file>#<profile>`: how a profile's path is spelled (a run's meta.json records it)
PARAM_KEYS = ("values", "default", "doc")
CONSTRAINT_KEYS = ("expr", "why")
MEASURED_KEYS = ("expr", "why", "evidence")
# A space file's size and YAML nesting: the shipped ones are under 6 KB and 4 deep.
_MAX_FILE_BYTES = 1 << 20
_MAX_YAML_NESTING = 32
# Explicit YAML tags a space file may carry: the plain types (no python/*, binary, set, ...).
_PLAIN_TAGS = frozenset(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq"))


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
        if "profiles" in top:
            if "extends" in top:
                self.fail(top["profiles"], "profiles: only a root space (one that extends none) has profiles")
            self.profile_nodes(top)  # their shape is checked with the root; each is built when it is named
        return self.build(top, self.parent(top["extends"]) if "extends" in top else None)

    def profile_nodes(self, top: dict) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """name -> (key node, value node) of each profile under `profiles:`."""
        nodes = {}
        for name, key_node, value_node in self.mapping(top["profiles"], "profiles"):
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
                self.fail(key_node, f"profile name {_short(name)!r}: letters, digits, '_', '.' and '-' only")
            self.mapping(value_node, f"profile {name!r}", PROFILE_KEYS)
            nodes[name] = (key_node, value_node)
        return nodes

    def profile_space(self, root: yaml.Node | None, name: str) -> SearchSpace:
        """The space of profile `name` of this root: the root's knobs that the profile puts under params (its
        values, default, doc) or pins, every other knob omitted (at its default), the root's derived values and
        constraints, and the profile's own constraints: what a file `extends: <root>` with that `omit:` gives."""
        top = self.top(root)
        nodes = self.profile_nodes(top) if "profiles" in top else {}
        if name not in nodes:
            raise UsageError(f"{self.path}: no profile {_short(name)!r}; its profiles: {_fmt(nodes) or 'none'}")
        key_node, node = nodes[name]
        base_path, self.path = self.path, f"{self.path}{PROFILE_SEP}{name}"
        base = _Reader(base_path, self.context_names, self.knob_domains).space(root)
        fields = {key: value for key, _, value in self.mapping(node, f"profile {name!r}", PROFILE_KEYS)}
        named = {key for section in ("params", "pin") if not _is_empty(fields.get(section))
                 for key, _, _ in self.mapping(fields[section], section)}
        mark = key_node.start_mark, key_node.end_mark
        omit = [yaml.ScalarNode("tag:yaml.org,2002:str", p.name, *mark) for p in base.params if p.name not in named]
        derived_top = {"family": top["family"], **fields}
        if omit:
            derived_top["omit"] = yaml.SequenceNode("tag:yaml.org,2002:seq", omit, *mark)
        if "params" not in derived_top and "pin" not in derived_top:
            self.fail(node, f"profile {name!r} names no knob to search (params) or pin")
        return self.build(derived_top, base)

    def build(self, top: dict, parent: SearchSpace | None) -> SearchSpace:
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
            (() if _is_empty(top.get("constraints")) else tuple(self.constraints(top["constraints"], known))) + \
            (() if _is_empty(top.get("measured")) else tuple(self.constraints(top["measured"], known, measured=True)))
        variant = self.variant(top.get("variant"), params, parent)
        return SearchSpace(family, self.path, description, tuple(params), tuple(derived), constraints, variant,
                           parent)

    def parent(self, node: yaml.Node) -> SearchSpace:
        """The space `extends:` names: a built-in space (`<spaces_dir()>/<name>.yaml`), read as this file is."""
        name = self.string(node, "extends")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*(:[A-Za-z0-9][A-Za-z0-9_.-]*)?", name) \
                or name.endswith((".yaml", ".yml")):
            self.fail(node, f"extends {_short(name)!r}: write a built-in space name, such as attention (not a path)")
        root_name, _, profile = name.partition(":")
        path = spaces_dir() / f"{root_name}.yaml"
        if not profile and not path.is_file():  # the name of a space that became a profile (attention-small)
            found, legacy = profile_of(path)
            path, profile = (Path(found), legacy) if legacy else (path, "")
        if not path.is_file() or (profile and profile not in _profile_names(path)):
            self.fail(node, f"extends {name!r}: no such built-in space; available: "
                            f"{_fmt(builtin_names()) or 'none'} (in {spaces_dir()})")
        chain = self.extended_by + (self.path,)
        if any(Path(p.partition(PROFILE_SEP)[0]).resolve() == path.resolve() for p in chain) and not profile:
            self.fail(node, f"extends {name!r} makes a cycle: {' -> '.join(chain + (str(path),))}")
        if profile:
            return _read(path, lambda reader, root: reader.profile_space(root, profile), self.context_names,
                         self.knob_domains, chain)
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

    def constraints(self, node: yaml.Node, known: set[str], measured: bool = False) -> list[Constraint]:
        keys, what = (MEASURED_KEYS, "measured prior") if measured else (CONSTRAINT_KEYS, "constraint")
        if not isinstance(node, yaml.SequenceNode):
            self.fail(node, f"{'measured' if measured else 'constraints'} must be a list of "
                            f"{{{', '.join(keys)}}} mappings")
        constraints = []
        for item in node.value:
            fields = {key: value for key, _, value in self.mapping(item, f"a {what}", keys)}
            for required in keys:
                if required not in fields:
                    self.fail(item, f"{what} has no `{required}`")
            expr = self.expression(fields["expr"], what, known)
            why = self.string(fields["why"], f"why of a {what}")
            evidence = self.string(fields["evidence"], f"evidence of a {what}") if measured else ""
            constraints.append(Constraint(expr, why, fields["expr"].start_mark.line + 1, evidence))
        return constraints


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
    file, profile = profile_of(path)
    if profile is not None:
        return _read(file, lambda reader, root: reader.profile_space(root, profile), context_names, knob_domains)
    family = embedded_family(path)
    if family is not None:  # a family file's own space (recorded as the file's path: compile workers read it so)
        return load_embedded_space(path, family, context_names, knob_domains)
    return _read(path, lambda reader, root: reader.space(root), context_names, knob_domains)


def embedded_family(path: str | os.PathLike) -> str | None:
    """For a family file (evotune.problems.generic: `kernel:` and `space:` at the top, no `params:`), the family's
    name, its absolute path; None for a space file."""
    def keys(reader: _Reader, root) -> set:
        if not isinstance(root, yaml.MappingNode):
            return set()
        return {k.value for k, _ in root.value if isinstance(k, yaml.ScalarNode)}

    if not os.path.isfile(path):
        return None
    top = _read(path, keys)
    return str(Path(path).resolve()) if {"kernel", "space"} <= top and "params" not in top else None


def load_embedded_space(path: str | os.PathLike, family: str, context_names: Iterable[str] | None = None,
                        knob_domains: Mapping[str, tuple | range] | None = None, key: str = "space") -> SearchSpace:
    """The space a family file (evotune.problems.generic) states under `key:`: a mapping in a space file's format
    whose family is implied (`family`), read and checked as load_space reads a file, its errors at the family
    file's lines."""
    def parse(reader: _Reader, root):
        if not isinstance(root, yaml.MappingNode):
            raise UsageError(f"{path}:1: the top level must be a mapping")
        node = next((v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
        if node is None:
            raise UsageError(f"{path}:1: no `{key}:` section (the family's knobs: params, derived, constraints)")
        if not isinstance(node, yaml.MappingNode):
            reader.fail(node, f"{key} must be a mapping with params (and derived, constraints, profiles)")
        for k, _ in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value in ("family", "extends"):
                reader.fail(k, f"{key}: no {k.value!r} here: the space is this family's own")
        mark = node.start_mark, node.end_mark
        named = (yaml.ScalarNode("tag:yaml.org,2002:str", "family", *mark),
                 yaml.ScalarNode("tag:yaml.org,2002:str", family, *mark))
        return reader.space(yaml.MappingNode(node.tag, [named, *node.value], *mark))

    return _read(path, parse, context_names, knob_domains)


def profile_of(path: str | os.PathLike) -> tuple[str, str | None]:
    """(the file to read, the profile of it or None) for a space path: `<root>.yaml#<profile>`, or a file that no
    longer exists whose name is `<root>-<profile>.yaml` beside a root that has that profile (the spaces that became
    profiles: a run recorded the file's path, and it still names the same space)."""
    text = str(path)
    if PROFILE_SEP in text and not os.path.lexists(text):
        file, _, profile = text.rpartition(PROFILE_SEP)
        return file, profile
    if os.path.lexists(text) or not text.endswith(".yaml"):
        return text, None
    folder, stem = Path(text).parent, Path(text).stem
    for candidate in (folder, spaces_dir()):
        for root in sorted(candidate.glob("*.yaml")) if candidate.is_dir() else ():
            if stem.startswith(root.stem + "-") and stem[len(root.stem) + 1:] in _profile_names(root):
                return str(root), stem[len(root.stem) + 1:]
    return text, None


def _profile_names(root: Path) -> list[str]:
    """The profiles a root space file declares (none where it has none or is not a root space)."""
    try:
        return _read(root, lambda reader, node: list(reader.profile_nodes(reader.top(node)))
                     if isinstance(node, yaml.MappingNode) and "profiles" in reader.top(node) else [])
    except UsageError:
        return []


def space_family(path: str | os.PathLike) -> str:
    """The family a search-space file names (read before its Problem, which knows the context names, is loaded); a
    family file names itself."""
    family = embedded_family(profile_of(path)[0])
    if family is not None:
        return family
    return _read(profile_of(path)[0], lambda reader, root: reader.string(reader.top(root)["family"], "family"))


def _read(path, parse, context_names=None, knob_domains=None, extended_by=()):
    path = str(path)
    try:  # bounded as read (not as stat says), and never a FIFO or a device (outputs.read_input)
        text = read_input(path, "space file", _MAX_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: cannot read: {exc}") from None
    reader = _Reader(path, context_names, knob_domains, extended_by)
    try:
        return parse(reader, _composed(path, text))
    except yaml.MarkedYAMLError as exc:  # syntax errors, and unsupported tags met while constructing values
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(str(exc.problem or exc.context).split())
        where = f"{path}:{mark.line + 1}" if mark else path
        raise UsageError(f"{where}: YAML error: {message}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: YAML error: {' '.join(str(exc).split())}") from None


# libyaml's loader where PyYAML was built with it: the attention space parses 15x faster (0.06 against 0.98 s, which
# the test suite paid on every one of its ~1400 reads). A file it refuses is read again by the pure-Python loader,
# whose messages (and marks) the errors quote, so a bad file's line reads the same with or without libyaml.
_FAST_LOADER = getattr(yaml, "CSafeLoader", None)


def _composed(path: str, text: str):
    """The file's root node after _vet_yaml, by libyaml where present (a YAML error there: read again by the
    pure-Python loader, which raises the error quoted to the user)."""
    if _FAST_LOADER is not None:
        try:
            _vet_yaml(path, text, _FAST_LOADER)
            return yaml.compose(text, Loader=_FAST_LOADER)
        except yaml.YAMLError:
            pass
    _vet_yaml(path, text, yaml.SafeLoader)
    return yaml.compose(text, Loader=yaml.SafeLoader)


def _vet_yaml(path: str, text: str, loader=yaml.SafeLoader) -> None:
    """Refuse explicit tags other than the plain types, and nesting deeper than _MAX_YAML_NESTING, at their line.

    Runs on the parser's events, before the (recursive) composer sees the file."""
    depth = 0
    for event in yaml.parse(text, Loader=loader):
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
    root, _, profile = text.partition(":")  # `attention:hopper3-mirror`, a profile of a built-in root
    builtin = spaces_dir() / f"{root}.yaml"
    if profile and builtin.is_file() and profile in _profile_names(builtin):
        return f"{builtin}{PROFILE_SEP}{profile}"
    if builtin.is_file() and not profile:
        return str(builtin)
    file, profile = profile_of(spaces_dir() / f"{text}.yaml")  # the name of a space that became a profile
    if profile is not None:
        return f"{file}{PROFILE_SEP}{profile}"
    raise UsageError(f"--space {_short(text)}: no such file, nor a built-in space of that name (built-in: "
                     f"{_fmt(builtin_names()) or 'none'})")


def builtin_names() -> list[str]:
    """Names of the built-in spaces and their profiles (`root:profile`), sorted."""
    roots = sorted(spaces_dir().glob("*.yaml"))
    return sorted([p.stem for p in roots] + [f"{p.stem}:{name}" for p in roots for name in _profile_names(p)])


def load_builtin(name: str, context_names: Iterable[str] | None = None) -> SearchSpace:
    """Load `<spaces_dir()>/<name>.yaml`, or the profile `root:profile` (also spelled `root-profile`, the name of
    the file it was); raises UsageError listing the available names when there is none."""
    root, _, profile = name.partition(":")
    path = spaces_dir() / f"{root}.yaml"
    if profile and path.is_file():
        return load_space(f"{path}{PROFILE_SEP}{profile}", context_names)
    if not path.is_file() and profile_of(path)[1] is None:
        raise UsageError(f"unknown search space {name!r}; available: {_fmt(builtin_names()) or 'none'} (in {spaces_dir()})")
    return load_space(path, context_names)
