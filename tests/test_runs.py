"""Tests for evotune.runs: run folders, the append-only trial log, and the Pareto front and best
record computed from it. Everything is written under a temporary EVOTUNE_RUNS."""

from __future__ import annotations

import json
import os

import pytest

from evotune import runs
from evotune.errors import EvotuneError, UsageError
from evotune.runs import Run, best_record, ok_records, pareto_front


def rec(number, status="ok", time_us=None, max_abs=None, **extra) -> dict:
    """A hand-made trial record; OK ones get a time and an error."""
    result = {"status": status, "message": "", "time_us": time_us, "max_abs": max_abs}
    return {"number": number, "config": {"block_m": 64, "n": number}, "digest": f"d{number:011d}",
            "counted": True, "result": result, **extra}


def test_runs_dir_follows_env(runs_root):
    """runs_dir() is $EVOTUNE_RUNS, so tests never write to the repository's runs/."""
    assert runs.runs_dir() == runs_root


def test_create_writes_meta_and_empty_log(runs_root):
    """Run.create makes the folder, meta.json (with the given fields, run_id and created) and an empty trials.jsonl."""
    run = Run.create("first", {"shape_spec": "1,8,512,64:fp16", "family": "attention"})
    assert run.path == runs_root / "first" and run.run_id == "first"
    meta = json.loads((run.path / "meta.json").read_text())
    assert meta["run_id"] == "first" and meta["family"] == "attention" and meta["shape_spec"] == "1,8,512,64:fp16"
    assert "T" in meta["created"] and len(meta["created"]) == len("2025-01-01T00:00:00")
    assert run.meta() == meta
    assert run.trials_path.is_file() and run.trials_path.read_text() == ""
    assert run.trials() == []
    assert run.storage_url == f"sqlite:///{run.path / 'study.db'}"


def test_create_without_name_uses_timestamp_and_shape(runs_root):
    """With no name, the run id is a timestamp followed by the shape spelled safely."""
    run = Run.create(None, {"shape_spec": "1,8,512,64:fp16"})
    assert run.run_id.endswith("-1-8-512-64-fp16")
    assert run.run_id[:8].isdigit() and run.path.is_dir()


@pytest.mark.parametrize("name", ["../x", "", "a b", ".hidden", "x/y", "a" * 101])
def test_create_rejects_bad_names(runs_root, name):
    """A run name that is not a plain file name (or is empty) is a UsageError, and nothing is created."""
    with pytest.raises(UsageError):
        Run.create(name, {"shape_spec": "mission"})
    assert not runs_root.exists() or list(runs_root.iterdir()) == []


def test_create_existing_name_points_to_resume(runs_root):
    """Creating a run whose name is taken is a UsageError that suggests --resume, and the old run is untouched."""
    run = Run.create("taken", {"shape_spec": "a"})
    run.append_trial(rec(0, time_us=1.0, max_abs=1e-4))
    with pytest.raises(UsageError, match="--resume"):
        Run.create("taken", {"shape_spec": "b"})
    assert run.meta()["shape_spec"] == "a" and len(run.trials()) == 1


def test_open_latest_is_most_recently_written(runs_root):
    """Run.open(None) and Run.open('latest') pick the run whose trial log changed last."""
    a = Run.create("a", {})
    b = Run.create("b", {})
    os.utime(a.trials_path, (1_000_000, 1_000_000))
    os.utime(b.trials_path, (2_000_000, 2_000_000))
    assert Run.open(None).run_id == "b" and Run.open("latest").run_id == "b"
    a.append_trial(rec(0, time_us=1.0, max_abs=1e-4))  # now a's log is the newest
    assert Run.open(None).run_id == "a" and Run.open("latest").run_id == "a"


def test_open_latest_with_no_runs(runs_root):
    """With no runs at all, opening the latest is a UsageError that says how to start one."""
    with pytest.raises(UsageError, match="evotune search"):
        Run.open(None)


def test_open_unknown_lists_known(runs_root):
    """Run.open of an unknown name is a UsageError naming it and listing the runs that exist."""
    Run.create("alpha", {})
    Run.create("beta", {})
    with pytest.raises(UsageError, match="no run named 'nope'") as info:
        Run.open("nope")
    assert "known: alpha, beta" in str(info.value)
    assert Run.open("beta").path == runs_root / "beta"


