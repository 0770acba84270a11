"""What the command modules share: the typer app they register on, the consoles, loading a family's
problem, shape and space, JSON output, the GPU checks, and a table that fits the console.

The app lives here, not in the package's __init__, so that the command modules import it from beside
them and the package imports them (to register their commands) without a cycle.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from ..errors import NoGPUError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Autotune and evolve templated CUDA kernels (fused attention forward on the H100).")
console = Console()
err_console = Console(stderr=True)

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
INTERRUPTED = "evotune: interrupted"
FAMILY_HELP = ("Kernel family: attention, softmax, a family file (path/to/family.yaml: docs/PLUGINS.md) or "
               "package.module:ATTR (a plugin; naming it here allows its module; default: the one the --space file "
               "names, else attention).")
SHAPE_HELP = "Preset name (`evotune shapes --family F`) or the family's spelling (default: the family's)."


# Bounds of the numeric options, checked by the parser before anything runs (a value past them is a typo or a
# paste, not a plan: 10 million trials is years of GPU time; CUDA numbers devices below 1024; NumPy's seeds are 32-bit).
MAX_TRIALS = 10_000_000
MAX_SEED = 2**32 - 1
MAX_GPU_INDEX = 1023
MAX_WORKERS = 1024
MAX_REPS = 1_000_000
MAX_SAMPLE = 1_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600.0
SEED_RANGE = {"min": 0, "max": MAX_SEED}
GPU_RANGE = {"min": 0, "max": MAX_GPU_INDEX}


def timeout_seconds(value: float) -> float:
    """An option's callback: a timeout in seconds, finite, above 0 and at most a week."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise typer.BadParameter(f"{value} is not a number of seconds in (0, {MAX_TIMEOUT_S:.0f}]")
    return value


def emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def named_family(family: str):
    """The Problem of a family named on the command line: naming a family file or a plugin `package.module:ATTR`
    there is the consent to load it (the family spelled once, no --plugin beside it)."""
    from pathlib import Path

    from ..problems import allow_plugins, get_problem
    from ..problems.generic import is_family_file

    if is_family_file(family):
        allow_plugins([family])
        family = str(Path(family).resolve())
    elif ":" in family:
        module, _, attr = family.partition(":")
        if not all(part.isidentifier() for part in module.split(".")) or not attr.isidentifier():
            raise UsageError(f"kernel family {family!r}: a family outside evotune is written package.module:ATTR")
        allow_plugins([module])
    return get_problem(family)


def load_problem(shape_text: Optional[str], space_path: Optional[str], family: Optional[str] = None,
                 recorded: Optional[str] = None):
    """(problem, shape, space): the family is --family (loaded with the consent naming it gives), else `recorded`
    (a resumed run's: loaded only where EVOTUNE_PLUGINS allows it), else the one the --space file names, else
    attention; the shape is parsed by that family (its default shape when none is given)."""
    from pathlib import Path

    from ..problems import get_problem
    from ..problems.generic import is_family_file
    from ..space.searchspace import check_nonempty, load_space, resolve_space, space_family

    # A space file names its family, so `--space` alone picks it (a plugin `package.module:ATTR` too, and a family
    # file, named relative to the space file's folder).
    space_path = resolve_space(space_path) if space_path else None
    declared = space_family(space_path) if space_path else None
    if declared and is_family_file(declared):
        declared = str((Path(space_path.partition("#")[0]).parent / declared).resolve())
        if Path(declared) == Path(space_path).resolve():  # --space names a family file: the family itself
            family = family or declared
    problem = named_family(family) if family else get_problem(recorded or declared or "attention")
    if declared is not None and declared != problem.family:
        raise UsageError(f"{space_path}: space is for family {declared!r}, not {problem.family!r}")
    shape = problem.parse_shape(shape_text if shape_text is not None else problem.default_shape)
    problem.check_shape(shape)
    # The space's expressions may read exactly the names the family's context gives.
    names = tuple(problem.context(shape))
    space = load_space(space_path, names, problem.knob_domains()) if space_path else problem.load_space(names)
    if space.family != problem.family:
        raise UsageError(f"{space.path}: space is for family {space.family!r}, not {problem.family!r}")
    check_nonempty(space, problem.context(shape))
    _check_knobs_read(problem, shape, space)
    return problem, shape, space


def _check_knobs_read(problem, shape, space) -> None:
    """A family that declares no knob domains (a plugin's choice) reads its knobs by name: a knob the space lacks,
    misspelled there, is a KeyError in its instantiation. Said here, before any compile, as the space's error at the
    line of the parameter nearest the name read."""
    import difflib

    from ..build.template import instantiate

    if problem.knob_domains() is not None:
        return
    config = space.default_config()
    try:
        instantiate(problem, config, shape)  # the family's code and launch geometry: both read the knobs
    except KeyError as e:
        name = str(e.args[0]) if e.args else "?"
        near = difflib.get_close_matches(name, space.param_names(), n=1)
        line = next((p.line for p in space.params if near and p.name == near[0]), 1)
        hint = f"; is {near[0]!r} a misspelling of it?" if near else f"; its parameters: {', '.join(space.param_names())}"
        raise UsageError(f"{space.path.partition('#')[0]}:{line}: the {problem.family} family reads knob {name!r}, "
                         f"which the space does not have{hint}") from None


def gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def require_gpu(command: str) -> None:
    if gpu_count() < 1:
        raise NoGPUError(f"no CUDA GPU is visible: `evotune {command}` needs one "
                         f"(`evotune check` compiles and reports resources without a GPU)")


def check_devices(devices: list[int]) -> None:
    """UsageError where --gpus names a device index at or past the number of visible GPUs."""
    count = gpu_count()
    missing = sorted({d for d in devices if d >= count})
    if missing:
        seen = f"{count} CUDA device{'s' if count != 1 else ''} visible (indices 0-{count - 1})"
        raise UsageError(f"--gpus names GPU {', '.join(map(str, missing))}, but there {'are' if count != 1 else 'is'} "
                         f"{seen}; CUDA_VISIBLE_DEVICES renumbers them")


_FOLD_MIN = 24  # narrowest a folded description stays readable


def print_fit_table(title: str, headers: list[str], rows: list[list[str]], drop_order: tuple[str, ...] = ()) -> None:
    """Print `rows` as a table that fits this console. The first column holds the names a user types (a preset,
    a run): it is never wrapped or cut. Columns of `drop_order` may fold down to _FOLD_MIN characters; where even
    that does not fit they are left out, in that order. A name wider than the console gets plain lines instead."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if widths[0] + 4 > console.width:
        console.print(title, highlight=False)
        for r in [headers, *rows]:
            console.print("  ".join(r), highlight=False, markup=False, soft_wrap=True)
        return
    foldable = {headers.index(name) for name in drop_order}
    shown = list(range(len(headers)))
    for name in drop_order:
        needed = sum(min(widths[i], _FOLD_MIN) if i in foldable else widths[i] for i in shown)
        if needed + 3 * len(shown) + 1 <= console.width:
            break
        shown.remove(headers.index(name))
    table = Table(title=title)
    for i in shown:
        first = i == 0
        table.add_column(headers[i], no_wrap=first, min_width=widths[i] if first else None, overflow="fold")
    for r in rows:
        table.add_row(*(r[i] for i in shown))
    console.print(table)
