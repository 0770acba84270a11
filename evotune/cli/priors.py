"""`evotune priors build|show`: the shipped priors (evotune/records/priors.py holds the logic; a search asks them first).

Registered on the app when the evotune.cli package is imported.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from ..outputs import write_output
from .common import app, console, emit_json, err_console, print_fit_table

REBUILD_HINT = "evotune priors build"

priors_app = typer.Typer(no_args_is_help=True, help="Build and show the priors a search asks first (the best "
                         "configs of recorded runs per shape class).")
app.add_typer(priors_app, name="priors")


def _run_paths(runs: Optional[list[str]], root: Path) -> list[Path]:
    """Run folders: each of `runs` a folder holding meta.json or a run name under the runs dir; default every
    run of the attention and attention-decode families under `root` (a decode search asks the decode runs' winners:
    records/priors.py compares only classes of one family)."""
    from ..records.runs import Run, check_name
    from ..records.tuning_table import DECODE_FAMILY, FAMILY, family_runs

    if not runs:
        return family_runs(root, (FAMILY, DECODE_FAMILY))
    out = []
    for r in runs:
        if (Path(r) / "meta.json").is_file():
            out.append(Path(r))
        else:
            check_name(r)
            out.append(Run.open(r).path)
    return out


@priors_app.command("build")
def build(
    runs: Optional[list[str]] = typer.Argument(None, help="Run names or folders (default: every attention run "
                                               "under the checkout's runs/)."),
    out: Optional[str] = typer.Option(None, "-o", "--out", help="Priors file to write (default, in a checkout: "
                                      "the packaged evotune/records/attention-priors.json)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Distil runs into a priors file: per run its best and near-winners, with their ratio to SDPA, by shape class."""
    from ..paths import REPO_ROOT
    from ..records.priors import PACKAGED, build_priors, dump_priors
    from ..records.runs import runs_dir

    checkout = (REPO_ROOT / ".git").exists() and PACKAGED.is_relative_to(REPO_ROOT)
    if out is None and not checkout:
        raise UsageError("priors build: give -o FILE (the packaged priors file is rebuilt only in a checkout)")
    path = out or str(PACKAGED.relative_to(REPO_ROOT) if Path.cwd() == REPO_ROOT else PACKAGED)
    root = REPO_ROOT / "runs" if out is None else runs_dir()
    paths = _run_paths(runs, root)
    if not paths:
        raise UsageError(f"priors build: no attention run in {root}")
    command = "evotune priors build" + "".join(" " + shlex.quote(a) for a in sys.argv[3:]) if len(sys.argv) > 2 \
        else "evotune priors build"
    doc, notes = build_priors(paths, command)
    written = write_output(path, dump_priors(doc), "-o")
    size = written.stat().st_size
    if json_out:
        emit_json({"path": str(written), "bytes": size, "runs": len(doc["entries"]),
                   "winners": sum(len(e["winners"]) for e in doc["entries"]), "notes": notes})
        return
    for note in notes:
        err_console.print(note, highlight=False, markup=False, soft_wrap=True)
    console.print(f"priors: {len(doc['entries'])} runs, {sum(len(e['winners']) for e in doc['entries'])} configs "
                  f"written to {written} ({size} bytes)", highlight=False, soft_wrap=True)


@priors_app.command("show")
def show(
    file: Optional[str] = typer.Option(None, "--file", help="Priors file (default: the packaged one)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """List the priors: per run its shape class, best time and ratio to the fastest SDPA backend, and how many of its
    configs are stale (their kernel source is not today's: proposed all the same, and re-measured)."""
    from ..records.priors import PACKAGED, load_priors, stale_reason

    doc = load_priors(file)
    stale = {(i, j): stale_reason(e, w) for i, e in enumerate(doc["entries"]) for j, w in enumerate(e["winners"])}
    if json_out:
        emit_json({**doc, "entries": [{**e, "winners": [{**w, "stale": stale[(i, j)]}
                                                         for j, w in enumerate(e["winners"])]}
                                      for i, e in enumerate(doc["entries"])]})
        return
    rows = []
    for i, e in enumerate(doc["entries"]):
        c, w = e["class"], e["winners"][0] if e["winners"] else {}
        ratio = w.get("ratio_to_sdpa")
        n_stale = sum(stale[(i, j)] is not None for j in range(len(e["winners"])))
        rows.append([e["run"], f"{c['dtype']} d{c['head_dim']}{' causal' if c['causal'] else ''}"
                     f"{' kv-group ' + str(c['kv_group']) if c['kv_group'] > 1 else ''}",
                     f"2^{c['seq_bucket']}", f"2^{c['bh_bucket']}", str(len(e["winners"])),
                     f"{n_stale}/{len(e['winners'])}" if n_stale else "no",
                     f"{w.get('time_us', 0):.2f}", f"{ratio:.3f}" if ratio else "-", c["gpu"]])
    print_fit_table(f"priors in {file or PACKAGED} (version {doc['version']}, built {doc.get('built_at', '?')})",
                    ["run", "class", "seq_k", "B*H", "configs", "stale", "best us", "vs sdpa", "gpu"], rows,
                    ("gpu", "B*H", "seq_k"))
    total = sum(v is not None for v in stale.values())
    if total:
        console.print(f"{total} of {len(stale)} configs are stale (measured on a kernel source that is not "
                      f"today's): a search proposes them all the same and re-measures them (`{REBUILD_HINT}` over "
                      f"runs measured on today's source gives priors that are not stale)",
                      highlight=False, markup=False, soft_wrap=True)
