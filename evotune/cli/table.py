"""`evotune table build|show` and `evotune tune`: the command-line side of the tuning table
(evotune/records/tuning_table.py holds the logic; evotune.torch.attention reads the table).

Registered on the app when the evotune.cli package is imported.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table as RichTable

from ..errors import EvotuneError, UsageError
from ..outputs import MAX_JSON_BYTES, check_output_path, read_input
from .common import (GPU_RANGE, MAX_TRIALS, app, console, emit_json, err_console, load_problem, require_gpu,
                     timeout_seconds)
from .search import new_meta_for, resume_command, search_one, transfer_context, warm_start_configs

table_app = typer.Typer(no_args_is_help=True, help="Build and show the tuning table that "
                        "evotune.torch.attention reads (EVOTUNE_TABLE, else the default in evotune's cache).")
app.add_typer(table_app, name="table")

_TABLE_HELP = "Tuning table file (default: $EVOTUNE_TABLE, else tuning-table.json in $EVOTUNE_CACHE or ~/.cache/evotune)."


def _table_path(given: Optional[str], option: str) -> Path:
    """The table file to write: the one given (its folder must exist), else the default (its folder is made);
    checked as any output (outputs.check_output_path: a regular file, outside run folders and the compile cache),
    and a table already there read (bounded) so that a damaged one fails before any work."""
    from ..records.tuning_table import default_table_path

    if given:
        path = Path(given)
    else:
        path = default_table_path()
        if not path.parent.is_dir() and not path.parent.is_symlink():
            check_output_path(str(path), option, create_parents=True)
            path.parent.mkdir(parents=True, exist_ok=True)
    check_output_path(str(path), option)
    if path.exists():
        _check_input(path, "tuning table")
    return path


def _check_input(path, what: str) -> None:
    """UsageError unless `path` is a regular file within the bound of JSON records (outputs.read_input): checked
    here, before tuning_table reads it, so that a FIFO, a device or a huge file is one line, not a hang."""
    if os.path.lexists(path):  # a missing file: tuning_table says so in its own words
        read_input(path, what, MAX_JSON_BYTES)


def _report_build(table, notes, path: Path, json_out: bool, extra: dict | None = None) -> None:
    from ..records.tuning_table import note_line

    if json_out:
        emit_json({**(extra or {}), "path": str(path), "entries": len(table.entries),
                   "notes": [{"run": n.run, "action": n.action, "key": n.key, "reason": n.reason} for n in notes]})
        return
    for note in notes:
        console.print(note_line(note, table), highlight=False, markup=False, soft_wrap=True)
    console.print(f"table: {len(table.entries)} entries written to {path}", highlight=False, soft_wrap=True)


@table_app.command("build")
def build(
    runs: Optional[list[str]] = typer.Argument(None, help="Run names or folders (default: every attention run "
                                               "under the runs dir)."),
    out: Optional[str] = typer.Option(None, "-o", "--out", help=_TABLE_HELP + " Updated where it exists."),
    bench: Optional[list[str]] = typer.Option(None, "--bench", help="`evotune bench --out` record of a run's best "
                                              "config: its same-process SDPA times decide the route (repeatable)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Build or update the tuning table from runs: one entry per key, routed to evotune only where it beat SDPA."""
    from ..records.tuning_table import family_runs, update_table

    chosen = list(runs) if runs else family_runs()
    if not chosen:
        from ..records.runs import runs_dir

        raise UsageError(f"no attention run under {runs_dir()}: run `evotune search` or `evotune tune` first")
    path = _table_path(out, "-o")
    for file in bench or ():
        _check_input(file, "bench record")
    table, notes, path = update_table(chosen, path, bench or ())
    _report_build(table, notes, path, json_out)


def _entry_row(e, stale: bool = False) -> list[str]:
    """One row of `table show`; a stale entry's route reads "STALE (sdpa)": the op never runs it (stale_reason)."""
    sdpa = f"{e.sdpa['backend']} {e.sdpa['time_us']:.2f} us" if e.sdpa else "not measured"
    route = "STALE (sdpa)" if stale else e.route
    return [e.key.spec(), route, f"{e.evotune_us:.2f}", sdpa, f"{e.provenance['run']}/{e.provenance['trial']}"]


