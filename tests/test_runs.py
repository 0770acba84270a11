"""Tests for evotune.records.runs: run folders, the append-only trial log, and the Pareto front and best
record computed from it. Everything is written under a temporary EVOTUNE_RUNS."""

from __future__ import annotations

import json
import os

import pytest

from evotune.records import runs
from evotune.errors import EvotuneError, UsageError
from evotune.records.runs import Run, best_record, ok_records, pareto_front


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
    # A new run keeps its study in its own journal file (no RDB URL); runs made before it keep study.db.
    assert run.storage_url is None and run.study_place == str(run.path / "study.journal")


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


# ------------------------------------------------------------------ where runs live, damaged folders


def test_runs_dir_defaults_to_the_current_folder(monkeypatch, tmp_path):
    """Without EVOTUNE_RUNS (or with it empty), runs live in ./runs of the current folder, not beside the package."""
    monkeypatch.chdir(tmp_path)
    for unset in (lambda: monkeypatch.delenv("EVOTUNE_RUNS", raising=False),
                  lambda: monkeypatch.setenv("EVOTUNE_RUNS", "")):
        unset()
        assert runs.runs_dir() == tmp_path / "runs"
        assert Run.create("here", {}).path == tmp_path / "runs" / "here"
        (tmp_path / "runs" / "here" / "meta.json").unlink()
        (tmp_path / "runs" / "here" / "trials.jsonl").unlink()
        (tmp_path / "runs" / "here").rmdir()


def test_open_rejects_names_that_are_no_run_name(runs_root):
    """Run.open of a 300-character or path-like name is a one-line UsageError (no OSError from the file system)."""
    Run.create("real", {})
    for name in ("a" * 300, "../real", "x/y"):
        with pytest.raises(UsageError, match="run name") as info:
            Run.open(name)
        assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("[1, 2]", ":2: not a JSON object (a list)"),
        ("42", ":2: not a JSON object (a number)"),
        ("not json at all", ":2: not JSON"),
        ('{"number": "one", "config": {}, "result": {"status": "ok"}}', ":2: 'number' is not a trial number"),
        ('{"number": 1, "config": [], "result": {"status": "ok"}}', ":2: trial 1: 'config' is not a JSON object"),
        ('{"number": 1, "config": {}, "result": {}}', ":2: trial 1: 'result' has no status"),
        ('{"number": 1, "config": {}, "result": {"status": "ok", "time_us": null, "max_abs": 0.1}}',
         ":2: trial 1 passed but its time_us is null, not a number"),
        ('{"number": 1, "config": {}, "result": {"status": "ok", "time_us": 2.0, "max_abs": "small"}}',
         ':2: trial 1 passed but its max_abs is "small", not a number'),
        ('{"number": 1, "config": {}, "result": {"status": "wrong"}, "duplicate_of": "0"}',
         ":2: trial 1: 'duplicate_of' is not a trial number"),
    ],
    ids=["list", "number", "text", "number-field", "config", "status", "ok-null-time", "ok-text-error", "duplicate"],
)
def test_damaged_line_names_file_and_line(runs_root, line, fragment):
    """A line that is not a trial record makes trials() (and best/trial) raise DamagedRun naming the file and line,
    exit code 2, and reading leaves the file as it was."""
    run = Run.create("dmg", {})
    run.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    with open(run.trials_path, "a") as f:
        f.write(line + "\n")
    before = run.trials_path.read_bytes()
    for read in (run.trials, run.best, lambda: run.trial(0), lambda: run.select("0", "export")):
        with pytest.raises(runs.DamagedRun) as info:
            read()
        assert str(info.value) == f"{run.trials_path}{fragment}" and info.value.exit_code == 2
    assert run.trials_path.read_bytes() == before


@pytest.mark.parametrize(
    "text, fragment",
    [("[1, 2]", "not a JSON object (a list)"), ('"x"', "not a JSON object (a string)"),
     ("{" * 100_000, "not valid JSON"), ("\xff\xfe", "not valid JSON")],
    ids=["list", "string", "deep", "not-utf8"],
)
def test_damaged_meta_names_the_file(runs_root, text, fragment):
    """A meta.json that is not a JSON object (or not JSON) is a DamagedRun naming it."""
    run = Run.create("meta", {})
    (run.path / "meta.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(runs.DamagedRun) as info:
        run.meta()
    assert fragment in str(info.value)
    assert str(info.value).startswith(f"{run.path / 'meta.json'}: ")


def test_problem_and_shape_name_the_field(runs_root, mission):
    """problem_and_shape reads the run's family and shape, and names a field that is missing or out of range."""
    run = Run.create("ps", {"family": "attention", "shape": mission.as_dict()})
    problem, shape = run.problem_and_shape()
    assert problem.family == "attention" and shape == mission
    for meta, fragment in (({"shape": mission.as_dict()}, "'family' is missing"),
                           ({"family": "attention", "shape": [1]}, "'shape' is not a JSON object"),
                           ({"family": "attention", "shape": {"batch": 1}}, "'shape' has no 'heads'"),
                           ({"family": "attention", "shape": {**mission.as_dict(), "seq_q": 2**40}},
                            "'shape': shape: seq_q 1099511627776 is too large")):
        run.write_json("meta.json", meta)
        with pytest.raises(runs.DamagedRun, match=fragment):
            run.problem_and_shape()


def test_select(runs_root):
    """select takes 'best' or a trial number; a trial that did not pass is refused unless require_pass is off."""
    run = Run.create("sel", {})
    run.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    run.append_trial(rec(1, status="pruned"))
    assert run.select("best", "export")["number"] == 0 and run.select("0", "export")["number"] == 0
    with pytest.raises(EvotuneError, match=r"trial 1 of run sel did not pass \(pruned\); nothing to export!") as info:
        run.select("1", "export", hint="!")
    assert info.value.exit_code == 1
    assert run.select("1", "sass", require_pass=False)["number"] == 1
    for which in ("fastest", "-1", "9" * 5000):
        with pytest.raises(UsageError, match="export takes 'best' or a trial number"):
            run.select(which, "export")


def test_list_runs_marks_only_the_damaged(runs_root, mission):
    """list_runs gives every run folder a row; a damaged one says what is wrong, the others are whole."""
    meta = {"family": "attention", "shape": mission.as_dict(), "shape_spec": mission.spec,
            "device": {"name": "GPU"}}
    good = Run.create("good", meta)
    good.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    bad = Run.create("bad", meta)
    bad.append_trial(rec(0, time_us=2.0, max_abs=1e-4))
    with open(bad.trials_path, "a") as f:
        f.write("[]\n")
    orphan = runs_root / "orphan"  # trials but no meta.json
    orphan.mkdir()
    (orphan / "trials.jsonl").write_text("")
    rows = {r["run"]: r for r in runs.list_runs()}
    assert rows["good"] == {"run": "good", "shape": mission.spec, "device": "GPU", "trials": 1, "best_us": 2.0,
                            "damaged": None}
    assert rows["bad"]["damaged"] == "trials.jsonl:2: not a JSON object (a list)" and rows["bad"]["trials"] is None
    assert rows["orphan"]["damaged"] == "meta.json: missing"
