"""Kernel families. Each module defines one Problem: shapes it accepts, how a Config
becomes template arguments and launch geometry, inputs, the launch, and the reference.

The compile/evaluate/search/runs code talks to a family only through this interface
(`Problem` below); the shapes are the family's own, so nothing generic reads their fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError


@dataclass(frozen=True)
class LaunchGeometry:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def as_dict(self) -> dict:
        return {"grid": list(self.grid), "block": list(self.block), "dynamic_smem": self.dynamic_smem}


class Problem:
    """One kernel family as the generic code sees it. A family sets the class attributes and
    defines the methods that raise NotImplementedError; the others are defaults it may keep.

    A shape is the family's own frozen, hashable dataclass with `spec` (its `--shape`
    spelling), `as_dict()` (read back by `shape_from_dict`) and `dtype`; only the family's
    module reads its other fields.
    """

    family: str                           # the name runs record and get_problem() takes
    kernel_file: str                      # the CUDA template, under kernels/
    entry_name: str                       # the extern "C" entry point of an instantiation
    default_space: str                    # the built-in space, search_spaces/<default_space>.yaml
    default_shape: str                    # the `--shape` of a command given none
    title = "kernel"                      # what an export header calls the kernel
    context_names: tuple[str, ...] = ()   # the names context() gives a space's expressions
    PATTERNS: tuple[str, ...] = ("normal",)  # input patterns of the gate ("normal" first)
    perturbed = "input"                   # what perturb() changes, in the dependency check's words
    baseline_kind = "baseline"            # the word before a baseline's name in reports
    rate_unit = "GB/s"                    # the unit of rate()

    # ------------------------------------------------------------ shapes (CPU)
    def parse_shape(self, text: str):
        """A preset name or the family's spelling as a shape; UsageError naming the fault otherwise."""
        raise NotImplementedError

    def shape_from_dict(self, d: dict):
        raise NotImplementedError

    def presets(self) -> dict:
        """Preset name -> (shape, one line about it)."""
        return {}

    def shape_columns(self, shape) -> dict:
        """Column -> text of `shape` for a table of presets."""
        return {"spec": shape.spec}

    def describe_shape(self, shape) -> str:
        """The shape in words for an export header."""
        return shape.spec

    def sanitize_shape(self, shape):
        """A small shape of the same class for compute-sanitizer, which runs ~100x slower."""
        return shape

    def check_shape(self, shape) -> None:
        """Raise UsageError for a shape the kernel does not compute."""

    def context(self, shape) -> dict:
        """The names `context_names` for `shape`: what the space's expressions may read."""
        raise NotImplementedError

    def rate(self, shape, time_us: float) -> float | None:
        """Throughput in `rate_unit` at `time_us` per call, or None."""
        return None

    # ------------------------------------------------------------ code (CPU)
    def instantiation(self, config, shape) -> str:
        """The explicit instantiation appended to the template: one extern "C" entry point."""
        raise NotImplementedError

    def geometry(self, config, shape) -> LaunchGeometry:
        raise NotImplementedError

    def signature(self, config=None) -> str:
        """The entry point's parameters in words, for an export header."""
        raise NotImplementedError

    def launch_notes(self, config, shape) -> list[str]:
        """Extra launch requirements for an export header."""
        return []

    def tolerance(self, shape) -> tuple[float, float]:
        """(atol, rtol) of the elementwise gate."""
        raise NotImplementedError

    # ------------------------------------------------------------ GPU side
    # make_inputs(shape, seed, device="cuda", pattern="normal") -> dict; new_output(inputs);
    # launcher(kernel, config, shape, inputs, out) -> zero-argument launch; reference(shape, inputs)
    # -> fp32 tensor; perturb(shape, inputs) -> (inputs, bool mask over all but the last output dim);
    # baselines() -> names; baseline_launcher(name, shape, inputs, probe=True) -> callable or None.
    def error_scale(self, inputs) -> float:
        """The scale of the gate's absolute tolerance for these inputs."""
        return 1.0

    def baseline_skip_reason(self, name: str, shape) -> str | None:
        """Why baseline `name` is not measured on `shape` (too large, ...), or None."""
        return None

    @staticmethod
    def probed(run, probe: bool):
        """What baseline_launcher returns: `run`, or, with `probe`, None if running it once raises
        RuntimeError (the backend refuses these inputs)."""
        if probe:
            import torch

            try:
                run()
                torch.cuda.synchronize()
            except RuntimeError:
                return None
        return run


def get_problem(family: str):
    """The Problem object of a family name, or of a plugin path `package.module:ATTR` (a family
    defined outside evotune; worker processes load it by that same name)."""
    if ":" in family:
        return load_plugin(family)
    if family == "attention":
        from .attention import PROBLEM

        return PROBLEM
    if family == "softmax":
        from .softmax import PROBLEM

        return PROBLEM
    raise UsageError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}")


FAMILIES = ("attention", "softmax")


# What the search, the workers and the CLI use of a Problem: a plugin lacking one fails at load, in one line.
PROBLEM_ATTRIBUTES = ("family", "kernel_file", "entry_name", "check_shape", "context", "instantiation", "geometry")


def load_plugin(path: str):
    """The Problem object `ATTR` of module `package.module`, for `path` = "package.module:ATTR".

    The module is imported as Python would import it; when it is not found there, the current
    directory is tried too (the `evotune` console script does not put it on sys.path, `python -m`
    does), so `evotune search --space my_space.yaml` finds a family module beside the space.
    The object's `family` must be `path` itself: it is the name the run records and the name a
    worker process, which starts with none of this process's imports, loads the family by.
    """
    import importlib
    import os
    import sys

    module_name, _, attr = path.partition(":")
    if not all(part.isidentifier() for part in module_name.split(".")) or not attr.isidentifier():
        raise UsageError(f"kernel family {path!r}: a family outside evotune is written package.module:ATTR")

    def find():
        try:
            return importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only the module itself (or its package) missing is a bad path; a missing dependency inside it is not.
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise
            return None

    module = find()
    if module is None and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
        module = find()
    if module is None:
        raise UsageError(f"kernel family {path!r}: no module {module_name!r} (is it on PYTHONPATH?)")
    problem = getattr(module, attr, None)
    if problem is None:
        raise UsageError(f"kernel family {path!r}: module {module_name!r} has no {attr!r}")
    missing = [name for name in PROBLEM_ATTRIBUTES if not hasattr(problem, name)]
    if missing:
        raise UsageError(f"kernel family {path!r}: {type(problem).__name__} is not a Problem (no {', '.join(missing)})")
    if problem.family != path:
        raise UsageError(f"kernel family {path!r}: its family attribute is {problem.family!r}; it must be {path!r}, "
                         f"the name worker processes load it by")
    return problem