@table_app.command("show")
def show(
    file: Optional[str] = typer.Argument(None, help=_TABLE_HELP),
    json_out: bool = typer.Option(False, "--json"),
):
    """Print the table's entries: key, route, evotune's and the best SDPA backend's time, run/trial; a stale entry
    (its kernel source is not today's) is marked and routes to SDPA."""
    from ..records.tuning_table import default_table_path, load_table, stale_entries

    path = Path(file) if file else default_table_path()
    if path.exists() or path.is_symlink():
        _check_input(path, "tuning table")
    table = load_table(path)
    stale = {e.key: why for e, why in stale_entries(table)}
    if json_out:
        emit_json({"path": str(path), **table.as_dict(),
                   "stale": [{"key": key.as_dict(), "reason": why} for key, why in stale.items()]})
        return
    headers = ["key", "route", "evotune us", "best SDPA", "run/trial"]
    rows = [_entry_row(e, e.key in stale) for e in sorted(table.entries, key=lambda e: e.key)]
    _print_rows(f"{path}: {len(rows)} entries", headers, rows)
    for key, why in stale.items():  # whole, on lines of their own: a cell would cut them
        console.print(f"stale: {key.spec()}: {why}; the op runs SDPA there", highlight=False, markup=False,
                      soft_wrap=True)
    if stale:
        console.print(f"re-measure the {len(stale)} stale entries: evotune tune --stale --table {path}",
                      highlight=False, markup=False, soft_wrap=True)


