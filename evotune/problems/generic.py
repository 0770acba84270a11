"""A kernel family declared by a YAML file and a reference function: your own kernel without a Problem subclass.

The family file (docs/PLUGINS.md has the whole format) names, beside itself, the CUDA source and its device
function template, the shape as named integers and a dtype (`M=4096,N=4096,K=4096:fp16`), the inputs and
outputs (any number) with shape expressions and distributions, the kernel's parameters in order (default: inputs,
outputs, shape names, constants), the knobs (and other names) in template-argument order (default: ctype, then the
space's params), the launch geometry and optional FLOPs and bytes, all in the space's expression language
(evotune/space/expressions.py), the tolerance, the reference (and optional baselines) as `file.py:function` or a
torch function by its dotted name (`torch.matmul`), and the space (inline under `space:`, or a file beside it).

evotune writes the one extern "C" entry point: it takes the tensors as pointers (`const T*` for inputs, `T*` for
outputs, T the tensor's C type) and the integer arguments as int, and calls `entry<template args>(...)` with
them, so the kernel is a `__device__` function template.

The family's name everywhere (runs, workers, `--family`) is the family file's absolute path: a worker process
loads the family by it. The instantiated source names only the file (source_name), so the same family in two
checkouts is one source. Loading it imports the reference module, which is code, so it loads only where the
person running evotune allowed it: `--family FILE` on the command line does; a run folder or a space naming the
file does not (EVOTUNE_PLUGINS may list the file or its folder).

The gate checks every output. A family with one output hands the gate one tensor, as the built-in families do;
with several, name -> tensor (evaluate.named_outputs). The dependency check changes one element of one input
(`perturb:`, else the first floating-point input) at a drawn position; the rows of each output that may move
are those whose fp32 reference moves at all, and every row the reference moves beyond the tolerance must move.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import UsageError
from ..space.expressions import ExpressionError, expression_names, safe_eval
from ..space.model import DEVICE_CONTEXT_NAMES, device_context
from ..space.reader import load_embedded_space, load_space
from . import LaunchGeometry, Problem

# dtype -> (C type, bytes, torch dtype's name)
DTYPES = {"fp16": ("__half", 2, "float16"), "bf16": ("__nv_bfloat16", 2, "bfloat16"), "fp32": ("float", 4, "float32"),
          "int32": ("int", 4, "int32")}
FLOAT_DTYPES = ("fp16", "bf16", "fp32")
# How an input's elements are drawn (never all zeros): N(0, 1), U(-1, 1), U(0.5, 1.5) (a scale, a divisor) and
# integers in [0, scale) for int32; each times `scale`.
INITS = ("normal", "uniform", "positive", "randint")
FAMILY_KEYS = ("name", "description", "kernel", "entry", "shape", "dtypes", "presets", "constants", "inputs",
               "outputs", "args", "template", "launch", "flops", "bytes", "tolerance", "reference", "baselines",
               "space", "perturb")
REQUIRED_KEYS = ("kernel", "entry", "shape", "inputs", "outputs", "launch", "tolerance", "reference", "space")
TENSOR_KEYS = ("shape", "dtype", "init", "scale")
LAUNCH_KEYS = ("grid", "block", "smem")
SHAPE_SUFFIX = "the family file's `shape:`"
_CONSTRUCTOR = yaml.constructor.SafeConstructor()


def is_family_file(name: str) -> bool:
    """Whether a `--family` value names a family file (rather than a built-in family or a plugin module)."""
    return str(name).endswith((".yaml", ".yml"))


@dataclass(frozen=True)
class GenericShape:
    """One problem of a declared family: its named integers, in the family's order, and a dtype."""

    dims: tuple[tuple[str, int], ...]
    dtype: str
    # (FLOPs, bytes) of one call from the family file's expressions (None where it states none): the physical floor
    # (gpu/plausibility.py) and bench's roofline read them through flops() and min_bytes().
    work: tuple = field(default=(None, None), compare=False, repr=False)

    def flops(self) -> float | None:
        return self.work[0]

    def min_bytes(self) -> float | None:
        return self.work[1]

    @property
    def spec(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.dims) + f":{self.dtype}"

    def as_dict(self) -> dict:
        return {**dict(self.dims), "dtype": self.dtype}

    def values(self) -> dict:
        return dict(self.dims)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[str, ...]   # expressions of the dims and constants
    dtype: str               # a DTYPES name, or "" for the shape's dtype
    init: str = "normal"
    scale: float = 1.0

    def dtype_of(self, shape: GenericShape) -> str:
        return self.dtype or shape.dtype


