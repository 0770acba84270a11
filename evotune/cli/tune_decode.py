"""`evotune tune --shapes FILE`'s decode part: the attention-decode calls a recording holds (generate()'s steps through
evotune.torch.decode or the transformers adapter) searched once per decode-table key, each best benched beside SDPA's
backends in one GPU process, and the decode table (records/decode_table.py) updated from those benches: an entry
routes to our kernel only where that bench measured it passing the gate and faster than the fastest SDPA backend.

The bench records are kept beside the table (TABLE.bench/RUN.json), as each entry names its own: the measurement a
route rests on, for a skeptic to read or rerun (`evotune bench best --run RUN`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import EvotuneError, NoGPUError
from ..outputs import check_output_path, write_output
from .common import err_console

FAMILY = "attention-decode"
REPS = 100  # CUDA-graph replays per kernel in the bench, as `evotune bench`'s default


def decode_table_path(given: str | None) -> Path:
    """The decode table to update: the one given, else evotune.torch.decode's default ($EVOTUNE_DECODE_TABLE, else
    decode-table.json in evotune's cache root); checked as an output, and a table already there read, before any
    GPU work."""
    from ..records.decode_table import default_decode_table_path, read_decode_table

    path = Path(given) if given else default_decode_table_path()
    check_output_path(str(path), "--decode-table", create_parents=not given)
    read_decode_table(path)
    return path


def plan(specs: list[str]) -> tuple[list, list[str]]:
    """(one decode shape per table key, notes on the shapes merged): checked before any GPU work."""
    from ..records.decode_table import decode_tune_plan

    return decode_tune_plan(specs)


def tune_decode(shapes: list, path: Path, search_key, budget, json_out: bool) -> tuple[list[dict], list[str]]:
    """Search and bench each decode shape (`search_key(shape, stop_at)` -> run id, under `budget`'s share), then
    update the table at `path`; ({"shape", "run", "error", "family"} per shape, one line per table entry written)."""
    bench_dir = path.with_name(path.name.removesuffix(".json") + ".bench")
    outcomes, benches = [], []
    for i, shp in enumerate(shapes, 1):
        if not json_out:
            err_console.print(f"decode key {i}/{len(shapes)}: {shp.spec} ...", highlight=False, soft_wrap=True)
        try:
            with budget.key() as stop_at:
                run_id = search_key(shp, stop_at)
            benches.append(_bench_best(run_id, bench_dir / f"{run_id}.json", json_out))
            outcomes.append({"shape": shp.spec, "run": run_id, "error": None, "family": FAMILY})
        except NoGPUError:
            raise
        except EvotuneError as e:
            outcomes.append({"shape": shp.spec, "run": None, "error": str(e), "family": FAMILY})
    return outcomes, (_update_table(path, benches) if benches else [])


def _bench_best(run_id: str, out: Path, json_out: bool) -> Path:
    """`evotune bench best --run RUN --out OUT`: the run's best beside every SDPA backend (same inputs, gate and
    timing); the record is written whether or not our kernel passed (the table then routes the key to SDPA)."""
    from .candidate import _resolve_candidate, bench_record

    problem, shp, cfg, origin = _resolve_candidate("best", run_id, None, None, None, None, "bench", json_out)
    record = bench_record(problem, shp, cfg, origin, REPS, None, {"run": run_id, "trial": "best"})
    return write_output(out, json.dumps(record, indent=1, default=str), "--decode-table", create_parents=True)


def _update_table(path: Path, benches: list[Path]) -> list[str]:
    from ..records.decode_table import PROBLEM, build_decode_table, merge_decode_tables, read_decode_table

    new = build_decode_table(benches)
    table = merge_decode_tables(read_decode_table(path), new)
    write_output(path, json.dumps(table, indent=1) + "\n", "--decode-table")
    return [f"decode table {path}: {PROBLEM.shape_from_dict(e['shape']).spec} -> {e['route']}: {e['reason']}"
            for e in new["entries"]]
