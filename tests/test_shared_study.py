"""Tests for several search agents sharing one run and one study (evotune.search.shared through run_search).

Each agent is a real process (multiprocessing spawn, tests/_shared_agent.py) running run_search on the
same run folder and the same Optuna study, with real NVRTC compiles of the reduced attention space of
tests/test_search.py and an evaluator that sleeps and answers a time computed from the config, so no
GPU is needed. The study lives in the run's journal file (the default), in the SQLite file of a run made
before the journal, or in a PostgreSQL server that the `postgres_url` fixture starts on loopback (skipped
where PostgreSQL is not installed, except in CI).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import _shared_agent
from evotune.records.runs import Run, best_record, pareto_front, redact_url
from evotune.space.searchspace import Config, load_space
from test_search import REDUCED_SPACE

SPAWN = mp.get_context("spawn")
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


@pytest.fixture
def space_path(tmp_path):
    path = tmp_path / "reduced.yaml"
    path.write_text(REDUCED_SPACE)
    return path


# Every test here writes runs into a temporary EVOTUNE_RUNS (conftest.runs_root).
pytestmark = pytest.mark.usefixtures("runs_root")

def new_run(name: str, mission, storage: str | None = None) -> Run:
    meta = {"shape_spec": mission.spec}
    if storage is not None:  # as `evotune search --storage URL` records it
        meta.update(storage=redact_url(storage), study_name=name)
    return Run.create(name, meta)


def start(space_path, run: Run, storage, trials, agents, log: Path, sleep_s: float, barrier=True) -> dict:
    """Start one process per (label, sampler, seed) in `agents`; with `barrier` they begin searching together."""
    gate = SPAWN.Barrier(len(agents)) if barrier else None
    procs = {}
    for label, sampler, seed in agents:
        procs[label] = SPAWN.Process(target=_shared_agent.agent, name=f"agent-{label}",
                                     args=(str(space_path), str(run.path), storage, trials, sampler, seed, label,
                                           str(log), sleep_s, gate))
        procs[label].gate = gate  # the parent must hold the barrier until the children have it
        procs[label].start()
    return procs


# Deadlines in this file only stop a wait that would otherwise never end; they are generous (>= 10x the time
# on an idle 2-core machine) so that a loaded CI machine does not fail them.
WAIT_S = 600


def join(procs: dict, timeout: float = WAIT_S) -> None:
    deadline = time.time() + timeout
    for label, p in procs.items():
        p.join(max(1.0, deadline - time.time()))
        if p.is_alive():
            for q in procs.values():
                q.kill()
            pytest.fail(f"agent {label} did not finish within {timeout} s")


def evaluations(log: Path) -> list[tuple[str, str]]:
    """(digest, agent label) of every evaluation any agent began."""
    return [tuple(line.split()[:2]) for line in log.read_text().splitlines()] if log.exists() else []


def summary_of(log: Path, label: str) -> dict:
    return json.loads((log.parent / f"summary-{label}.json").read_text())


def check_shared_run(run: Run, storage, trials: int, log: Path, labels) -> list[dict]:
    """Assert the invariants of a finished shared run (whole records, counts, summaries, study) and return its records."""
    # Every line of the log is one whole JSON record (no torn or interleaved lines).
    records = [json.loads(line) for line in run.trials_path.read_text().splitlines()]
    by_number = {r["number"]: r for r in records}
    assert len(by_number) == len(records), "trial numbers are unique"
    counted = [r for r in records if r["counted"]]
    assert len(counted) == trials, "--trials counts candidates of the whole run, across agents"
    assert len({r["digest"] for r in counted}) == trials, "no config is counted twice"
    assert {r["agent"] for r in counted} == set(labels), "every agent measured some"
    for r in records:
        assert Config.from_dict(r["config"]).digest() == r["digest"]
        assert "note" not in r, "agents on one host never race for a config (the ask lock)"
        if r.get("duplicate_of") is not None:
            first = by_number[r["duplicate_of"]]
            assert first["digest"] == r["digest"] and first.get("duplicate_of") is None
            assert r["result"] == first["result"] and r["counted"] is False

    # Each counted config that reached the evaluator (not pruned by the static gate) was evaluated exactly once,
    # by the agent whose record it is, and nothing else was.
    evaluated = evaluations(log)
    assert Counter(d for d, _ in evaluated).most_common(1)[0][1] == 1, "no config measured twice"
    assert sorted(evaluated) == sorted((r["digest"], r["agent"]) for r in counted if r["result"]["status"] == "ok")

    # The summary files agree with the records.
    assert json.loads((run.path / "best.json").read_text()) == json.loads(json.dumps(best_record(records)))
    assert json.loads((run.path / "pareto.json").read_text()) == json.loads(json.dumps(pareto_front(records)))

    # The study: nothing left RUNNING, each record on its trial, and its passing trials are the passing records.
    study = optuna.load_study(study_name=run.study_name, storage=Run(run.path, storage).storage())
    trials_by_number = {t.number: t for t in study.trials}
    assert not [t.number for t in study.trials if t.state == TrialState.RUNNING]
    for r in records:
        t = trials_by_number[r["number"]]
        assert t.state.is_finished() and t.user_attrs["record"] == r
    passing = {t.number for t in study.trials
               if t.state == TrialState.COMPLETE and t.values and all(math.isfinite(v) for v in t.values)}
    assert passing == {r["number"] for r in records if r["result"]["status"] == "ok"}
    assert {n for n in passing if by_number[n]["counted"]} == {r["number"] for r in counted
                                                               if r["result"]["status"] == "ok"}
    return records


def run_agents(space_path, mission, tmp_path, storage, name, legacy_sqlite=False):
    trials = 12
    run = new_run(name, mission, storage)
    if legacy_sqlite:
        (run.path / "study.db").touch()  # a run folder made before the journal: its study is SQLite
        assert run.storage_url.startswith("sqlite:///")
    log = tmp_path / "evaluated.log"
    # Two agents with the same seed propose the same configs in the same order: they must share them out.
    agents = [("gpu0", "random", 0), ("gpu0b", "random", 0), ("gpu1", "nsga2", 1)]
    join(start(space_path, run, storage, trials, agents, log, sleep_s=0.15))
    records = check_shared_run(run, storage, trials, log, [a[0] for a in agents])
    summaries = [summary_of(log, a[0]) for a in agents]
    assert all(s["evaluated"] == trials for s in summaries)
    assert sum(s["measured"] for s in summaries) == trials
    assert sum(s["proposals"] for s in summaries) == len(records)


def test_agents_share_one_study_journal(space_path, mission, tmp_path):
    """Three agent processes on one run and its journal study evaluate --trials configs in all, each once, with whole
    records, matching best/pareto, and every record on its study trial."""
    run_agents(space_path, mission, tmp_path, None, "shared-journal")
    assert (tmp_path / "runs" / "shared-journal" / "study.journal").stat().st_size > 0


def test_agents_share_a_legacy_sqlite_study(space_path, mission, tmp_path):
    """The same on a run made before the journal, whose study is its SQLite file."""
    run_agents(space_path, mission, tmp_path, None, "shared-sqlite", legacy_sqlite=True)
    assert not (tmp_path / "runs" / "shared-sqlite" / "study.journal").exists()


def test_agents_share_one_study_postgres(space_path, mission, tmp_path, postgres_url):
    """The same three agents sharing a study in a PostgreSQL database on loopback keep the same invariants, in a study
    named after the run that meta.json points to."""
    run_agents(space_path, mission, tmp_path, postgres_url, "shared-pg")
    run = Run.open("shared-pg")
    assert run.study_name == "shared-pg" and run.meta()["storage"] == postgres_url  # no password to hide
    assert optuna.study.get_all_study_names(storage=run.use_storage(postgres_url).storage()) == ["shared-pg"]


def test_exhaustive_agents_split_the_space_in_order(space_path, mission, tmp_path, reduced_admitted):
    """Two exhaustive agents together evaluate exactly the first --trials admitted configs in the space's order."""
    trials = 8
    run = new_run("shared-exhaustive", mission)
    log = tmp_path / "evaluated.log"
    join(start(space_path, run, None, trials, [("a", "exhaustive", 0), ("b", "exhaustive", 0)], log, sleep_s=0.2))
    records = check_shared_run(run, None, trials, log, ["a", "b"])
    assert sorted(r["digest"] for r in records if r["counted"]) == sorted(c.digest() for c in reduced_admitted[:trials])