class _FamilyReader:
    """The family file as composed YAML nodes, so every error names its line."""

    def __init__(self, path: Path):
        self.path = path
        try:
            text = path.read_text()
        except OSError as e:
            raise UsageError(f"{path}: cannot read the family file: {e.strerror or e}") from None
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            raise UsageError(f"{path}:{mark.line + 1 if mark else 1}: YAML error: {' '.join(str(e.problem).split())}") \
                from None
        if not isinstance(root, yaml.MappingNode):
            raise UsageError(f"{path}:1: a family file is a mapping with {', '.join(REQUIRED_KEYS)}")
        self.nodes = self.entries(root, "the family file", FAMILY_KEYS)
        for key in REQUIRED_KEYS:
            if key not in self.nodes:
                raise UsageError(f"{path}:{root.start_mark.line + 1}: missing key {key!r} "
                                 f"(a family file has {', '.join(REQUIRED_KEYS)})")

    def fail(self, node, message: str):
        raise UsageError(f"{self.path}:{node.start_mark.line + 1}: {message}")

    def entries(self, node, what: str, allowed=None) -> dict:
        if not isinstance(node, yaml.MappingNode):
            self.fail(node, f"{what} must be a mapping")
        out = {}
        for k, v in node.value:
            key = k.value
            if allowed is not None and key not in allowed:
                near = difflib.get_close_matches(key, allowed, n=1)
                self.fail(k, f"unknown key {key!r} in {what}" + (f"; did you mean {near[0]!r}?" if near else
                                                                  f"; allowed: {', '.join(allowed)}"))
            if key in out:
                self.fail(k, f"duplicate key {key!r} in {what}")
            out[key] = v
        return out

    def value(self, node):
        return _CONSTRUCTOR.construct_object(node, deep=True)

    def text(self, key: str, default: str | None = None) -> str:
        if key not in self.nodes:
            return default
        value = self.value(self.nodes[key])
        if not isinstance(value, str) or not value.strip():
            self.fail(self.nodes[key], f"{key} must be text")
        return value.strip()

    def expression(self, node, what: str, known: set[str]) -> str:
        if not isinstance(node, yaml.ScalarNode) or not str(node.value).strip():
            self.fail(node, f"{what} must be an expression")
        try:
            unknown = sorted(expression_names(node.value) - known)
        except ExpressionError as e:
            self.fail(node, f"{what}: {e}")
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            self.fail(node, f"{what}: unknown name {unknown[0]!r}" + (f"; did you mean {near[0]!r}?" if near else ""))
        return node.value

    def expressions(self, node, what: str, known: set[str], most: int = 8) -> tuple[str, ...]:
        items = node.value if isinstance(node, yaml.SequenceNode) else [node]
        if not 1 <= len(items) <= most:
            self.fail(node, f"{what} must be a list of 1 to {most} expressions")
        return tuple(self.expression(item, f"{what}", known) for item in items)

    def beside(self, node, text: str, what: str) -> Path:
        """A file named in the family file: relative paths are beside it."""
        path = (self.path.parent / text).resolve()
        if not path.is_file():
            self.fail(node, f"{what} {text!r}: no such file beside the family file ({path})")
        return path

    def function(self, node, what: str, given: set[str]) -> tuple[Path | None, str]:
        """file.py:function beside the family file, or a torch function by its dotted name (torch.matmul,
        torch.nn.functional.silu: (None, the name)), whose parameters without a default must be names the family
        gives (inputs, shape names, constants)."""
        spec = self.value(node)
        if isinstance(spec, str) and ":" not in spec and spec.split(".")[0] == "torch":
            try:
                fn = load_function(None, spec)
            except UsageError as e:
                self.fail(node, f"{what}: {e}")
            missing = _unnamed_parameters(fn, given)
            if missing:
                names = ", ".join(sorted(given - {"dtype"}))
                self.fail(node, f"{what} {spec}: its parameter {missing[0]!r} is none of {names}; write a function "
                                f"in a .py file beside this one that calls it")
            return None, spec
        if not isinstance(spec, str) or ":" not in spec:
            self.fail(node, f"{what} must be written file.py:function (or a torch function: torch.matmul)")
        file, _, name = spec.rpartition(":")
        if not name.isidentifier():
            self.fail(node, f"{what} {spec!r}: {name!r} is not a function name")
        return self.beside(node, file, what), name


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_") or "kernel"