def test_append_and_read_round_trip(runs_root):
    """append_trial writes one JSON line per record and trials() reads them back equal and in order."""
    run = Run.create("r", {})
    records = [rec(0, time_us=3.5, max_abs=1e-4), rec(1, status="wrong", max_abs=0.5),
               rec(2, status="pruned", counted=False)]
    for r in records:
        run.append_trial(r)
    assert run.trials() == records
    lines = run.trials_path.read_text().splitlines()
    assert len(lines) == 3 and all(json.loads(line) == r for line, r in zip(lines, records))
    assert run.trial(1) == records[1]
    with pytest.raises(UsageError, match="no trial number 7"):
        run.trial(7)


def test_torn_last_line_is_skipped(runs_root):
    """A half-written last line (a run killed mid-write) is skipped; the records before it survive."""
    run = Run.create("torn", {})
    run.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    run.append_trial(rec(1, time_us=1.5, max_abs=2e-4))
    full = json.dumps(rec(2, time_us=1.0, max_abs=1e-4), sort_keys=True)
    with open(run.trials_path, "a") as f:
        f.write(full[: len(full) // 2])
    assert [r["number"] for r in run.trials()] == [0, 1]
    assert run.best()["number"] == 1


def test_append_after_torn_line_survives(runs_root):
    """A record appended after a torn last line (resuming a killed run) is read back, not glued to the fragment."""
    run = Run.create("torn2", {})
    run.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    full = json.dumps(rec(1, time_us=1.5, max_abs=1e-4), sort_keys=True)
    with open(run.trials_path, "a") as f:
        f.write(full[: len(full) // 2])
    run.append_trial(rec(2, time_us=1.0, max_abs=1e-4))
    assert [r["number"] for r in run.trials()] == [0, 2]


def test_blank_lines_are_ignored(runs_root):
    """Empty lines in trials.jsonl are not records."""
    run = Run.create("blank", {})
    run.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    with open(run.trials_path, "a") as f:
        f.write("\n   \n")
    run.append_trial(rec(1, time_us=1.0, max_abs=1e-4))
    assert [r["number"] for r in run.trials()] == [0, 1]


# ------------------------------------------------------------------ Pareto front and best

FRONT_RECORDS = [
    rec(0, time_us=10.0, max_abs=1e-3),                  # front
    rec(1, time_us=12.0, max_abs=1e-4),                  # front: slower but more accurate
    rec(2, time_us=15.0, max_abs=1e-3),                  # dominated by 0
    rec(3, time_us=9.0, max_abs=1e-2),                   # front: the fastest
    rec(4, time_us=10.0, max_abs=2e-3),                  # dominated by 0 (same time, more error)
    rec(5, time_us=1.0, max_abs=0.0, duplicate_of=0),    # a duplicate: never on the front, whatever it says
    rec(6, status="wrong", time_us=0.5, max_abs=0.5),    # failed the gate
    rec(7, status="timeout"),
    rec(8, status="pruned", counted=False),
    rec(9, status="compile_error"),
]


def test_pareto_front():
    """The front holds the non-dominated passing trials on (time, error), fastest first, without duplicates or failures."""
    front = pareto_front(FRONT_RECORDS)
    assert [r["number"] for r in front] == [3, 0, 1]


def test_pareto_front_of_nothing_passing():
    """With no passing trial the front is empty."""
    assert pareto_front([rec(0, status="wrong", time_us=1.0, max_abs=1.0), rec(1, status="launch_error")]) == []
    assert pareto_front([]) == []


def test_best_record_is_fastest_ok():
    """best_record picks the fastest passing, non-duplicate trial, ignoring faster failures."""
    assert best_record(FRONT_RECORDS)["number"] == 3


def test_best_record_ties():
    """Equal times are broken by lower error, then by the earlier trial."""
    assert best_record([rec(0, time_us=5.0, max_abs=2e-4), rec(1, time_us=5.0, max_abs=1e-4)])["number"] == 1
    assert best_record([rec(4, time_us=5.0, max_abs=1e-4), rec(2, time_us=5.0, max_abs=1e-4)])["number"] == 2


def test_best_record_none_without_pass():
    """best_record is None when nothing passed."""
    assert best_record([rec(0, status="crashed"), rec(1, status="wrong", time_us=1.0, max_abs=1.0)]) is None


def test_duplicate_of_zero_is_a_duplicate():
    """A record repeating trial 0 (duplicate_of == 0, which is falsy) is still a duplicate and never counts as best."""
    records = [rec(0, time_us=5.0, max_abs=1e-4), rec(1, time_us=4.0, max_abs=1e-4, duplicate_of=0)]
    assert [r["number"] for r in ok_records(records)] == [0]
    assert best_record(records)["number"] == 0
    assert [r["number"] for r in pareto_front(records)] == [0]


def test_update_summary_writes_pareto_and_best(runs_root):
    """update_summary writes pareto.json (the front) and best.json (the best record) and returns the best."""
    run = Run.create("summary", {})
    for r in FRONT_RECORDS:
        run.append_trial(r)
    top = run.update_summary()
    assert top["number"] == 3
    assert json.loads((run.path / "best.json").read_text()) == top
    assert [r["number"] for r in json.loads((run.path / "pareto.json").read_text())] == [3, 0, 1]
    assert run.best() == top


def test_update_summary_without_pass(runs_root):
    """With no passing trial, update_summary writes an empty front, no best.json, and returns None."""
    run = Run.create("nopass", {})
    run.append_trial(rec(0, status="wrong", time_us=1.0, max_abs=1.0))
    assert run.update_summary() is None
    assert json.loads((run.path / "pareto.json").read_text()) == []
    assert not (run.path / "best.json").exists()


def test_best_without_pass_raises(runs_root):
    """Run.best() on a run where nothing passed raises EvotuneError (exit 1), not a usage error."""
    run = Run.create("failing", {})
    run.append_trial(rec(0, status="launch_error"))
    run.append_trial(rec(1, status="ok", time_us=1.0, max_abs=1e-4, duplicate_of=0))
    with pytest.raises(EvotuneError, match="no trial that passed") as info:
        run.best()
    assert not isinstance(info.value, UsageError) and info.value.exit_code == 1


def test_write_json_is_atomic(runs_root, monkeypatch):
    """write_json leaves no temporary file behind, and a write that fails before the rename keeps the old file whole."""
    run = Run.create("atomic", {})
    run.write_json("best.json", {"number": 1, "result": {"time_us": 2.5}})
    assert run.read_json("best.json") == {"number": 1, "result": {"time_us": 2.5}}
    assert sorted(p.name for p in run.path.iterdir()) == ["best.json", "meta.json", "trials.jsonl"]

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(runs.os, "replace", failing_replace)
    with pytest.raises(OSError):
        run.write_json("best.json", {"number": 2, "result": {"time_us": 1.0}})
    assert run.read_json("best.json") == {"number": 1, "result": {"time_us": 2.5}}


def test_read_json_errors(runs_root):
    """A missing or corrupt JSON file of a run is an EvotuneError naming the file."""
    run = Run.create("broken", {})
    with pytest.raises(EvotuneError, match="best.json: missing"):
        run.read_json("best.json")
    (run.path / "meta.json").write_text("{not json")
    with pytest.raises(EvotuneError, match="meta.json: not valid JSON"):
        run.meta()


def test_base_meta(monkeypatch):
    """base_meta records the command as `evotune ...`, the git sha from EVOTUNE_GIT_SHA, and the versions."""
    monkeypatch.setenv("EVOTUNE_GIT_SHA", "abc123def456")
    meta = runs.base_meta(["evotune", "search", "--trials", "3"])
    assert meta["command_line"] == "evotune search --trials 3"
    assert meta["git_sha"] == "abc123def456"
    assert meta["versions"]["evotune"] and meta["versions"]["python"].count(".") == 2
    monkeypatch.setattr(runs.sys, "argv", ["/path/to/evotune/__main__.py", "runs", "--json"])
    assert runs.base_meta()["command_line"] == "evotune runs --json"
