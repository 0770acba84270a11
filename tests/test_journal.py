"""Tests for evotune.records.journal: the run's own study file (Optuna's JournalStorage over evotune's backend).

What it must keep of the SQLite file it replaced: a study that survives reopening, several processes on one
file, a kill -9 that stalls nobody and damages nothing, and damage named rather than repaired silently."""

from __future__ import annotations

import fcntl
import gzip
import json
import multiprocessing as mp
import os
import signal
import time
import warnings

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from evotune.errors import UsageError
from evotune.records.journal import DamagedJournal, RunJournal, archived_name, journal_storage
from evotune.records.runs import Run

optuna.logging.set_verbosity(optuna.logging.WARNING)
DISTS = {"block_m": CategoricalDistribution([32, 64, 128]), "stages": CategoricalDistribution([2, 3, 4])}


def _study(path, name="evotune"):
    return optuna.create_study(study_name=name, storage=journal_storage(path), load_if_exists=True,
                               directions=["minimize", "minimize"], sampler=optuna.samplers.RandomSampler(0))


def _finished(path) -> list:
    return _study(path).get_trials(deepcopy=False, states=(TrialState.COMPLETE,))


def test_new_run_keeps_its_study_in_the_journal(runs_root):
    """A new run's storage is the journal in its folder; a trial told there is read back by a fresh storage."""
    run = Run.create("j", {})
    study = optuna.create_study(study_name=run.study_name, storage=run.storage(), directions=["minimize", "minimize"])
    trial = study.ask(DISTS)
    trial.set_user_attr("digest", "abc")
    study.tell(trial, [5.5, 1e-4])
    assert (run.path / "study.journal").is_file() and not (run.path / "study.db").exists()
    again = optuna.load_study(study_name=run.study_name, storage=run.storage())
    [t] = again.get_trials()
    assert t.state == TrialState.COMPLETE and t.values == [5.5, 1e-4] and t.user_attrs["digest"] == "abc"
    assert t.params == trial.params


def test_archived_journal_is_unpacked_once(runs_root):
    """A committed run keeps study.journal.gz: opening its study unpacks it beside (the archive stays) and reads the
    same trials; a journal already there is never replaced (it may hold appends); a damaged archive is one error."""
    run = Run.create("packed", {})
    study = optuna.create_study(study_name=run.study_name, storage=run.storage(), directions=["minimize", "minimize"])
    study.tell(study.ask(DISTS), [5.5, 1e-4])
    journal = run.path / "study.journal"
    archived_name(journal).write_bytes(gzip.compress(journal.read_bytes()))
    journal.unlink()
    [t] = optuna.load_study(study_name=run.study_name, storage=run.storage()).get_trials()
    assert t.values == [5.5, 1e-4] and journal.is_file() and archived_name(journal).is_file()
    again = optuna.load_study(study_name=run.study_name, storage=run.storage())  # the unpacked file, appended to
    again.tell(again.ask(DISTS), [6.0, 1e-4])
    assert len(optuna.load_study(study_name=run.study_name, storage=run.storage()).get_trials()) == 2
    assert sorted(p.name for p in run.path.iterdir() if "unpack" in p.name) == []
    journal.unlink()
    archived_name(journal).write_bytes(b"not gzip")
    with pytest.raises(UsageError, match="cannot unpack the run's archived journal"):
        run.storage()
    assert not journal.exists()


def test_archived_records_are_unpacked_once(runs_root):
    """A committed run may keep trials.jsonl.gz: the first read of its records unpacks it beside (the archive stays),
    with the same records; a trials.jsonl already there is never replaced; a damaged archive is one error."""
    run = Run.create("packed-records", {})
    line = json.dumps({"number": 0, "config": {"block_m": 64}, "counted": True}) + "\n"
    run.trials_path.write_text(line)
    archived_name(run.trials_path).write_bytes(gzip.compress(line.encode()))
    (run.path / "trials.jsonl").unlink()
    assert run.trials_path.read_text() == line and archived_name(run.path / "trials.jsonl").is_file()
    with open(run.trials_path, "a") as f:
        f.write(line)
    assert run.trials_path.read_text() == 2 * line  # the unpacked file, appended to: kept
    (run.path / "trials.jsonl").unlink()
    archived_name(run.path / "trials.jsonl").write_bytes(b"not gzip")
    with pytest.raises(UsageError, match="cannot unpack the run's archived records"):
        run.trials_path
    assert not (run.path / "trials.jsonl").exists()


def test_run_made_before_the_journal_keeps_sqlite(runs_root):
    """A run folder with study.db (made before the journal) still opens its SQLite study."""
    run = Run.create("old", {})
    (run.path / "study.db").touch()
    assert run.storage_url == f"sqlite:///{run.path / 'study.db'}"
    assert type(run.storage()).__name__ in ("RDBStorage", "_CachedStorage")