class GenericProblem(Problem):
    """A family declared by a family file (module docstring); one instance per file."""

    PATTERNS = ("normal",)
    perturbed = "input element"
    baseline_kind = "torch"

    def __init__(self, path: str | os.PathLike):
        path = Path(path).resolve()
        r = _FamilyReader(path)
        self.family = str(path)
        self.path = path
        # The banner names the file, not the folder: the same family in two checkouts is one source (one digest,
        # one cached cubin, records that agree).
        self.source_name = path.name
        self.name = r.text("name", path.stem)
        self.title = r.text("description", f"{self.name} kernel")
        self.kernel_file = str(r.beside(r.nodes["kernel"], r.text("kernel"), "kernel"))
        self.entry = r.text("entry")
        if not self.entry.replace("::", "_").isidentifier():
            r.fail(r.nodes["entry"], f"entry {self.entry!r} must name the kernel's device function template")
        self.entry_name = f"evotune_{_slug(self.name)}"
        self._read_shape(r)
        self._read_tensors(r)
        self._read_code(r)
        # The default and the presets were read before the FLOPs and bytes: again, with them.
        self.default = self._shape(self.default.dims, self.default.dtype)
        self._presets = {k: (self._shape(v.dims, v.dtype), about) for k, (v, about) in self._presets.items()}
        self._read_checks(r)
        self._read_space(r)

    # ------------------------------------------------------------ reading the file
    def _read_shape(self, r: _FamilyReader) -> None:
        node = r.nodes["shape"]
        spec = r.value(node)
        if not isinstance(spec, str) or "=" not in spec:
            r.fail(node, "shape must be written NAME=INT,NAME=INT:dtype, e.g. M=4096,N=4096,K=4096:fp16")
        dims_part, _, dtype = spec.partition(":")
        names = [p.partition("=")[0].strip() for p in dims_part.split(",")]
        for name in names:
            if not name.isidentifier():
                r.fail(node, f"shape: {name!r} is not a name")
        self.dim_names = tuple(names)
        dtypes = r.value(r.nodes["dtypes"]) if "dtypes" in r.nodes else [dtype.strip() or "fp16"]
        if not isinstance(dtypes, list) or not dtypes or any(d not in DTYPES for d in dtypes):
            r.fail(r.nodes.get("dtypes", node), f"dtypes must be a list of {', '.join(DTYPES)}")
        self.dtypes = tuple(dtypes)
        constants = r.value(r.nodes["constants"]) if "constants" in r.nodes else {}
        if not isinstance(constants, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      for v in constants.values()):
            r.fail(r.nodes["constants"], "constants must map names to numbers")
        self.constants = constants
        self.context_names = (*self.dim_names, *constants, "dtype", "dtype_bytes", "ctype") + DEVICE_CONTEXT_NAMES
        try:
            self.default = self.parse_shape(spec)
        except UsageError as e:
            r.fail(node, str(e))
        self.default_shape = self.default.spec
        self._presets = {}
        for name, pnode in (r.entries(r.nodes["presets"], "presets") if "presets" in r.nodes else {}).items():
            try:
                self._presets[name] = (self.parse_shape(str(r.value(pnode))), "")
            except UsageError as e:
                r.fail(pnode, f"preset {name!r}: {e}")

    def _read_tensors(self, r: _FamilyReader) -> None:
        sizes = set(self.dim_names) | set(self.constants)
        self.inputs = self._tensors(r, "inputs", sizes)
        self.outputs = self._tensors(r, "outputs", sizes)
        both = set(self.inputs) & set(self.outputs)
        if both:
            r.fail(r.nodes["outputs"], f"{sorted(both)[0]!r} is both an input and an output")
        floats = [n for n, t in self.inputs.items() if t.dtype in ("",) + FLOAT_DTYPES]
        target = r.text("perturb", floats[0] if floats else None)
        if target not in floats:
            r.fail(r.nodes.get("perturb", r.nodes["inputs"]),
                   f"perturb: name a floating-point input ({', '.join(floats) or 'there is none'})")
        self.perturb_input = target

    def _tensors(self, r: _FamilyReader, key: str, sizes: set[str]) -> dict[str, TensorSpec]:
        out = {}
        for name, node in r.entries(r.nodes[key], key).items():
            if not name.isidentifier() or name.startswith("_") or name in sizes:
                r.fail(node, f"{key}: {name!r} must be a name that is not a shape name or constant")
            fields = r.entries(node, f"{key} {name!r}", TENSOR_KEYS)
            if "shape" not in fields:
                r.fail(node, f"{key} {name!r} has no shape")
            shape = r.expressions(fields["shape"], f"shape of {name!r}", sizes)
            dtype = str(r.value(fields["dtype"])) if "dtype" in fields else ""
            if dtype and dtype not in DTYPES:
                r.fail(fields["dtype"], f"dtype of {name!r}: one of {', '.join(DTYPES)}")
            init = str(r.value(fields["init"])) if "init" in fields else ("randint" if dtype == "int32" else "normal")
            if init not in INITS:
                r.fail(fields["init"], f"init of {name!r}: one of {', '.join(INITS)}")
            scale = r.value(fields["scale"]) if "scale" in fields else 1.0
            if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
                r.fail(fields["scale"], f"scale of {name!r} must be a positive number")
            out[name] = TensorSpec(name, shape, dtype, init, float(scale))
        if not out:
            r.fail(r.nodes[key], f"{key}: at least one")
        return out

    def _read_code(self, r: _FamilyReader) -> None:
        sizes = set(self.dim_names) | set(self.constants) | {"dtype_bytes"}
        # Without `args`, the kernel takes what the file declares in its order: inputs, outputs, shape names, constants.
        args = r.nodes.get("args")
        items = args.value if args is not None else [
            yaml.ScalarNode("tag:yaml.org,2002:str", n, r.nodes["inputs"].start_mark)
            for n in (*self.inputs, *self.outputs, *self.dim_names, *self.constants)]
        if args is not None and (not isinstance(args, yaml.SequenceNode) or not args.value):
            r.fail(args, "args must list the kernel's parameters in order: tensor names and integer expressions")
        self.args = []
        for item in items:
            if item.value in self.inputs or item.value in self.outputs:
                self.args.append(("tensor", item.value))
            elif isinstance(self.constants.get(item.value), float):
                self.args.append(("float", item.value))
            else:
                self.args.append(("int", r.expression(item, "an argument", sizes)))
        missing = [n for n in self.outputs if ("tensor", n) not in self.args]
        if missing:
            r.fail(args, f"args: output {missing[0]!r} is not passed to the kernel")
        self._template_nodes = r.nodes.get("template")
        self._launch = r.entries(r.nodes["launch"], "launch", LAUNCH_KEYS)
        for key in ("grid", "block"):
            if key not in self._launch:
                r.fail(r.nodes["launch"], f"launch has no {key}")
        for key in ("flops", "bytes"):
            setattr(self, f"_{key}", r.expression(r.nodes[key], key, sizes) if key in r.nodes else None)
        self.rate_unit = "TFLOP/s" if self._flops else "GB/s"

    def _read_checks(self, r: _FamilyReader) -> None:
        tol = r.value(r.nodes["tolerance"])
        node = r.nodes["tolerance"]

        def pair(t, what):
            if not isinstance(t, dict) or set(t) != {"atol", "rtol"} or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in t.values()):
                r.fail(node, f"{what} must be {{atol: number, rtol: number}}")
            return float(t["atol"]), float(t["rtol"])

        if isinstance(tol, dict) and set(tol) <= set(DTYPES) and tol:
            self._tolerance = {d: pair(t, f"tolerance of {d}") for d, t in tol.items()}
            missing = [d for d in self.dtypes if d not in self._tolerance]
            if missing:
                r.fail(node, f"tolerance: none for dtype {missing[0]}")
        else:
            self._tolerance = {d: pair(tol, "tolerance") for d in self.dtypes}
        given = {*self.inputs, *self.dim_names, *self.constants, "dtype"}
        self._reference = r.function(r.nodes["reference"], "reference", given)
        self._baselines = {name: r.function(n, f"baseline {name!r}", given)
                           for name, n in (r.entries(r.nodes["baselines"], "baselines") if "baselines" in r.nodes
                                           else {}).items()}

    def _read_space(self, r: _FamilyReader) -> None:
        node = r.nodes["space"]
        names = tuple(self.context_names)
        if isinstance(node, yaml.MappingNode):
            self.space = load_embedded_space(self.path, self.family, names)
            self.default_space = str(self.path)
        else:
            file = r.beside(node, str(r.value(node)), "space")
            self.space = load_space(file, names)
            self.default_space = str(file)
        derived = {name for name, _, _ in self.space.derived}
        knobs = set(self.space.param_names())
        known = set(self.context_names) | knobs | derived
        tnode = self._template_nodes
        # Without `template`: the dtype's C type, then the knobs in the space's order; `template: []` for none.
        if tnode is None:
            self.template = ("ctype", *self.space.param_names())
        elif isinstance(tnode, yaml.SequenceNode) and not tnode.value:
            self.template = ()
        else:
            self.template = r.expressions(tnode, "template", known, most=64)
        self.grid = r.expressions(self._launch["grid"], "grid", known, most=3)
        self.block = r.expressions(self._launch["block"], "block", known, most=3)
        self.smem = r.expression(self._launch["smem"], "smem", known) if "smem" in self._launch else "0"
        used = self._names_read(self.template + self.grid + self.block + (self.smem,))
        self.knobs = tuple(p for p in self.space.param_names() if p in used)
        for param in self.space.params:  # a knob nothing reads changes nothing: the space is wrong
            if param.name not in used:
                near = difflib.get_close_matches(param.name, sorted(used - set(self.context_names)), n=1)
                raise UsageError(f"{self.space.path}:{param.line}: parameter {param.name!r} is not a knob of the "
                                 f"{self.name} family: neither its template arguments nor its launch read it"
                                 + (f"; did you mean {near[0]!r}?" if near else ""))

    def _names_read(self, exprs) -> set[str]:
        """Names the expressions read, through the space's derived values."""
        derived = {name: expr for name, expr, _ in self.space.derived}
        todo, seen = [n for e in exprs for n in expression_names(e)], set()
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(expression_names(derived[name]) if name in derived else ())
        return seen

    # ------------------------------------------------------------ shapes
    def parse_shape(self, text: str) -> GenericShape:
        """A preset, or NAME=INT,... (names the text leaves out keep the default shape's values) or INT,INT,...
        in the family's order, with an optional :dtype."""
        text = str(text or "").strip()
        presets = getattr(self, "_presets", {})
        if text in presets:
            return presets[text][0]
        dims_part, _, dtype = text.partition(":")
        dtype = dtype.strip() or (self.default.dtype if hasattr(self, "default") else self.dtypes[0])
        if dtype not in self.dtypes:
            raise UsageError(f"shape {text!r}: dtype {dtype!r} is not one of this family's: {', '.join(self.dtypes)}")
        values = dict(self.default.dims) if hasattr(self, "default") else {}
        parts = [p.strip() for p in dims_part.split(",") if p.strip()]
        if parts and all("=" not in p for p in parts) and len(parts) == len(self.dim_names):
            parts = [f"{n}={p}" for n, p in zip(self.dim_names, parts)]
        for part in parts:
            name, eq, value = (s.strip() for s in part.partition("="))
            if not eq or name not in self.dim_names:
                where = f"; presets: {', '.join(presets)}" if presets else ""
                raise UsageError(f"shape {text!r}: write {','.join(f'{n}=INT' for n in self.dim_names)}[:dtype]{where}")
            if not (value.isdigit() and value.isascii()) or not 1 <= int(value) < 2**31:
                raise UsageError(f"shape {text!r}: {name} must be an integer from 1 to 2^31-1 (the kernel takes int)")
            values[name] = int(value)
        missing = [n for n in self.dim_names if n not in values]
        if missing:
            raise UsageError(f"shape {text!r}: no value for {missing[0]}")
        return self._shape(tuple((n, values[n]) for n in self.dim_names), dtype)

    def _shape(self, dims, dtype: str) -> GenericShape:
        env = {**dict(dims), **self.constants, "dtype_bytes": DTYPES[dtype][1]}
        exprs = (getattr(self, "_flops", None), getattr(self, "_bytes", None))
        return GenericShape(dims, dtype, tuple(float(safe_eval(e, env)) if e else None for e in exprs))

    def shape_from_dict(self, d: dict) -> GenericShape:
        return self._shape(tuple((n, int(d[n])) for n in self.dim_names), d["dtype"])

    def presets(self) -> dict:
        return dict(self._presets)

    def shape_columns(self, shape) -> dict:
        return {**{n: str(v) for n, v in shape.dims}, "dtype": shape.dtype}

    def check_shape(self, shape) -> None:
        if not isinstance(shape, GenericShape) or tuple(n for n, _ in shape.dims) != self.dim_names:
            raise UsageError(f"{self.name}: not a shape of this family: {shape!r}")
        for spec in (*self.inputs.values(), *self.outputs.values()):
            if any(n < 1 for n in self.tensor_shape(spec, shape)):
                raise UsageError(f"{self.name}: {spec.name} would be empty on {shape.spec}")

    def context(self, shape) -> dict:
        ctype, nbytes, _ = DTYPES[shape.dtype]
        return {**shape.values(), **self.constants, "dtype": shape.dtype, "dtype_bytes": nbytes, "ctype": ctype,
                **device_context()}

    def knob_domains(self) -> dict:
        """The knobs the template arguments and the launch read; any value (the template's static_asserts judge)."""
        return {name: None for name in self.knobs}

    def load_space(self, context_names):
        return self.space

    def tensor_shape(self, spec: TensorSpec, shape) -> tuple[int, ...]:
        env = {**shape.values(), **self.constants}
        return tuple(int(safe_eval(e, env)) for e in spec.shape)

    def work(self, shape) -> tuple[float | None, float | None]:
        return self._shape(shape.dims, shape.dtype).work

    def rate(self, shape, time_us: float):
        flops, nbytes = self.work(shape)
        if flops:
            return flops / time_us / 1e6
        return nbytes / time_us / 1e3 if nbytes else None

    # ------------------------------------------------------------ code
    def _env(self, config, shape) -> dict:
        env = {**self.context(shape), **config.as_dict()}
        for name, expr, _ in self.space.derived:
            env[name] = safe_eval(expr, env)
        return env

    def instantiation(self, config, shape) -> str:
        env = self._env(config, shape)
        targs = ", ".join(_cpp(safe_eval(e, env)) for e in self.template)
        call = f"{self.entry}<{targs}>" if self.template else self.entry
        params, names = [], []
        for i, (kind, what) in enumerate(self.args):
            if kind == "tensor":
                spec = self.inputs.get(what) or self.outputs[what]
                ctype = DTYPES[spec.dtype_of(shape)][0]
                const = "const " if what in self.inputs else ""
                params.append(f"{const}{ctype}* __restrict__ {what}")
                names.append(what)
            else:
                name = what if what.isidentifier() else f"arg{i}"
                params.append(f"{'float' if kind == 'float' else 'int'} {name}")
                names.append(name)
        threads = self.geometry(config, shape).threads  # the launch bound is the launch's block
        return (f'extern "C" __global__ void __launch_bounds__({threads})\n'
                f"{self.entry_name}({', '.join(params)}) {{\n    {call}({', '.join(names)});\n}}\n")

    def _ints(self, exprs, env) -> list[int]:
        return [int(safe_eval(e, env)) for e in exprs]

    def geometry(self, config, shape) -> LaunchGeometry:
        env = self._env(config, shape)
        grid, block = self._ints(self.grid, env), self._ints(self.block, env)
        return LaunchGeometry(tuple(grid + [1] * (3 - len(grid))), tuple(block + [1] * (3 - len(block))),
                              int(safe_eval(self.smem, env)))

    def signature(self, config=None) -> str:
        """The entry point's parameters; T is the shape's dtype's C type (a tensor of a fixed dtype names its own)."""
        parts = []
        for kind, what in self.args:
            if kind == "tensor":
                spec = self.inputs.get(what) or self.outputs[what]
                ctype = DTYPES[spec.dtype][0] if spec.dtype else "T"
                parts.append(f"{'const ' if what in self.inputs else ''}{ctype}* {what}")
            else:
                parts.append(f"{'float' if kind == 'float' else 'int'} {what}")
        return f"{self.entry_name}({', '.join(parts)})  // T: {', '.join(DTYPES[d][0] for d in self.dtypes)}"

    def tolerance(self, shape) -> tuple[float, float]:
        return self._tolerance[shape.dtype]

    # ------------------------------------------------------------ GPU side (any torch device)
    def torch_dtype(self, spec: TensorSpec, shape):
        import torch

        return getattr(torch, DTYPES[spec.dtype_of(shape)][2])

    def make_inputs(self, shape, seed: int, device="cuda", pattern: str = "normal") -> dict:
        import torch

        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        inputs = {}
        for spec in self.inputs.values():
            dims = self.tensor_shape(spec, shape)
            if spec.init == "randint":
                t = torch.randint(0, max(1, int(spec.scale)), dims, generator=gen, device=device)
            elif spec.init == "normal":
                t = torch.randn(dims, generator=gen, device=device) * spec.scale
            else:
                t = torch.rand(dims, generator=gen, device=device)
                t = (t * 2 - 1 if spec.init == "uniform" else t + 0.5) * spec.scale
            inputs[spec.name] = t.to(self.torch_dtype(spec, shape)).contiguous()
        inputs["_shape"] = shape  # new_output reads it: the contract hands it only the inputs
        return inputs

    def new_output(self, inputs: dict):
        import torch

        shape, device = inputs["_shape"], inputs[next(iter(self.inputs))].device
        made = {n: torch.empty(self.tensor_shape(s, shape), dtype=self.torch_dtype(s, shape), device=device)
                for n, s in self.outputs.items()}
        return made if len(made) > 1 else next(iter(made.values()))

    def launcher(self, kernel, config, shape, inputs: dict, out):
        import numpy as np

        from ..build.compile import torch_stream_launcher

        outs = out if isinstance(out, dict) else {next(iter(self.outputs)): out}
        env = {**shape.values(), **self.constants, "dtype_bytes": DTYPES[shape.dtype][1]}
        args = []
        for kind, what in self.args:
            if kind == "tensor":
                t = inputs[what] if what in self.inputs else outs[what]
                if not t.is_contiguous():
                    raise UsageError(f"{self.name}: {what} must be contiguous")
                args.append(np.uint64(t.data_ptr()))
            elif kind == "float":
                args.append(np.float32(self.constants[what]))
            else:
                args.append(np.int32(safe_eval(what, env)))
        geo = self.geometry(config, shape)
        return torch_stream_launcher(kernel, geo.grid, geo.block, tuple(args), geo.dynamic_smem)

    def _call(self, function: tuple[Path, str], shape, inputs: dict):
        """The user's function on the inputs (and the shape's names and constants it asks for), its answer as
        one tensor (one output) or name -> tensor."""
        fn = load_function(*function)
        tensors = {k: v for k, v in inputs.items() if not k.startswith("_")}
        given = {**shape.values(), **self.constants, "dtype": shape.dtype, **tensors}
        params = _parameters(fn)
        if params is None:  # a builtin without a readable signature (torch.matmul): the inputs in order
            answer = fn(*tensors.values())
        else:
            if not any(p.kind is p.VAR_KEYWORD for p in params):
                given = {k: v for k, v in given.items() if k in {p.name for p in params}}
            if function[0] is None:  # torch's own `dtype` is a torch.dtype, not the shape's text
                given.pop("dtype", None)
            answer = fn(**given)
        names = list(self.outputs)
        if isinstance(answer, dict):
            answer = {n: answer[n] for n in names} if set(answer) == set(names) else _wrong(function, names)
        elif isinstance(answer, (tuple, list)):
            answer = dict(zip(names, answer)) if len(answer) == len(names) else _wrong(function, names)
        else:
            answer = {names[0]: answer} if len(names) == 1 else _wrong(function, names)
        return answer if len(names) > 1 else answer[names[0]]

    def reference(self, shape, inputs: dict):
        answer = self._call(self._reference, shape, inputs)
        return {n: t.float() for n, t in answer.items()} if isinstance(answer, dict) else answer.float()

    def perturb(self, shape, inputs: dict, rng=None) -> tuple[dict, object]:
        """One element of the perturbed input raised by twice its scale (drawn from `rng`; without one, the
        middle element); the rows that may move are those whose fp32 reference moves at all."""
        x = inputs[self.perturb_input].clone()
        flat = x.view(-1)
        i = rng.randrange(flat.numel()) if rng is not None else flat.numel() // 2
        flat[i] += 2.0 * self.inputs[self.perturb_input].scale
        changed = {**inputs, self.perturb_input: x}
        before, after = self.reference(shape, inputs), self.reference(shape, changed)
        if isinstance(before, dict):
            return changed, {n: _rows_moved(before[n], after[n]) for n in before}
        return changed, _rows_moved(before, after)

    def baselines(self) -> list[str]:
        return list(self._baselines)

    def baseline_launcher(self, name: str, shape, inputs: dict, probe: bool = True):
        if name not in self._baselines:
            known = ", ".join(self._baselines) or "none"
            raise UsageError(f"{self.name}: unknown baseline {name!r}; baselines: {known}")

        def run(function=self._baselines[name]):
            return self._call(function, shape, inputs)

        return self.probed(run, probe)


