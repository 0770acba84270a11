"""Kill -9 a search in its own process, then resume it here: the records survive, the resume reaches
the asked total, and only the work in flight at the kill is lost (and redone).

The child (tests/_search_child.py) searches the reduced attention space of tests/test_search.py with
real NVRTC compiles in its compile pool and an evaluator that sleeps 0.5 s per candidate and logs
every evaluation it begins, so that both processes' evaluations can be compared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import _search_child as child
from evotune.records.runs import Run
from evotune.search.loop import run_search
from evotune.space.searchspace import load_space
from test_search import REDUCED_SPACE, check_records

TRIALS = 8
LOOKAHEAD = child.options(TRIALS).lookahead


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group `pgid`, read from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def parsed(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def counted(path: Path) -> int:
    return sum(1 for r in parsed(path) if r.get("counted"))


def evaluations(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_kill_9_mid_search_then_resume(attention, mission, tmp_path, monkeypatch):
    """After SIGKILL mid-search (and a torn last record) a resume keeps every intact record, reaches the asked
    total, re-evaluates only what was in flight or torn, and no compile process outlives the killed search."""
    monkeypatch.setenv("EVOTUNE_RUNS", str(tmp_path / "runs"))
    space_path = tmp_path / "reduced.yaml"
    space_path.write_text(REDUCED_SPACE)
    log = tmp_path / "evaluated.log"
    trials_path = tmp_path / "runs" / "killed" / "trials.jsonl"
    out_path = tmp_path / "child.out"
    with open(out_path, "w") as out:
        # Its own session: the child and its compile processes form one process group to watch.
        proc = subprocess.Popen([sys.executable, str(Path(child.__file__)), str(space_path), "killed", str(TRIALS),
                                 str(log), "0.5"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Kill once there are 3 records, the last one counted (to be torn below), and an evaluation has begun
        # that has no record: work in flight.
        deadline = time.time() + 600  # only stops the wait: generous for a loaded machine
        while not (len(records := parsed(trials_path)) >= 3 and records[-1]["counted"]
                   and evaluations(log) > counted(trials_path)):
            assert proc.poll() is None, f"the search process ended early:\n{out_path.read_text()}"
            assert time.time() < deadline, f"no 3 records in 600 s:\n{out_path.read_text()}"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    # The compile processes notice their parent is gone and exit. The deadline only stops the wait: it is
    # generous (a loaded machine may be mid-compile), and the assertion is that they exit, not how fast.
    deadline = time.time() + 120
    while group_members(proc.pid) and time.time() < deadline:
        time.sleep(0.1)
    assert group_members(proc.pid) == [], "compile processes outlived the killed search"

    killed_records = [json.loads(line) for line in trials_path.read_text().splitlines()]
    assert len(killed_records) >= 3 and sum(r["counted"] for r in killed_records) < TRIALS
    # Tear the last record as a kill in the middle of its write would.
    lines = trials_path.read_text().splitlines(keepends=True)
    torn = json.loads(lines[-1])
    prefix = "".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]
    trials_path.write_text(prefix)
    intact = killed_records[:-1]

    run = Run.open("killed")
    summary = run_search(attention, load_space(space_path), mission, run, child.SlowEvaluator(str(log), 0.0),
                         child.options(TRIALS))

    after = trials_path.read_text()
    assert after.startswith(prefix), "earlier records are intact and in place"
    assert after[len(prefix)] == "\n", "the first new record starts on a line of its own"
    resumed = [json.loads(line) for line in after[len(prefix) + 1:].splitlines()]
    records = run.trials()
    assert records == intact + resumed, "the torn line is skipped and cost no other record"
    check_records(records)
    assert summary["evaluated"] == TRIALS == sum(r["counted"] for r in records)
    assert len({r["digest"] for r in records if r["counted"]}) == TRIALS

    calls = [line.split() for line in log.read_text().splitlines()]
    assert {pid for _, pid in calls} == {str(proc.pid), str(os.getpid())}
    first = [d for d, pid in calls if pid == str(proc.pid)]
    second = [d for d, pid in calls if pid == str(os.getpid())]
    assert Counter(first).most_common(1)[0][1] == 1 and Counter(second).most_common(1)[0][1] == 1
    # Lost: evaluations the killed process began whose record is missing or torn. The child evaluates one
    # candidate at a time, so apart from the torn record only the one in flight is lost.
    in_flight = set(first) - {r["digest"] for r in killed_records if r["counted"]}
    assert len(in_flight) == 1
    lost = set(first) - {r["digest"] for r in intact if r["counted"]}
    assert torn["counted"] and lost == in_flight | {torn["digest"]}
    # The same seed proposes the same configs again: the lost ones are redone, and only they.
    assert set(first) & set(second) == lost

    # Trials the killed process asked and never recorded (in flight or queued ahead) are closed as FAIL.
    study = optuna.load_study(study_name="evotune", storage=run.storage())
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    unrecorded = [t for t in study.trials if t.number not in {r["number"] for r in records}
                  and t.number != torn["number"]]
    assert len(unrecorded) <= LOOKAHEAD + 1 and all(t.state == TrialState.FAIL for t in unrecorded)
