"""`evotune shapes` and `evotune check`: what a family offers before any GPU work, its shape presets
and the static check of its space (real NVRTC compiles, no GPU)."""

from __future__ import annotations

import os
import time
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from ..errors import EvotuneError
from .common import (FAMILY_HELP, MAX_SAMPLE, MAX_WORKERS, SEED_RANGE, SHAPE_HELP, app, console, emit_json, err_console,
                     load_problem, named_family, print_fit_table)
from .display import cfg_short


@app.command()
def shapes(
    family: str = typer.Option("attention", "--family", help="Kernel family whose presets to list."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """List a family's shape presets (attention's `--shape` also takes B,H,S,D or B,H,Sq,Sk,D with :bf16,
    :causal, :bshd; softmax's ROWS,COLS with :bf16; a family file's NAME=INT,...:dtype)."""
    problem = named_family(family)
    presets = problem.presets() or {"default": (problem.parse_shape(problem.default_shape), "the family's default")}
    if json_out:
        emit_json({name: {**s.as_dict(), "spec": s.spec, "about": about} for name, (s, about) in presets.items()})
        return
    columns = list(problem.shape_columns(next(iter(presets.values()))[0])) if presets else ["spec"]
    rows = [[name, *problem.shape_columns(s).values(), about] for name, (s, about) in presets.items()]
    print_fit_table(f"{problem.family} shape presets", ["name", *columns, "about"], rows, ("about",))


def _progress(what: str) -> Progress:
    """A bar on stderr, gone when done; off where stderr is no terminal (rich would end it with a blank line)."""
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True, disable=not err_console.is_terminal)


@app.command()
def check(
    shape: Optional[str] = typer.Option(None, "--shape", help=SHAPE_HELP),
    space: Optional[str] = typer.Option(None, "--space", help="YAML search space (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=FAMILY_HELP),
    sample: int = typer.Option(24, "--sample", min=0, max=MAX_SAMPLE,
                             help="Compile this many admitted configs, sampled (0 = all)."),
    seed: int = typer.Option(0, "--seed", **SEED_RANGE),
    jobs: int = typer.Option(0, "--jobs", min=0, max=MAX_WORKERS, help="Parallel compiles (default: CPU cores)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Static check of a space without a GPU: constraints, real NVRTC compiles, registers, spills, shared memory."""
    from ..search.static_check import admitted_configs, compile_all, pick, summarize

    problem, shp, spc = load_problem(shape, space, family)
    with _progress("enumerating") as progress:
        task = progress.add_task("enumerate", total=spc.size())
        admitted, enumerated, enum_s = admitted_configs(spc, problem.context(shp),
                                                         lambda done, _: progress.update(task, completed=done))
    picked = pick(admitted, sample, seed)
    start = time.time()
    with _progress("compiling") as progress:
        task = progress.add_task("compile", total=len(picked))
        rows = compile_all(problem, shp, spc, picked, jobs or os.cpu_count() or 1,
                           lambda done, _: progress.update(task, completed=done))
    summary = summarize(spc, shp, enumerated, len(admitted), rows, enum_s, time.time() - start)
    if json_out:
        emit_json({"summary": summary, "configs": rows})
    else:
        _print_check(summary, rows, spc.family)
    if summary["compile_errors"]:
        raise EvotuneError(f"{summary['compile_errors']} admitted configs failed to compile: the space admits code "
                           f"the template cannot build")


def _print_check(summary: dict, rows: list[dict], family: str) -> None:
    table = Table(title=f"{family} on {summary['shape']}: {len(rows)} of {summary['admitted']} admitted configs "
                        f"(space {summary['space_size']})")
    for col in ("config", "threads", "smem KB", "regs", "spill B", "stack B", "status"):
        table.add_column(col)
    for r in sorted(rows, key=lambda r: (r["status"] != "ok", (r.get("resources") or {}).get("registers", 0))):
        res = r.get("resources") or {}
        table.add_row(cfg_short(r["config"], family), str(r.get("threads", "-")),
                      f"{r.get('dynamic_smem', 0) / 1024:.1f}", str(res.get("registers", "-")),
                      str(res.get("spill_stores", "-")), str(res.get("stack_frame", "-")),
                      r["status"] + (f": {r['message']}" if r["message"] else ""))
    console.print(table)
    console.print(f"ok {summary['ok']}, pruned by the static gate {summary['pruned_static']}, "
                  f"compile errors {summary['compile_errors']} (enumerating {summary['enumerate_seconds']} s, "
                  f"compiling {summary['seconds']} s)")