def _rows_moved(before, after):
    """A mask over all but the last dim of where the reference moved (a 1-D output: one row, the whole vector)."""
    return (before != after).any(dim=-1)


def _parameters(fn):
    """fn's parameters, or None where Python cannot read its signature (a builtin such as torch.matmul)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _unnamed_parameters(fn, given: set[str]) -> list[str]:
    """The parameters of `fn` without a default that no name of `given` fills (none for a builtin, called in order)."""
    params = _parameters(fn) or []
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
            and p.name not in given - {"dtype"}]


def _wrong(function: tuple[Path | None, str], names: list[str]):
    where = function[1] if function[0] is None else f"{function[0].name}:{function[1]}"
    raise UsageError(f"{where} must return the outputs {', '.join(names)}: one tensor for "
                     f"one output, else a tuple in that order or a dict by name")


def _cpp(value) -> str:
    """A template argument as C++ text: true/false, an integer, or a string as written (a type such as __half)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not value.is_integer():
            raise UsageError(f"template argument {value!r} is not an integer")
        value = int(value)
    return str(value)


_FUNCTIONS: dict = {}


def load_function(file: Path | None, name: str):
    """Function `name` of the Python file `file`, imported once per process (under a name of its path's hash); with
    no file, the torch function of that dotted name."""
    key = (str(file), name)
    if key not in _FUNCTIONS and file is None:
        module_name, _, attr = name.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module_name), attr, None)
        except ImportError:
            fn = None
        if not callable(fn):
            raise UsageError(f"no torch function {name!r}")
        _FUNCTIONS[key] = fn
    if key not in _FUNCTIONS:
        module_name = "evotune_family_" + hashlib.sha256(str(file).encode()).hexdigest()[:12]
        module = sys.modules.get(module_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as e:
                del sys.modules[module_name]
                raise UsageError(f"{file}: importing it failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}") \
                    from None
        fn = getattr(module, name, None)
        if not callable(fn):
            raise UsageError(f"{file}: no function {name!r}")
        _FUNCTIONS[key] = fn
    return _FUNCTIONS[key]


_LOADED: dict[str, GenericProblem] = {}


def load_family(path: str | os.PathLike) -> GenericProblem:
    """The family of a family file (one object per file and process)."""
    key = str(Path(path).resolve())
    if key not in _LOADED:
        if not Path(key).is_file():
            raise UsageError(f"family file {str(path)!r}: no such file")
        _LOADED[key] = GenericProblem(key)
    return _LOADED[key]
