"""Instantiate a kernel template for one Config: the template file plus one explicit entry point.

Tile parameters become template arguments of the kernel's traits struct (compile-time
constants), never runtime ints, so each configuration is its own specialised kernel.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import UsageError
from ..paths import REPO_ROOT, package_data_dir  # noqa: F401  (REPO_ROOT: re-exported for callers)


def kernels_dir() -> Path:
    """The CUDA templates: $EVOTUNE_KERNELS, else the packaged `kernels` folder."""
    override = os.environ.get("EVOTUNE_KERNELS")
    return Path(override) if override else package_data_dir("kernels")


@dataclass(frozen=True)
class LaunchGeometry:
    """How one instantiation is launched: grid, block, dynamic shared memory, the setmaxnreg split, and for a
    persistent grid the rule that sizes it for the device (grid_for)."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dynamic_smem: int
    # Registers the CTA's warpgroups hold after setmaxnreg, summed over its threads (0: the kernel does not resize
    # them). setmaxnreg.inc only takes what the CTA's own setmaxnreg.dec freed, so the static gate refuses a kernel
    # whose launch allocates fewer (ptxas's count x threads): its consumers would wait forever.
    register_split: int = 0
    # A persistent grid's work items (0: the grid is fixed). Its x is then min(tiles, the device's SMs), so the grid
    # is a function of the device; `grid` holds it for the SM count the family was asked about.
    tiles: int = 0

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def grid_for(self, multiprocessors: int) -> tuple[int, int, int]:
        """The grid on a device with `multiprocessors` SMs: `grid` itself unless persistent."""
        if not self.tiles:
            return tuple(self.grid)
        return (min(self.tiles, multiprocessors), self.grid[1], self.grid[2])

    def on(self, multiprocessors: int) -> "LaunchGeometry":
        """This geometry with its grid sized for `multiprocessors` SMs."""
        return replace(self, grid=self.grid_for(multiprocessors))

    def as_dict(self) -> dict:
        return {"grid": list(self.grid), "block": list(self.block), "dynamic_smem": self.dynamic_smem}


@dataclass(frozen=True)
class KernelSource:
    """Complete CUDA source of one candidate, the name of its extern "C" entry point, and its launch geometry as the
    family gave it at instantiation (None for code read back from a run's archive: records keep the code, and its
    launch comes from today's family, geometry_of)."""

    family: str
    entry: str
    code: str
    template_path: str
    # Not part of the identity: two sources are the same kernel when their code is (the digest, the cache key).
    geometry: LaunchGeometry | None = field(default=None, compare=False)

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()[:16]


def geometry_of(source: KernelSource, problem, config, shape) -> LaunchGeometry:
    """The launch geometry of `source`: the one its instantiation carries; for a source that carries none (a run's
    archived code, records/sources.py) the family's for (config, shape), as an archived source's launch always is."""
    return source.geometry if source.geometry is not None else problem.geometry(config, shape)


# A local header: `#include "name"` on a line of its own, resolved in the search folders, then the kernels folder;
# a name may be a path under one (`#include "hopper/ring.cuh"`), relative to it, not to the including file's folder.
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)