@pytest.fixture
def reduced_admitted(space_path, attention, mission):
    return load_space(space_path).admitted_configs(attention.context(mission))


@needs_proc
def test_kill_9_one_agent_then_resume_it(space_path, mission, tmp_path):
    """After SIGKILL of one of two agents mid-evaluation, the other closes the dead agent's open trials and a resumed
    agent joins, so the run ends with --trials configs counted once each, nothing RUNNING, and only the killed
    evaluation done again."""
    trials = 16
    run = new_run("shared-kill", mission)
    log = tmp_path / "evaluated.log"
    procs = start(space_path, run, None, trials, [("a", "random", 0), ("b", "random", 1)], log, sleep_s=0.4)
    victim = procs["b"]
    try:
        # Kill b once it has records and an evaluation under way that has no record: work in flight.
        deadline = time.time() + WAIT_S
        while True:
            records = [r for r in run.trials() if r.get("agent") == "b" and r["counted"]]
            begun = [d for d, label in evaluations(log) if label == "b"]
            if len(records) >= 2 and len(begun) > len(records):
                break
            assert victim.is_alive() and time.time() < deadline, f"agent b ended or never got going in {WAIT_S} s"
            time.sleep(0.02)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        in_flight = set(begun) - {r["digest"] for r in run.trials() if r.get("agent") == "b"}
        assert len(in_flight) == 1
        # Resume the killed agent's part while a is still searching.
        resumed = start(space_path, run, None, trials, [("b2", "random", 2)], log, sleep_s=0.4, barrier=False)
        join({"a": procs["a"], **resumed})
    finally:
        for p in list(procs.values()) + list(locals().get("resumed", {}).values()):
            if p.is_alive():
                p.kill()
    assert victim.exitcode == -signal.SIGKILL

    records = [json.loads(line) for line in run.trials_path.read_text().splitlines()]
    counted = [r for r in records if r["counted"]]
    assert len(counted) == trials and len({r["digest"] for r in counted}) == trials
    assert {"a", "b"} <= {r["agent"] for r in counted}
    # The killed evaluation has no record; whoever proposes that config again measures it once more. Nothing
    # else is measured twice.
    twice = [d for d, n in Counter(d for d, _ in evaluations(log)).items() if n > 1]
    assert set(twice) <= in_flight
    ok = {r["digest"] for r in counted if r["result"]["status"] == "ok"}
    assert ok <= {d for d, _ in evaluations(log)} <= ok | in_flight
    study = optuna.load_study(study_name=run.study_name, storage=run.storage())
    assert not [t.number for t in study.trials if t.state == TrialState.RUNNING]
    recorded = {r["number"] for r in records}
    # b's trials with no record (the one in flight, the ones asked ahead) were closed as failed by a live agent.
    orphans = [t for t in study.trials if t.number not in recorded]
    assert orphans and all(t.state == TrialState.FAIL for t in orphans)
    assert any(t.user_attrs.get("evotune", {}).get("agent", "").split("/")[1] == str(victim.pid) for t in orphans)
    assert json.loads((run.path / "best.json").read_text()) == json.loads(json.dumps(best_record(records)))


