"""The recorded runs: `evotune runs` lists them, `evotune export` writes one's trial as a standalone .cu."""

from __future__ import annotations

from typing import Optional

import typer

from ..outputs import check_output_path
from .common import app, console, emit_json, err_console, print_fit_table


@app.command()
def export(
    which: str = typer.Argument("best", help="'best' or a trial number."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    output: str = typer.Option(..., "-o", "--output", help="Path of the .cu file to write."),
    force: bool = typer.Option(False, "--force", help="Export a trial that did not pass the gate (pruned, "
                               "failed to compile, wrong): its header says so."),
):
    """Write a standalone .cu with the config baked in (builds with `nvcc -gencode arch=compute_90a,code=sm_90a -c`)."""
    from ..build.export import export_source, write_export
    from ..records.runs import Run
    from ..records.sources import trial_source

    check_output_path(output, "-o", create_parents=True)
    rn = Run.open(run)
    problem, shp = rn.problem_and_shape()
    rec = rn.select(which, "export", require_pass=not force, hint=" (--force exports it anyway)")
    config = rn.config_of(rec, problem)
    # The run's archived source of the trial where it has one; else today's, the header's NOTE and this line
    # saying that the figures in the header were measured on other code.
    origin = trial_source(rn, rec, problem, config, shp)
    text = export_source(problem, shp, config, rec, rn.meta(), source=origin.source if origin.archived else None)
    path = write_export(output, text)
    if origin.note:  # once written: a refused -o stays one line
        err_console.print(f"note: {origin.note.replace('measuring', 'exporting')}; its header's figures are for "
                          f"the recorded source", highlight=False, markup=False, soft_wrap=True)
    status = rec["result"]["status"]
    note = f"; it did not pass ({status})" if status != "ok" else ""
    console.print(f"wrote {path} (run {rn.run_id}, trial {rec['number']}{note})", highlight=False)


@app.command("runs")
def list_runs(json_out: bool = typer.Option(False, "--json")):
    """List recorded runs with their best result; a damaged run is listed with what is wrong."""
    from ..records.runs import list_runs as rows_of, runs_dir

    rows = rows_of()
    if json_out:
        emit_json(rows)
        return
    cells = [[r["run"], str(r["shape"]) if r["shape"] else "-", str(r["trials"]) if r["trials"] is not None else "-",
              f"{r['best_us']:.2f}" if r["best_us"] else ("DAMAGED" if r["damaged"] else "-"), str(r["device"] or "-")]
             for r in rows]
    print_fit_table(f"runs in {runs_dir()}", ["run", "shape", "trials", "best us", "device"], cells,
                    ("device", "shape"))
    for r in rows:
        if r["damaged"]:  # whole, on its own line: a table cell would cut or fold it
            console.print(f"damaged: {r['run']}: {r['damaged']}", highlight=False, markup=False, soft_wrap=True)
