"""Kernel families. Each module defines one Problem: shapes it accepts, how a Config
becomes template arguments and launch geometry, inputs, the launch, and the reference.

The compile/evaluate/search/runs code talks to a family only through this interface
(`Problem` below); the shapes are the family's own, so nothing generic reads their fields.

A family outside evotune (a plugin, named `package.module:ATTR`) is Python code that loading it
runs, so it loads only where the person running evotune allowed its module: EVOTUNE_PLUGINS
lists the allowed modules, comma-separated (a package allows its submodules). A space file or a
run folder naming a plugin therefore never runs code on its own. Worker processes inherit the
variable, so they load the family by the same name.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
import os
import sys
from typing import Iterable, Mapping

from ..build.template import LaunchGeometry  # noqa: F401  (the families' return type, kept importable here)
from ..errors import UsageError
from ..space.searchspace import register_family

# The environment variable that lists the modules plugin families may be loaded from.
PLUGINS_ENV = "EVOTUNE_PLUGINS"


def knob_reader(defaults: Mapping):
    """A family's knob(config, name): the config's value of `name`, else the family's default from `defaults` (a
    config recorded before a knob existed leaves it out)."""
    def knob(config, name: str):
        value = config.get(name)
        return defaults[name] if value is None else value

    return knob


def sink_logits(shape, gen, device):
    """A sinks shape's (H,) float32 sink logits for the gate (attention and attention-decode alike): about the
    log-sum-exp of a row of N(0, 1) scores over the shape's keys (log(Sk) + 1/2) plus N(0, 2^2), so some heads' sinks
    take most of the mass, others almost none, and the sink's term is measured where it matters."""
    import math

    import torch

    return torch.randn(shape.heads, generator=gen, device=device) * 2.0 + (math.log(shape.seq_k) + 0.5)


def check_sinks(sinks, shape, device, family: str = "attention"):
    """The sink logits a sinks shape's launch reads: a contiguous (H,) float32 tensor on `device`; UsageError for
    anything else (the kernel reads H floats from the pointer, so a wrong size would read past it)."""
    import torch

    if not isinstance(sinks, torch.Tensor):
        raise UsageError(f"{family}: {shape.spec}: sinks needs the ({shape.heads},) float32 sink logits, got "
                         f"{type(sinks).__name__}")
    if (tuple(sinks.shape) != (shape.heads,) or sinks.dtype != torch.float32 or not sinks.is_contiguous()
            or sinks.device != device):
        raise UsageError(f"{family}: {shape.spec}: sinks must be a contiguous ({shape.heads},) float32 tensor on "
                         f"{device}, got {tuple(sinks.shape)} {sinks.dtype} on {sinks.device}")
    return sinks