def test_second_folder_joins_a_postgres_study(space_path, mission, tmp_path, postgres_url, monkeypatch):
    """A run folder made from the study alone (another host joining with `--resume --storage URL`) shares the search
    with the first, both folders ending with every record once and --trials configs counted once each."""
    trials = 10
    first = new_run("joined", mission, postgres_url)
    first.share_meta()
    monkeypatch.setenv("EVOTUNE_RUNS", str(tmp_path / "other-host"))
    second = Run.join("joined", postgres_url, {"joined": {"host": "test"}})
    assert second.path != first.path and second.log_id != first.log_id
    assert {k: v for k, v in second.meta().items() if k not in ("log_id", "joined")} == \
        {k: v for k, v in first.meta().items() if k != "log_id"}
    log = tmp_path / "evaluated.log"
    gate = SPAWN.Barrier(2)
    procs = {label: SPAWN.Process(target=_shared_agent.agent,
                                  args=(str(space_path), str(run.path), postgres_url, trials, "random", seed, label,
                                        str(log), 0.2, gate))
             for label, run, seed in (("host1", first, 0), ("host2", second, 1))}
    for p in procs.values():
        p.gate = gate
        p.start()
    join(procs)

    logs = [[json.loads(line) for line in run.trials_path.read_text().splitlines()] for run in (first, second)]
    assert sorted(r["number"] for r in logs[0]) == sorted(r["number"] for r in logs[1]), "both folders hold every record"
    for run, records in zip((first, second), logs):
        assert len({r["number"] for r in records}) == len(records), "no record copied twice"
        counted = [r for r in records if r["counted"]]
        assert len(counted) == trials and len({r["digest"] for r in counted}) == trials
        assert {r["agent"] for r in counted} == {"host1", "host2"}
        assert json.loads((run.path / "best.json").read_text()) == json.loads(json.dumps(best_record(records)))
        assert json.loads((run.path / "pareto.json").read_text()) == json.loads(json.dumps(pareto_front(records)))
    # Folders on different hosts can race for a config (no shared lock): at worst one extra measurement each.
    extra = len(evaluations(log)) - trials
    assert extra == sum(1 for r in logs[0] if r.get("note")) and extra <= 2