def test_torn_tail_is_skipped_then_cut_by_the_next_append(tmp_path):
    """A writer killed mid-line leaves a half line: readers stop before it, and the next append cuts it
    off before writing, so the journal stays whole lines and every told trial is kept."""
    path = tmp_path / "study.journal"
    study = _study(path)
    for v in (3.0, 2.0):
        t = study.ask(DISTS)
        study.tell(t, [v, 0.0])
    whole = path.read_bytes()
    with open(path, "ab") as f:
        f.write(b'{"op_code":4,"worker_id":"dead","trial')  # the half line of a killed writer
    assert [t.values[0] for t in _finished(path)] == [3.0, 2.0]
    study = _study(path)
    t = study.ask(DISTS)
    study.tell(t, [1.0, 0.0])
    data = path.read_bytes()
    assert data.startswith(whole) and b'"worker_id":"dead"' not in data and data.endswith(b"\n")
    assert [t.values[0] for t in _finished(path)] == [3.0, 2.0, 1.0]


def test_damaged_line_is_named(tmp_path):
    """A whole line that is not JSON is damage: reading raises DamagedJournal (a one-line usage error) naming
    the file and line, and changes nothing."""
    path = tmp_path / "study.journal"
    study = _study(path)
    study.tell(study.ask(DISTS), [1.0, 0.0])
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = b"".join(lines[:2] + [b"not json\n"] + lines[2:])
    path.write_bytes(damaged)
    with pytest.raises(DamagedJournal, match=r"study\.journal: line 3 is not a journal entry"):
        _study(path)
    assert path.read_bytes() == damaged


def test_reads_are_incremental(tmp_path):
    """After the first read, a storage reads only what was appended since (the offsets of whole lines)."""
    path = tmp_path / "study.journal"
    backend = RunJournal(path)
    backend.append_logs([{"n": 0}, {"n": 1}])
    assert [e["n"] for e in backend.read_logs(0)] == [0, 1]
    backend.append_logs([{"n": 2}])
    assert [e["n"] for e in backend.read_logs(2)] == [2]
    assert [e["n"] for e in backend.read_logs(1)] == [1, 2]
    with open(path, "ab") as f:
        f.write(b'{"n": 3')  # being written by another process: not yet an entry
    assert [e["n"] for e in backend.read_logs(3)] == []


def _agent(path, n, seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(study_name="evotune", storage=journal_storage(path), load_if_exists=True,
                                    directions=["minimize", "minimize"], sampler=optuna.samplers.RandomSampler(seed))
        for i in range(n):
            t = study.ask(DISTS)
            t.set_user_attr("agent", seed)
            study.tell(t, [float(i), 0.0])


def test_processes_share_one_journal(tmp_path):
    """Four processes asking and telling at once on one journal: every trial of each is there once, with
    distinct numbers, and the file is whole lines."""
    path = tmp_path / "study.journal"
    _study(path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_agent, args=(path, 15, seed)) for seed in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    trials = _finished(path)
    assert len(trials) == 60 and sorted(t.number for t in trials) == list(range(60))
    assert sorted(sum(1 for t in trials if t.user_attrs["agent"] == a) for a in range(4)) == [15] * 4
    assert path.read_bytes().endswith(b"\n")


def _hold_lock(path, ready):
    backend = RunJournal(path)
    with backend._locked():
        ready.set()
        time.sleep(600)


def test_kill_9_while_holding_the_lock_stalls_nobody(tmp_path):
    """An agent killed (SIGKILL) while it holds the journal's lock releases it with its death: the lock is free
    as soon as the holder is dead (no stale-lock grace period to wait out), and the next append goes through."""
    path = tmp_path / "study.journal"
    study = _study(path)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(path, ready))
    holder.start()
    assert ready.wait(60)
    assert not _lock_is_free(path)  # not vacuous: the holder has it
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(60)
    assert holder.exitcode == -signal.SIGKILL
    # Free the moment its holder is dead: a non-blocking try gets it, so nothing waits out a grace period.
    assert _lock_is_free(path)
    study.tell(study.ask(DISTS), [1.0, 0.0])
    assert len(_finished(path)) == 1


def _lock_is_free(path) -> bool:
    """Whether a non-blocking exclusive flock on the journal succeeds now (the lock RunJournal appends under)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_only_a_trials_parameters_skip_the_fsync(tmp_path, monkeypatch):
    """The per-knob parameter logs of an ask are appended without an fsync; any other operation (a trial's state and
    values, a new trial) is fsynced, which writes the parameters before it to disk too."""
    from optuna.storages.journal._storage import JournalOperation

    from evotune.records import journal as J

    synced = []
    monkeypatch.setattr(J.os, "fsync", lambda fd: synced.append(fd))
    path = tmp_path / "study.journal"
    path.write_text("")
    backend = J.RunJournal(path)
    backend.append_logs([{"op_code": int(JournalOperation.SET_TRIAL_PARAM), "trial_id": 0}])
    assert synced == []
    backend.append_logs([{"op_code": int(JournalOperation.SET_TRIAL_STATE_VALUES), "trial_id": 0}])
    backend.append_logs([{"op_code": int(JournalOperation.SET_TRIAL_PARAM)},
                         {"op_code": int(JournalOperation.CREATE_TRIAL)}])
    assert len(synced) == 2 and len(list(backend.read_logs(0))) == 4