def aim_key(inputs: dict, b: int, kvh: int, j: int, head: int, row: int) -> tuple:
    """The attention families' dependency-check perturbation: (k, v), clones of the inputs' K and V (strides kept)
    whose key j of batch b and K/V head kvh points at query `row` of query head `head` (that query's score for it
    becomes 6: e^6 times an average key's weight) and whose value is raised by 8 per 512 keys, at least 8.

    A key nudged by a constant (K +1, V +8) has a weight of ~1/Sk in a row that sees all Sk keys: with one or a few
    query rows (decode, Sq = 1 prefill) and Sk in the thousands it moved no row beyond the gate's tolerance, and the
    check called every kernel "too weak". Aimed and raised, it moves the chosen row clearly at any cache length."""
    target = inputs["q"][b, head, row, :].float()
    k, v = inputs["k"].clone(), inputs["v"].clone()
    k[b, kvh, j, :] = (6.0 * target / (inputs["scale"] * target.pow(2).sum().clamp_min(1e-6))).to(k.dtype)
    v[b, kvh, j, :] += 8.0 * max(1, k.shape[2] // 512)
    return k, v


class Problem(ABC):
    """One kernel family as the generic code sees it: the whole contract. A family sets the class
    attributes and implements every abstract method; the other methods are documented defaults it may
    keep. Generic code calls these and nothing else (no probing with getattr/hasattr), so a family
    that cannot be instantiated for lack of a method fails at once, not in the middle of a search.

    A shape is the family's own frozen, hashable dataclass with `spec` (its `--shape`
    spelling), `as_dict()` (read back by `shape_from_dict`) and `dtype`; only the family's
    module reads its other fields (its FLOPs and bytes reach generic code through `work`).

    A launch may write several outputs: new_output then returns name -> tensor, reference the same names,
    perturb one row mask per name, and a baseline all of them; the gate checks each (gpu/evaluate.py).

    A plugin's `kernel_file` and `default_space` may be paths relative to its module's folder.
    evotune.problems.generic declares a whole family in a YAML file instead (docs/PLUGINS.md).
    """

    family: str                           # the name runs record and get_problem() takes
    kernel_file: str                      # the CUDA template, under kernels/
    entry_name: str                       # the extern "C" entry point of an instantiation
    default_space: str                    # the built-in space, search_spaces/<default_space>.yaml
    default_shape: str                    # the `--shape` of a command given none
    title: str = "kernel"                 # what an export header calls the kernel
    context_names: tuple[str, ...] = ()   # the names context() gives a space's expressions
    PATTERNS: tuple[str, ...] = ("normal",)  # input patterns of the gate ("normal" first)
    perturbed = "input"                   # what perturb() changes, in the dependency check's words
    baseline_kind: str = "baseline"       # the word before a baseline's name in reports
    rate_unit: str = "GB/s"               # the unit of rate(), a column heading in reports
    # Shape fields that only change the problem's size (warm start takes runs that differ only in these).
    size_fields: frozenset[str] = frozenset()
    # How a one-line config summary spells each knob: a prefix for its value ("" = the value alone), or for
    # a bool knob (text if true, text if false); a knob not named here is spelled by name and value.
    knob_abbrev: Mapping[str, str | tuple[str, str]] = {}
    # How an instantiation's banner names the family ("" = `family`): a family file's family is its absolute path,
    # which would make two checkouts of one kernel two sources (two digests, two cache entries).
    source_name: str = ""

    # ------------------------------------------------------------ shapes (CPU)
    @abstractmethod
    def parse_shape(self, text: str):
        """A preset name or the family's spelling as a shape; UsageError naming the fault otherwise."""

    @abstractmethod
    def shape_from_dict(self, d: dict):
        """The shape that `shape.as_dict()` wrote (run records, worker jobs)."""

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

    @abstractmethod
    def context(self, shape) -> dict:
        """The names `context_names` for `shape`: what the space's expressions may read."""

    def knob_domains(self) -> Mapping[str, tuple | range | None] | None:
        """Knob name -> the values the template accepts (a tuple, a range of ints, or None for any value); None:
        undeclared, not checked (a misspelled knob then reaches the template)."""
        return None

    def load_space(self, context_names):
        """The family's default space: the built-in `default_space`, or the file it names (a plugin's, beside it)."""
        from ..space.reader import load_builtin, load_space

        if self.default_space.endswith((".yaml", ".yml")) or os.sep in self.default_space:
            return load_space(self.default_space, context_names, self.knob_domains())
        return load_builtin(self.default_space, context_names)

    def work(self, shape) -> tuple[float | None, float | None]:
        """(FLOPs, fewest bytes moved) of one call on `shape`, or None each: what bench's roofline reads. By default
        the shape's own `flops()` and `min_bytes()`, the two methods a shape may define for it."""
        flops = shape.flops() if callable(getattr(type(shape), "flops", None)) else None
        nbytes = shape.min_bytes() if callable(getattr(type(shape), "min_bytes", None)) else None
        return flops, nbytes

    def rate(self, shape, time_us: float) -> float | None:
        """Throughput in `rate_unit` at `time_us` per call, or None."""
        return None

    def similar_shapes(self, a: dict, b: dict) -> bool:
        """Whether runs on shape dicts `a` and `b` may warm-start each other: equal but for `size_fields`."""
        keys = (set(a) | set(b)) - self.size_fields
        return all(a.get(k) == b.get(k) for k in keys)

    # ------------------------------------------------------------ code (CPU)
    # Knobs added after runs were recorded, each with the value a config recorded without it means. The
    # instantiation's banner leaves a knob at that value out, so a config that states it and one recorded without
    # it are one source: one digest (the tuning table's check), one cached cubin. (Records keep their own sources,
    # runs/<run>/sources, so a knob no longer has to leave old text unchanged: knobs are traits parameters.)
    late_knobs: Mapping[str, object] = {}

    def template_flags(self, config) -> frozenset[str]:
        """The flags whose `//[flag]` template lines this config keeps (build.template.select_flagged_lines); the
        lines of every other flag are dropped. None by default. Only instrumentation uses them (tools/phase_trace.py's
        `//[trace]` lines, which must not perturb the measured source, and tools/time_configs.py's unsearched
        `//[no_wg_overlap]` baseline); a searched knob is a traits template parameter, never a flag."""
        return frozenset()

    @abstractmethod
    def instantiation(self, config, shape, **options) -> str:
        """The explicit instantiation appended to the template: one extern "C" entry point. `options`:
        family-defined output variants that are not knobs (attention's `write_lse`); none by default."""

    @abstractmethod
    def geometry(self, config, shape) -> LaunchGeometry:
        """Grid, block and dynamic shared memory of `config` on `shape` (a persistent grid: its `tiles`, and the grid
        for the H100's SMs). Asked once per instantiation (build.template.instantiate): consumers read the
        KernelSource's `geometry`, and size a persistent grid for their device with its grid_for."""

    @abstractmethod
    def signature(self, config=None) -> str:
        """The entry point's parameters in words, for an export header."""

    def launch_notes(self, config, shape) -> list[str]:
        """Extra launch requirements for an export header."""
        return []

    @abstractmethod
    def tolerance(self, shape) -> tuple[float, float]:
        """(atol, rtol) of the elementwise gate."""

    # ------------------------------------------------------------ GPU side
    @abstractmethod
    def make_inputs(self, shape, seed: int, device="cuda", pattern: str = "normal") -> dict:
        """Fresh random inputs (never zeros) for `seed` in input pattern `pattern`: name -> tensor."""

    @abstractmethod
    def new_output(self, inputs: dict):
        """An output tensor for `inputs` (the gate places it inside guard bands and poisons it)."""

    @abstractmethod
    def launcher(self, kernel, config, shape, inputs: dict, out):
        """A zero-argument callable that launches `kernel` on `inputs` into `out` on torch's current stream."""

    @abstractmethod
    def reference(self, shape, inputs: dict):
        """The fp32 answer for `inputs`."""

    @abstractmethod
    def perturb(self, shape, inputs: dict, rng=None) -> tuple[dict, object]:
        """(inputs with one element changed, bool mask over all but the output's last dim of the rows that may move).
        `rng` (a random.Random) draws where: the gate passes a fresh one per candidate, so no kernel can learn
        the position (a family may ignore it, at the cost of a position a kernel could leave out of a fingerprint)."""

    @abstractmethod
    def baselines(self) -> list[str]:
        """Names of the reference implementations timed beside the kernel (SDPA backends, torch.softmax)."""

    def baselines_for(self, shape) -> list[str]:
        """The baselines timed beside the kernel on `shape` (by default baselines(), whatever the shape)."""
        return self.baselines()

    @abstractmethod
    def baseline_launcher(self, name: str, shape, inputs: dict, probe: bool = True):
        """A zero-argument callable returning baseline `name`'s output on `inputs`, or None if it refuses them."""

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


# The built-in families: name -> the module (under evotune.problems) whose PROBLEM it is. Imported on
# first use, so naming a family costs nothing until it is used.
REGISTRY: dict[str, str] = {"attention": "attention", "softmax": "softmax", "attention-decode": "decode"}
FAMILIES = tuple(REGISTRY)


def get_problem(family: str) -> Problem:
    """The Problem object of a family name, or of a plugin path `package.module:ATTR` (a family
    defined outside evotune, loaded only where EVOTUNE_PLUGINS allows its module; worker processes
    load it by that same name)."""
    if _is_family_file(family):
        return load_family_file(family)
    if ":" in family:
        return load_plugin(family)
    module = REGISTRY.get(family)
    if module is None:
        raise UsageError(f"unknown kernel family {family!r}; known: {', '.join(FAMILIES)}; a family of your own is "
                         f"a family file (path/to/family.yaml, docs/PLUGINS.md) or a plugin package.module:ATTR")
    return importlib.import_module(f"{__name__}.{module}").PROBLEM


# The space loader checks a file's names against its family's; it sits below the families, so they tell it.
for _name in REGISTRY:
    register_family(_name, lambda name=_name: get_problem(name))


# What the search, the workers and the CLI use first of a Problem: named when a plugin's object is not a Problem.
PROBLEM_ATTRIBUTES = ("family", "kernel_file", "entry_name", "check_shape", "context", "instantiation", "geometry")


def _is_family_file(name: str) -> bool:
    return str(name).endswith((".yaml", ".yml"))


def load_family_file(path: str):
    """The family a family file declares (evotune.problems.generic), where the person running evotune allowed it:
    loading it imports its reference module. `--family FILE` allows it (allow_plugins), as EVOTUNE_PLUGINS listing
    the file or a folder above it does; a space or a run folder naming it does not."""
    from pathlib import Path

    resolved = Path(path).resolve()
    allowed = [Path(p).resolve() for p in allowed_plugin_modules() if _is_path_entry(p)]
    if not any(resolved == a or a in resolved.parents for a in allowed):
        raise UsageError(f"kernel family {str(path)!r} is a family file: loading it runs its reference module; to "
                         f"allow that, name it with --family, or set {PLUGINS_ENV}={resolved} (or its folder)")
    # By name, as the registry's families: the module imports this one.
    return importlib.import_module(f"{__name__}.generic").load_family(resolved)


def _is_path_entry(entry: str) -> bool:
    """An EVOTUNE_PLUGINS entry naming a family file or a folder of them (rather than a module)."""
    return os.sep in entry or _is_family_file(entry)


def allowed_plugin_modules() -> tuple[str, ...]:
    """The modules EVOTUNE_PLUGINS allows plugin families to be loaded from (a package allows its submodules)."""
    return tuple(m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip())


def allow_plugins(modules: Iterable[str]) -> None:
    """Allow plugin families from `modules` in this process and the workers it starts (what a `--plugin` flag calls)."""
    modules = [str(_absolute(m.strip())) if _is_family_file(m.strip()) else m.strip() for m in modules]
    for module in modules:
        if not _is_module_name(module) and not _is_family_file(module):
            raise UsageError(f"plugin module {module!r}: write a module name, package.module")
    os.environ[PLUGINS_ENV] = ",".join(dict.fromkeys(allowed_plugin_modules() + tuple(modules)))


def plugin_allowed(module_name: str) -> bool:
    """True when the person running evotune allowed `module_name`; evotune's own modules always are."""
    return any(module_name == m or module_name.startswith(m + ".") for m in ("evotune", *allowed_plugin_modules()))


def _absolute(path: str):
    from pathlib import Path

    return Path(path).resolve()


def _is_module_name(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def load_plugin(path: str):
    """The Problem object `ATTR` of module `package.module`, for `path` = "package.module:ATTR".

    The module must be allowed (`plugin_allowed`): otherwise a UsageError says how to allow it and
    nothing is imported. It is imported as Python would import it; when it is not found there, the
    current directory is tried too (the `evotune` console script does not put it on sys.path,
    `python -m` does), so `evotune search --space my_space.yaml` finds an allowed family module
    beside the space. The object's `family` must be `path` itself: it is the name the run records
    and the name a worker process, which starts with none of this process's imports, loads the family by.
    """
    module_name, _, attr = path.partition(":")
    if not _is_module_name(module_name) or not attr.isidentifier():
        raise UsageError(f"kernel family {path!r}: a family outside evotune is written package.module:ATTR")
    if not plugin_allowed(module_name):
        raise UsageError(f"kernel family {path!r} is a plugin: loading it runs the Python module {module_name!r}; "
                         f"to allow that, set {PLUGINS_ENV}={module_name} (comma-separated for several)")
    try:
        module = _import_plugin(module_name)
    except SystemExit as e:  # a plugin may not end evotune, with any exit code
        raise UsageError(f"kernel family {path!r}: importing module {module_name!r} failed: {_one_line(e)}") from None
    except Exception as e:  # the plugin's own bug: raised as it is, with the line the CLI prints (exit 2) for it
        e.evotune_usage_line = f"kernel family {path!r}: importing module {module_name!r} failed: {_one_line(e)}"
        raise
    if module is None:
        raise UsageError(f"kernel family {path!r}: no module {module_name!r} (is it on PYTHONPATH?)")
    problem = getattr(module, attr, None)
    if problem is None:
        raise UsageError(f"kernel family {path!r}: module {module_name!r} has no {attr!r}")
    if not isinstance(problem, Problem):
        missing = [name for name in PROBLEM_ATTRIBUTES if not hasattr(problem, name)]
        why = f"no {', '.join(missing)}" if missing else "subclass evotune.problems.Problem"
        raise UsageError(f"kernel family {path!r}: {type(problem).__name__} is not a Problem ({why})")
    if problem.family != path:
        raise UsageError(f"kernel family {path!r}: its family attribute is {problem.family!r}; it must be {path!r}, "
                         f"the name worker processes load it by")
    _files_beside(problem, module)
    return problem


def _files_beside(problem: Problem, module) -> None:
    """A plugin's template and space named relative to its module's folder are found there (the kernels folder and
    the built-in spaces stay first, as before): the object keeps their absolute paths."""
    from pathlib import Path

    from ..build.template import kernels_dir

    folder = Path(getattr(module, "__file__", "") or ".").resolve().parent
    kernel = getattr(problem, "kernel_file", "")
    if kernel and not (kernels_dir() / kernel).is_file() and (folder / kernel).is_file():
        problem.kernel_file = str(folder / kernel)
    space = getattr(problem, "default_space", "")
    if space and space.endswith((".yaml", ".yml")) and not os.path.isabs(space) and (folder / space).is_file():
        problem.default_space = str(folder / space)


def _one_line(e: BaseException) -> str:
    """An exception a plugin raised on import, in one line (sys.exit too: a plugin may not end evotune)."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _import_plugin(module_name: str):
    """The allowed module `module_name`, from sys.path and then the current directory; None when neither has it."""

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
    return module