@needs_proc
def test_ctrl_c_stops_all_agents_then_resume(space_path, mission, attention, tmp_path, monkeypatch):
    """One SIGINT to each evotune.search.agents process (the CLI's Ctrl-C) makes each record what it is measuring and exit
    130 with no RUNNING trial left, and agents started again complete the run without measuring anything twice."""
    from evotune.search.agents import INTERRUPTED, Agents, specs_for
    from evotune.search.loop import SearchOptions

    log = tmp_path / "evaluated.log"
    monkeypatch.setenv("EVOTUNE_TEST_EVAL_LOG", str(log))
    monkeypatch.setenv("EVOTUNE_TEST_EVAL_SLEEP", "0.3")
    trials = 10
    run = new_run("ctrl-c", mission)
    space = load_space(space_path)

    def agents():
        options = SearchOptions(trials=trials, sampler="random", population=4, seed=0, compile_workers=1, lookahead=2)
        return Agents(specs_for([0, 0], run_path=str(run.path), storage=None, problem=attention, shape=mission,
                                space=space, options=options, evaluator=_shared_agent.cpu_evaluator))

    first = agents()
    assert [s.label.split(":")[-1] for s in first.specs] == ["gpu0", "gpu0.1"]
    first.start()
    try:
        deadline = time.time() + WAIT_S
        while sum(r["counted"] for r in run.trials()) < 3:
            assert first.alive() and time.time() < deadline, f"agents ended early: {first.failures()}"
            time.sleep(0.05)
        first.interrupt()
        assert first.wait(60), "agents still running 60 s after SIGINT"
    finally:
        first.kill()
    assert all(p.exitcode == INTERRUPTED for p in first.procs.values())
    assert {status for status, _ in first.outcomes.values()} == {"stopped"} and not first.failures()
    records = [json.loads(line) for line in run.trials_path.read_text().splitlines()]
    assert 3 <= sum(r["counted"] for r in records) < trials
    assert {d for d, _ in evaluations(log)} <= {r["digest"] for r in records}, "what was measured was recorded"
    study = optuna.load_study(study_name=run.study_name, storage=run.storage())
    assert not [t.number for t in study.trials if t.state == TrialState.RUNNING]

    again = agents().start()
    try:
        assert again.wait(240), "resumed agents did not finish"
    finally:
        again.kill()
    assert not again.failures() and {s for s, _ in again.outcomes.values()} == {"done"}
    records = [json.loads(line) for line in run.trials_path.read_text().splitlines()]
    counted = [r for r in records if r["counted"]]
    assert len(counted) == trials and len({r["digest"] for r in counted}) == trials
    assert Counter(d for d, _ in evaluations(log)).most_common(1)[0][1] == 1, "nothing measured twice"


