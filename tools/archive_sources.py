"""Backfill the source archive of runs made before runs kept their sources (issue 39; evotune/records/sources.py).

For each run: its best trial (records/best.final_best), its finalists (best.finalists, and those its baselines.json
re-timed) and best.json's trial. A trial's source is archived only where the code is provably the code the run
measured, i.e. hashes to the trial's recorded `source_digest`:
  - today's instantiation of its config, where today's template still gives that digest, or
  - the code of the run's exported best.cu (below its header), where that hashes to the digest.
Any other trial is listed as not recoverable (the template changed and nothing kept the code): replay, export and
bench of it compile today's source and say so.

    python tools/archive_sources.py                 # every run under $EVOTUNE_RUNS or ./runs
    python tools/archive_sources.py RUN ... [--dry-run] [--json]

Writes only runs/<run>/sources/ (append-only, deduplicated: a second pass adds nothing) and says the bytes added.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import evotune.problems  # noqa: E402,F401  (registers the families the spaces are checked against)
from evotune.build.template import KernelSource, instantiate  # noqa: E402
from evotune.errors import EvotuneError  # noqa: E402
from evotune.records import sources as S  # noqa: E402
from evotune.records.best import final_best, finalists, read_beside  # noqa: E402
from evotune.records.runs import Run, runs_dir  # noqa: E402


def wanted(run: Run, records: list[dict]) -> list[dict]:
    """The records whose sources the run's readers need most: the best first (it becomes the archive's whole
    source, the others deltas on it), then the finalists, those baselines.json re-timed, and best.json's."""
    by_number = {r.get("number"): r for r in records if r.get("duplicate_of") is None}
    beside = read_beside(run.path)
    picks = [final_best(records, beside)] + finalists(records)
    for f in (beside or {}).get("finalists") or []:
        if isinstance(f, dict):
            picks.append(by_number.get(f.get("number")))
    try:
        picks.append(by_number.get(json.loads((run.path / "best.json").read_text()).get("number")))
    except (OSError, ValueError, AttributeError):
        pass
    out, seen = [], set()
    for r in picks:
        if r is not None and r.get("number") not in seen and (r.get("result") or {}).get("status") == "ok":
            seen.add(r["number"])
            out.append(r)
    return out


def exported_code(run: Run) -> str | None:
    """The code of the run's best.cu below its `// ` header (None where there is none)."""
    path = run.path / "best.cu"
    try:
        text = path.read_text()
    except OSError:
        return None
    head, sep, code = text.partition("\n\n")
    return code if sep and all(line.startswith("//") for line in head.splitlines()) else None


def backfill(run: Run, dry_run: bool) -> dict:
    problem, shape = run.problem_and_shape()
    records = run.trials()
    exported = exported_code(run)
    row = {"run": run.run_id, "archived": [], "had": [], "lost": [], "bytes_before": S.archive_bytes(run.path)}
    for rec in wanted(run, records):
        digest = rec.get("source_digest")
        if not S.is_digest(digest):
            row["lost"].append({"trial": rec["number"], "why": "records no source digest"})
            continue
        if S.has_source(run.path, digest):
            row["had"].append(rec["number"])
            continue
        found = None
        try:
            today = instantiate(problem, run.config_of(rec, problem), shape)
            if today.digest == digest:
                found = (today, "today's template")
        except EvotuneError as e:
            today = None
            why = str(e)
        if found is None and exported is not None and S.digest_of(exported) == digest:
            found = (KernelSource(problem.family, problem.entry_name, exported, str(run.path / "best.cu")), "best.cu")
        if found is None:
            now = today.digest if today is not None else f"none ({why})"
            row["lost"].append({"trial": rec["number"], "why": f"recorded {digest}, today's template gives {now}"})
            continue
        if not dry_run:
            S.archive_source(run.path, found[0])
        row["archived"].append({"trial": rec["number"], "digest": digest, "from": found[1]})
    row["bytes_added"] = S.archive_bytes(run.path) - row["bytes_before"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="*", help="run names (default: every run under the runs folder)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be archived; write nothing")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    root = runs_dir()
    names = args.runs or sorted(p.parent.name for p in root.glob("*/meta.json"))
    rows = []
    for name in names:
        try:
            rows.append(backfill(Run.open(name), args.dry_run))
        except EvotuneError as e:
            rows.append({"run": name, "error": str(e)})
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            if "error" in r:
                print(f"{r['run']}: skipped: {r['error']}")
                continue
            print(f"{r['run']}: archived {len(r['archived'])}, already there {len(r['had'])}, not recoverable "
                  f"{len(r['lost'])}; +{r['bytes_added']} B")
            for lost in r["lost"]:
                print(f"    trial {lost['trial']}: {lost['why']}")
    added = sum(r.get("bytes_added", 0) for r in rows)
    archived = sum(len(r.get("archived", ())) for r in rows)
    print(f"total: {archived} sources archived in {sum(1 for r in rows if r.get('archived'))} runs, +{added} B"
          + (" (dry run: nothing written)" if args.dry_run else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
