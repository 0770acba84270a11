"""Search spaces: the tunable knobs of a kernel family, read from a YAML file (this module gathers the names of
the four that implement them: expressions, the language; model, SearchSpace and Config; enumeration, the admitted
configs; reader, the file).

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

from .enumeration import (  # noqa: F401
    _Enumeration, _Scan, _Step, _nothing_admitted, _steps, _too_many_admitted, _too_many_steps, check_nonempty,
)
from .expressions import (  # noqa: F401
    _BINOPS, _COMPARE, _COMPILED_GLOBALS, _FUNCTIONS, _MAX_EXPONENT, _MAX_EXPRESSION_CHARS, _MAX_EXPRESSION_DEPTH,
    _MAX_MAGNITUDE, _SYMBOLS, ExpressionError, _check, _compiled, _in_bounds, _number, _operand, _out_of_bounds,
    _parse, _short, _translate, expression_names, safe_eval,
)
from .model import (  # noqa: F401
    DEVICE_CONTEXT_NAMES, MAX_THREADS, SMEM_LIMIT, Config, Constraint, Param, SearchSpace, _describe, _fmt,
    _in_domain, _same_value, config_fault, device_context,
)
from .reader import (  # noqa: F401
    _FAMILIES, _MAX_FILE_BYTES, _MAX_YAML_NESTING, _PLAIN_TAGS, CONSTRAINT_KEYS, PARAM_KEYS, TOP_KEYS, _is_empty,
    _read, _Reader, _vet_yaml, builtin_names, family_context_names, family_knob_domains, load_builtin, load_space,
    register_family, resolve_space, space_family, spaces_dir,
)


def __getattr__(name: str):
    # The attention family's CONTEXT_NAMES and shape_context() lived here before families owned their shapes;
    # old imports of them reach the family through the registry.
    if name in ("CONTEXT_NAMES", "shape_context") and "attention" in _FAMILIES:
        attention = _FAMILIES["attention"]()
        return attention.context_names if name == "CONTEXT_NAMES" else attention.context
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
