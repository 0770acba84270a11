"""Hand-made tuning-table entries for the table and op tests (a test fixture, not a measurement)."""

from __future__ import annotations

from functools import lru_cache

from evotune.problems import get_problem
from evotune.problems.shapes import Shape
from evotune.space.searchspace import Config, load_builtin, spaces_dir
from evotune.build.template import instantiate
from evotune.records.tuning_table import Entry, Table, TableKey

H100 = ("NVIDIA H100 80GB HBM3", "9.0")


def entry(shape: Shape, config: dict | None = None, space: str = "attention", gpu=H100, route: str = "evotune",
          evotune_us: float = 1.0, sdpa: tuple[str, float] | None = ("cudnn", 2.0), digest: str | None = None,
          run: str = "fixture") -> Entry:
    """An entry for `shape` on `gpu`: by default the space's default config, the kernel source the
    template gives now, and an evotune time half the SDPA one."""
    cfg = Config.from_dict(config) if config is not None else default_config(space)
    if digest is None:
        digest = instantiate(get_problem("attention"), cfg, shape).digest
    name, cc = gpu
    return Entry(TableKey.for_shape(shape, name, cc), cfg.as_dict(), space, shape.as_dict(), evotune_us,
                 {"backend": sdpa[0], "time_us": sdpa[1]} if sdpa else None, route, f"fixture route {route}",
                 {"kind": "none", "file": None},
                 {"run": run, "trial": 0, "git_sha": "test", "evotune_version": "0.1.0",
                  "device": {"name": name, "sm": cc}, "source_digest": digest})


def default_config(space: str) -> Config:
    """The built-in space's default config, read once per version of its file (reading attention.yaml takes a
    quarter of a second, and the table tests make hundreds of entries)."""
    root = spaces_dir() / f"{space.partition(':')[0]}.yaml"
    return _default_config(space, str(root), root.stat().st_mtime_ns if root.is_file() else None)


@lru_cache(maxsize=None)
def _default_config(space: str, root: str, mtime_ns) -> Config:
    return load_builtin(space).default_config()


def table(*entries: Entry, path: str | None = None) -> Table:
    return Table(tuple(entries), path)