def _print_rows(title: str, headers: list[str], rows: list[list[str]]) -> None:
    """A table where it fits the console whole; else a block per row (the key on its own line). No cell is cut."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if sum(widths) + 3 * len(widths) + 1 <= console.width:
        table = RichTable(title=title)
        for h in headers:
            table.add_column(h, no_wrap=True)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        return
    console.print(title, highlight=False, markup=False, soft_wrap=True)
    for r in rows:
        console.print(r[0], highlight=False, markup=False, soft_wrap=True)
        console.print("    " + "; ".join(f"{h} {v}" for h, v in zip(headers[1:], r[1:])),
                      highlight=False, markup=False, soft_wrap=True)


# ---------------------------------------------------------------- tune
def _search_key(shape, trials: int, timeout: float, gpu: int, json_out: bool, seeds: tuple = (),
                priors: bool = True, stop_at: float | None = None, family: str = "attention") -> str:
    """One key's search: `evotune search --shape SPEC --trials N --warm-start auto` on GPU `gpu`, the best then
    timed beside SDPA; returns the run id (EvotuneError where no candidate passed the gate). `seeds`: configs asked
    first (a stale entry's: re-verified and re-timed on today's source before anything else). `stop_at`: a
    time.monotonic() after which no new candidate is asked (the finalists are still timed beside SDPA)."""
    from ..search.loop import SearchOptions
    from ..search.warmstart import admitted, with_new_knobs

    problem, shp, spc = load_problem(shape.spec, None, family)
    gpu_model, prior_mean = transfer_context("auto", priors, problem, shp, spc, gpu)
    warm, warm_meta = warm_start_configs("auto", False, None, problem, shp, spc, SearchOptions.population, json_out,
                                         priors=priors, gpu=gpu_model)
    if seeds:
        context = problem.context(shp)
        first, _ = admitted(spc, context, with_new_knobs(spc, context, [dict(c) for c in seeds]))
        firsts = [c.as_dict() for c in first]
        warm = tuple(firsts + [c for c in warm if c not in firsts])[:max(SearchOptions.population, len(firsts))]
        warm_meta = {**warm_meta, "stale_entry_configs": len(firsts)}
    options = SearchOptions(trials=trials, warm_start=warm, prior_mean=prior_mean)
    new_meta = new_meta_for(problem, shp, spc, options, None, [gpu], warm_meta)
    summary, rn = search_one(None, new_meta, None, gpu, None, options, problem, shp, spc, timeout, json_out,
                             lambda rn: resume_command(rn, shp.spec, trials, None, None),
                             should_stop=None if stop_at is None else lambda: time.monotonic() >= stop_at)
    best = summary["best"]
    if best is None:
        raise EvotuneError(f"run {rn.run_id}: no candidate passed the correctness gate")
    if not json_out:
        err_console.print(f"run {rn.run_id}: best trial {best['number']} {best['result']['time_us']:.2f} us",
                          highlight=False, soft_wrap=True)
    return rn.run_id


class _KeyBudget:
    """tune --time-budget: each key's search may ask candidates until its share of what is left (the budget over the
    keys not yet searched) has passed; a key that ends early leaves the rest to the next. Without a budget, no stop."""

    def __init__(self, seconds: float | None, keys: int):
        self.left, self.keys = seconds, keys

    @contextmanager
    def key(self):
        if self.left is None:
            yield None
            return
        started = time.monotonic()
        stop_at = started + max(0.0, self.left) / max(1, self.keys)
        try:
            yield stop_at
        finally:  # what the finalists' timing takes past stop_at is not counted against the budget
            self.left -= min(time.monotonic(), stop_at) - started
            self.keys -= 1


def _tune_specs(shape: Optional[list[str]], shapes: Optional[str], stale: bool = False) -> tuple[list[str], list[str]]:
    """(attention specs, decode specs): --shape's (attention), or a record_shapes() file's of both families."""
    from ..records.tuning_table import DECODE_FAMILY, FAMILY, read_recorded_shapes

    if shape and shapes:
        raise UsageError("give --shape (repeatable) or --shapes FILE, not both")
    if shapes:
        _check_input(shapes, "shapes file")
        found = read_recorded_shapes(shapes)
        return found[FAMILY], found[DECODE_FAMILY]
    if not shape and not stale:
        raise UsageError("nothing to tune: give --shape SPEC (repeatable), --shapes FILE "
                         "(saved by evotune.torch.record_shapes()) or --stale")
    return list(shape or ()), []


def _stale_plan(path: Path) -> tuple[list[str], dict[str, list[dict]], list[str]]:
    """(the measured shapes of the table's stale entries, {shape spec: their configs}, one line per stale entry)."""
    from ..problems.shapes import Shape
    from ..records.tuning_table import load_table, stale_entries

    if not path.exists():
        raise UsageError(f"--stale: no tuning table at {path}: nothing to re-measure")
    specs, seeds, lines = [], {}, []
    for entry, why in stale_entries(load_table(path)):
        spec = Shape.from_dict(entry.shape).spec
        specs.append(spec)
        seeds.setdefault(spec, []).append(dict(entry.config))
        lines.append(f"stale: {entry.key.spec()} ({why}): re-measuring its config on {spec} first")
    return specs, seeds, lines


@app.command()
def tune(
    shape: Optional[list[str]] = typer.Option(None, "--shape", help="Attention shape to tune (repeatable)."),
    shapes: Optional[str] = typer.Option(None, "--shapes", help="Shapes file saved by evotune.torch.record_shapes()."),
    trials: int = typer.Option(60, "--trials", min=1, max=MAX_TRIALS, help="Candidates to evaluate per key."),
    table: Optional[str] = typer.Option(None, "--table", help=_TABLE_HELP + " Updated where it exists."),
    timeout: float = typer.Option(60.0, "--timeout", callback=timeout_seconds, help="Seconds a candidate may take on the GPU before it is killed."),
    gpu: int = typer.Option(0, "--gpu", **GPU_RANGE, help="GPU index for the searches."),
    stale: bool = typer.Option(False, "--stale", help="Also re-measure every stale entry of the table (its kernel "
                               "source is not today's): its shape is searched with its config asked first."),
    priors: bool = typer.Option(True, "--priors/--no-priors", help="Ask the shipped priors first (nearest shape "
                                "class first), before earlier runs' configs."),
    time_budget: Optional[float] = typer.Option(None, "--time-budget", callback=timeout_seconds, help="Seconds "
                                                "of searching for all keys together, shared evenly among the keys "
                                                "not yet searched (what one leaves goes to the next); past its "
                                                "share a key's search asks no more candidates and still times its "
                                                "finalists beside SDPA. Default: --trials alone bounds it."),
    decode_table: Optional[str] = typer.Option(None, "--decode-table", help="Decode table the recording's decode "
                                               "calls are tuned into (default: $EVOTUNE_DECODE_TABLE, else "
                                               "decode-table.json in evotune's cache). Updated where it exists."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Search each distinct table key of the shapes (warm-started from earlier runs), then update the table; the
    decode calls a --shapes recording holds (generate()'s steps) are searched per decode-table key, benched beside
    SDPA and written to the decode table."""
    from ..records.tuning_table import load_table, tune_keys
    from . import tune_decode

    specs, decode_specs = _tune_specs(shape, shapes, stale)
    path = _table_path(table, "--table") if specs or stale else None
    if path is not None and path.exists():
        load_table(path)  # a damaged table fails now, not after the searches
    plan, merged, key_seeds = _attention_plan(specs, stale, path, json_out) if path is not None else ([], [], {})
    decode_plan, decode_notes = tune_decode.plan(decode_specs)
    decode_path = tune_decode.decode_table_path(decode_table) if decode_plan else None
    require_gpu("tune")
    if not json_out:
        for note in [f"note: {m}" for m in merged + decode_notes]:
            err_console.print(note, highlight=False, markup=False, soft_wrap=True)

    def progress(i: int, n: int, shp) -> None:
        if not json_out:
            err_console.print(f"key {i}/{n}: {shp.spec} ...", highlight=False, soft_wrap=True)

    budget = _KeyBudget(time_budget, len(plan) + len(decode_plan))

    def search(shp):
        with budget.key() as stop_at:
            return _search_key(shp, trials, timeout, gpu, json_out, seeds=tuple(key_seeds.get(shp.spec, ())),
                               priors=priors, stop_at=stop_at)

    outcomes = tune_keys(plan, search, progress) if plan else []
    decoded, decode_lines = tune_decode.tune_decode(
        decode_plan, decode_path, lambda shp, stop_at: _search_key(shp, trials, timeout, gpu, json_out, priors=priors,
                                                                   stop_at=stop_at, family=tune_decode.FAMILY),
        budget, json_out) if decode_plan else ([], [])
    _finish_tune(outcomes, decoded, decode_lines, path, merged, json_out)


def _attention_plan(specs: list[str], stale: bool, path: Path, json_out: bool) -> tuple[list, list[str], dict]:
    """(the attention shapes to search, one per table key; notes on those merged; {spec: configs asked first}):
    --stale adds the table's stale entries, each shape checked before the GPU is looked for."""
    from ..problems import get_problem
    from ..problems.shapes import parse_shape
    from ..records.tuning_table import TableKey, tune_plan

    seeds, stale_lines = {}, []
    if stale:
        stale_specs, seeds, stale_lines = _stale_plan(path)
        if not specs and not stale_specs:
            raise UsageError(f"--stale: no stale entry in {path} (every entry's kernel source is today's): nothing "
                             f"to re-measure")
        specs = specs + stale_specs
    if not specs:
        return [], [], {}
    plan, merged = tune_plan(specs)
    attention = get_problem("attention")
    for shp in plan:  # a shape the kernel cannot run is a usage error, before the GPU is looked for
        attention.check_shape(shp)
    if not json_out:
        for line in stale_lines:
            err_console.print(line, highlight=False, markup=False, soft_wrap=True)
    # A stale entry's config is asked first on the shape that now stands for its key (tune_plan keeps one per key).
    key_seeds: dict[str, list[dict]] = {}
    for spec, configs in seeds.items():
        key = TableKey.for_shape(parse_shape(spec), "", "")
        chosen = next(p for p in plan if TableKey.for_shape(p, "", "") == key)
        key_seeds.setdefault(chosen.spec, []).extend(configs)
    return plan, merged, key_seeds


def _finish_tune(outcomes: list[dict], decoded: list[dict], decode_lines: list[str], path: Path | None,
                 merged: list[str], json_out: bool) -> None:
    """Say which keys failed, update the attention table from the tuned runs, report; EvotuneError where a key
    was not tuned (the tables hold the others)."""
    from ..records.tuning_table import update_table

    everything = outcomes + decoded
    for o in everything:
        if o["error"] and not json_out:
            err_console.print(f"key {o['shape']}: not tuned: {o['error']}", highlight=False, soft_wrap=True)
    tuned = [o["run"] for o in outcomes if o["run"]]
    if not tuned and not any(o["run"] for o in decoded):
        raise EvotuneError(f"no key was tuned ({len(everything)} searched); the tables are unchanged")
    extra = {"keys": everything, "merged": merged, "decode_table": decode_lines}
    if tuned:
        built, notes, path = update_table(tuned, path)
        _report_build(built, notes, path, json_out, extra)
    elif json_out:
        emit_json(extra)
    if not json_out:
        for line in decode_lines:
            console.print(line, highlight=False, markup=False, soft_wrap=True)
    failed = [o["shape"] for o in everything if o["error"]]
    if failed:
        raise EvotuneError(f"{len(failed)} of {len(everything)} keys not tuned ({', '.join(failed)}); the tables "
                           f"hold the others")
