"""Instantiate a kernel template for one Config: the template file plus one explicit entry point.

Tile parameters become template arguments of the kernel's traits struct (compile-time
constants), never runtime ints, so each configuration is its own specialised kernel.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError

REPO_ROOT = Path(__file__).resolve().parents[1]


def kernels_dir() -> Path:
    return Path(os.environ.get("EVOTUNE_KERNELS", REPO_ROOT / "kernels"))


@dataclass(frozen=True)
class KernelSource:
    """Complete CUDA source of one candidate and the name of its extern "C" entry point."""

    family: str
    entry: str
    code: str
    template_path: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()[:16]


def read_template(filename: str) -> tuple[Path, str]:
    path = kernels_dir() / filename
    try:
        return path, path.read_text()
    except FileNotFoundError:
        raise UsageError(f"{path}: kernel template not found") from None


def instantiate(problem, config, shape) -> KernelSource:
    """Append the problem's instantiation block for (config, shape) to its template."""
    path, template = read_template(problem.kernel_file)
    block = problem.instantiation(config, shape)
    # Only what changes the code goes in: the same kernel for two shapes is one source and one cache entry.
    banner = f"\n// ---- evotune instantiation: {problem.family} {config.key()}\n"
    return KernelSource(family=problem.family, entry=problem.entry_name, code=template + banner + block,
                        template_path=str(path))