def read_template(filename: str, _seen: tuple[str, ...] = (), search: tuple[Path, ...] = ()) -> tuple[Path, str]:
    """The template text with its local `#include "..."` headers inlined (recursively), so the
    source NVRTC compiles, the cache key and an exported .cu are one self-contained text. `search`: folders looked
    in before the kernels folder (a template of your own finds the headers beside it)."""
    path = next((d / filename for d in search if (d / filename).is_file()), kernels_dir() / filename)
    if filename in _seen:
        raise UsageError(f"{path}: #include cycle through {' -> '.join(_seen + (filename,))}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        where = f" (included from {_seen[-1]})" if _seen else ""
        raise UsageError(f"{path}: kernel template not found{where}") from None

    return path, inline_includes(text, _seen + (filename,), search)


def inline_includes(text: str, seen: tuple[str, ...] = (), search: tuple[Path, ...] = ()) -> str:
    """`text` with each local `#include "name"` line replaced by that header (read_template: recursively), looked up
    in the folders of `search` first, then in the kernels folder."""
    def inline(match: re.Match) -> str:
        name = match.group(1)
        _, body = read_template(name, seen, search)
        return f"// ---- begin {name}\n{body.rstrip()}\n// ---- end {name}"

    return _LOCAL_INCLUDE.sub(inline, text)


# A template line that only some configs keep: `//[flag] code`, the marker first on the line after its indentation.
# A config whose Problem.template_flags holds `flag` keeps `code` at that indentation; any other loses the whole line.
# So lines added this way leave every instantiation without the flag byte for byte what it was (its digest and
# cached cubin with it), which a template argument could not: any new text in the template changes the source of
# every config. In the file the lines are comments, so the template still compiles standalone, without the flag.
_FLAGGED_LINE = re.compile(r"^([ \t]*)//\[([A-Za-z_][A-Za-z0-9_]*)\] ?(.*\n?)", re.MULTILINE)


def select_flagged_lines(text: str, flags) -> str:
    """`text` with the `//[flag]` lines of `flags` turned into code and those of any other flag removed. A line may
    carry two markers, `//[a] //[b] code`: it is code only where both flags are on (the first pass leaves `//[b] code`
    where a is on, the second selects that), for the lines where two knobs' code meets."""
    def select(part: str) -> str:
        return _FLAGGED_LINE.sub(lambda m: m.group(1) + m.group(3) if m.group(2) in flags else "", part)

    return select(select(text))


def template_flag_names(text: str) -> set[str]:
    """The flags that `//[flag]` lines of `text` name (a line's second marker too)."""
    outer = {m.group(2) for m in _FLAGGED_LINE.finditer(text)}
    inner = _FLAGGED_LINE.sub(lambda m: m.group(1) + m.group(3), text)
    return outer | {m.group(2) for m in _FLAGGED_LINE.finditer(inner)}


def banner_key(problem, config) -> str:
    """config.key() without the problem's late knobs at the value that leaves the source as it was before them."""
    late = problem.late_knobs
    return ",".join(f"{k}={v}" for k, v in config.items
                    if not (k in late and type(v) is type(late[k]) and v == late[k]))


def instantiate(problem, config, shape, **options) -> KernelSource:
    """Append the problem's instantiation block for (config, shape) to its template, keeping the template's flagged
    lines of the config's template_flags. `options` select a family's output variant (e.g. attention's
    write_lse=True); without them, the searched kernel. The source carries the family's launch geometry for (config,
    shape) (Problem.geometry, asked once here): every consumer reads it from the source."""
    # A template named by its path (a plugin's, a family file's) finds its local headers beside it first.
    search = (Path(problem.kernel_file).parent,) if os.path.isabs(problem.kernel_file) else ()
    path, template = read_template(problem.kernel_file, search=search)
    # A flagged line may name a header (`//[flag] #include "x.cuh"`): code only that flag's configs compile, in a
    # file of its own rather than one comment line each; it is inlined once the line is selected.
    template = inline_includes(select_flagged_lines(template, problem.template_flags(config)), (path.name,), search)
    block = problem.instantiation(config, shape, **options) if options else problem.instantiation(config, shape)
    # Only what changes the code goes in: the same kernel for two shapes is one source and one cache entry; the
    # family by its source_name, which names no folder, so two checkouts compile one source.
    variant = "".join(f" {k}={v}" for k, v in sorted(options.items()))
    name = problem.source_name or problem.family
    banner = f"\n// ---- evotune instantiation: {name} {banner_key(problem, config)}{variant}\n"
    return KernelSource(family=problem.family, entry=problem.entry_name, code=template + banner + block,
                        template_path=str(path), geometry=problem.geometry(config, shape))