def test_cli_search_gpus_runs_one_agent_per_entry(space_path, mission, tmp_path, monkeypatch, capsys):
    """`evotune search --gpus 0,1 --json` (with CPU stand-ins for GPU discovery and the GPU workers) runs one agent
    per entry on one new run and reports the whole run."""
    import sys

    from evotune.search import agents as agents_module
    from evotune import cli as cli_module
    from evotune.cli import common as cli_common
    from evotune.gpu import workers as workers_module

    class InfoWorker:
        def __init__(self, device=0, timeout_s=60.0):
            self.device = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def call(self, job, timeout_s=None):
            if job["kind"] == "beside":  # the run's closing baselines measurement: a stand-in has no GPU
                raise workers_module.WorkerError("crashed", "CPU stand-in: no GPU to time the baselines on")
            assert job == {"kind": "info"}
            return {"name": "CPU stand-in", "device": self.device}

        def info(self):
            return self.call({"kind": "info"})

    real_specs = agents_module.specs_for
    monkeypatch.setattr(cli_common, "gpu_count", lambda: 2)
    monkeypatch.setattr(workers_module, "GPUWorker", InfoWorker)
    monkeypatch.setattr(agents_module, "specs_for",
                        lambda devices, **kw: real_specs(devices, **kw, evaluator=_shared_agent.cpu_evaluator))
    log = tmp_path / "evaluated.log"
    monkeypatch.setenv("EVOTUNE_TEST_EVAL_LOG", str(log))
    monkeypatch.setenv("EVOTUNE_TEST_EVAL_SLEEP", "0.3")
    monkeypatch.setattr(sys, "argv", ["evotune", "search", "--space", str(space_path), "--shape", "mission",
                                      "--gpus", "0,1", "--trials", "6", "--sampler", "exhaustive", "--run", "cli-gpus",
                                      "--compile-workers", "1", "--lookahead", "1", "--json"])
    capsys.readouterr()
    cli_module.main()
    summary = json.loads(capsys.readouterr().out)
    run = Run.open("cli-gpus")
    records = run.trials()
    counted = [r for r in records if r["counted"]]
    assert summary["evaluated"] == len(counted) == 6 and len({r["digest"] for r in counted}) == 6
    assert summary["best"] == best_record(records) and summary["proposals"] == len(records)
    labels = {r["agent"] for r in counted}
    assert len(labels) == 2 and {label.split(":")[-1] for label in labels} == {"gpu0", "gpu1"}
    assert set(summary["agents"]) == labels and sum(a["measured"] for a in summary["agents"].values()) == 6
    meta = run.meta()
    assert meta["gpus"] == [0, 1] and meta["device"] == {"name": "CPU stand-in", "device": 0}
    assert "storage" not in meta and run.study_name == "evotune"
