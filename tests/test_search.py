"""Tests for evotune.search.loop: the search loop end to end on the CPU, with real NVRTC compiles of the
attention template and an injected evaluator in place of the GPU worker.

The space is a reduced copy of search_spaces/attention.yaml (128 configurations, 96 admitted
on the mission shape), so that the few distinct kernels the tests compile stay cheap; the
session-wide cubin cache makes a config compiled by one test free for the next.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from evotune.records import result as R
from evotune.search import finalists as F
from evotune.search import loop as S
from evotune.errors import UsageError
from evotune.records.result import Result
from evotune.records.runs import Run
from evotune.search.loop import SAMPLERS, SearchOptions, run_search
from evotune.space.searchspace import Config, load_space
from evotune.build.template import KernelSource

REDUCED_SPACE = """\
# A reduced attention space for the search tests.
family: attention
description: reduced attention space for tests
params:
  block_m: {values: [32, 64]}
  block_n: {values: [32, 64]}
  compute_warps: {values: [2, 4]}
  producer_warps: {values: [0, 1]}
  stages: {values: [2, 3]}  # none of these 128 configs spills (stages 1 with a producer warp does)
  smem_layout: {values: [swizzle, pad]}
  q_in_regs: {values: [true, false]}
derived:
  threads: 32 * (compute_warps + producer_warps)
  rows_per_warp: block_m // compute_warps
  row_bytes: head_dim * dtype_bytes + (16 if smem_layout == 'pad' else 0)
  smem_bytes: (block_m + 2 * stages * block_n) * row_bytes
constraints:
  - expr: block_m % (16 * compute_warps) == 0
    why: each compute warp owns a whole number of 16-row mma tiles
  - expr: rows_per_warp <= 64
    why: more than four 16-row tiles per warp cannot keep O and S in registers
  - expr: smem_bytes <= smem_limit
    why: Q tile plus stages x (K,V) tiles must fit the per-block shared-memory limit
  - expr: threads <= max_threads
    why: a CTA has at most 1024 threads
"""

# Two configurations only (block_n varies); every other knob is fixed at a cheap value.
TINY_SPACE = """\
family: attention
params:
  block_m: {values: [32]}
  block_n: {values: [32, 64]}
  compute_warps: {values: [2]}
  producer_warps: {values: [0]}
  stages: {values: [1]}
  smem_layout: {values: [swizzle]}
  q_in_regs: {values: [true]}
constraints:
  - expr: block_m % (16 * compute_warps) == 0
    why: each compute warp owns a whole number of 16-row mma tiles
"""


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    path = tmp_path_factory.mktemp("spaces") / "attention-reduced.yaml"
    path.write_text(REDUCED_SPACE)
    return load_space(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("spaces") / "attention-tiny.yaml"
    path.write_text(TINY_SPACE)
    return load_space(path)


# Every test here writes runs into a temporary EVOTUNE_RUNS (conftest.runs_root).
pytestmark = pytest.mark.usefixtures("runs_root")

def fake_time(config: Config, registers: int) -> float:
    """A deterministic stand-in for the measured time of a config."""
    return round(20.0 - config["block_m"] / 16 - config["block_n"] / 32 + 0.5 * config["stages"]
                 + 0.25 * config["producer_warps"] + (0.125 if config["smem_layout"] == "pad" else 0.0)
                 + (0.0625 if not config["q_in_regs"] else 0.0) + registers / 1000.0, 6)


class FakeEvaluator:
    """Records every call and answers OK with a time computed from the config and its registers,
    unless `status_for(call_index, config)` names another status."""

    def __init__(self, space, context, status_for=None):
        self.space, self.context = space, context
        self.status_for = status_for
        self.calls: list[tuple[str, Config]] = []

    def __call__(self, config, compiled) -> Result:
        assert self.space.admitted(config, self.context), f"evaluator called for a pruned config {config.key()}"
        assert Path(compiled.cubin_path).is_file() and compiled.entry == "evotune_attention"
        index = len(self.calls)
        self.calls.append((config.digest(), config))
        status = self.status_for(index, config) if self.status_for else R.OK
        t = fake_time(config, compiled.resources.registers)
        if status == R.OK:
            return Result(status=R.OK, time_us=t, max_abs=1e-4,
                          timing={"median_us": t, "p10_us": t * 0.98, "p90_us": t * 1.02, "reps": 5,
                                  "launches_per_rep": 10, "method": "fake"})
        if status == R.WRONG:
            # Faster than anything that passes, and wildly wrong: must never be best.
            return Result(status=R.WRONG, message="error 500x the gate", time_us=0.01, max_abs=0.5)
        return Result(status=status, message=f"fake {status}")

    def digests(self) -> list[str]:
        return [d for d, _ in self.calls]


def search(problem, space, shape, run, evaluator, trials, sampler="nsga2", max_proposals_factor=30,
           on_trial=None, should_stop=None, lookahead=None):
    """run_search with a small NSGA-II population, a fixed seed and two compile workers (compiling ahead
    unless lookahead=0)."""
    options = SearchOptions(trials=trials, sampler=sampler, population=4, seed=0,
                            max_proposals_factor=max_proposals_factor, compile_workers=2, lookahead=lookahead)
    return run_search(problem, space, shape, run, evaluator, options, on_trial=on_trial, should_stop=should_stop)


def child_pids() -> set[int]:
    """Processes whose parent is this one, read from /proc (not from multiprocessing's own bookkeeping)."""
    me, out = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            out.add(int(stat.parent.name))
    return out


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


def without_times(records: list[dict]) -> list[dict]:
    """Records less the wall-clock fields, for comparing two searches."""
    return [{k: v for k, v in r.items() if k not in ("started", "finished")} for r in records]


def check_records(records: list[dict]) -> None:
    """Every record has the recorded fields; duplicates point at an earlier record of the same digest and repeat its result."""
    by_number = {r["number"]: r for r in records}
    assert len(by_number) == len(records), "trial numbers are unique"
    for r in records:
        assert {"number", "config", "digest", "result", "started", "finished", "counted"} <= set(r)
        assert r["result"]["status"] in R.STATUSES
        assert Config.from_dict(r["config"]).digest() == r["digest"]
        if r.get("duplicate_of") is not None:
            first = by_number[r["duplicate_of"]]
            assert first["number"] < r["number"] and first["digest"] == r["digest"]
            assert first.get("duplicate_of") is None
            assert r["result"] == first["result"] and r["counted"] is False


# ------------------------------------------------------------------ (a) end to end


def test_search_end_to_end(attention, reduced, mission):
    """An 8-trial search records every proposal, evaluates each admitted config once, and writes best.json and pareto.json."""
    run = Run.create("e2e", {"shape_spec": mission.spec})
    ev = FakeEvaluator(reduced, attention.context(mission))
    seen = []
    summary = search(attention, reduced, mission, run, ev, trials=8,
                     on_trial=lambda record, best: seen.append((record, best)))

    records = run.trials()
    assert len(records) >= 8 and len(records) == summary["proposals"] == len(seen)
    check_records(records)
    counted = [r for r in records if r["counted"]]
    assert summary["evaluated"] == len(counted) == 8 == len(ev.calls)
    assert Counter(ev.digests()).most_common(1)[0][1] == 1, "no config is evaluated twice"
    assert sorted(ev.digests()) == sorted(r["digest"] for r in counted)
    for r in records:
        status = r["result"]["status"]
        if r.get("duplicate_of") is None and not r["counted"]:
            assert status == R.PRUNED and r["result"]["message"].startswith("constraint: ")
            assert not reduced.admitted(Config.from_dict(r["config"]), attention.context(mission))
        if r["counted"]:
            assert status == R.OK and r["source_digest"]
            # The loop fills in what the compile reported when the evaluator leaves it out.
            assert r["result"]["resources"]["registers"] > 0 and r["result"]["compile_seconds"] >= 0
            assert r["result"]["time_us"] == fake_time(Config.from_dict(r["config"]),
                                                       r["result"]["resources"]["registers"])
    assert [rec["number"] for rec, _ in seen] == [r["number"] for r in records]

    ok = [r for r in records if r["result"]["status"] == R.OK and r.get("duplicate_of") is None]
    fastest = min(ok, key=lambda r: r["result"]["time_us"])
    best = json.loads((run.path / "best.json").read_text())
    assert best == fastest == summary["best"] == seen[-1][1]
    front = json.loads((run.path / "pareto.json").read_text())
    # All errors are equal, so the front is the fastest trial (and any that tie with it).
    assert front and front[0] == fastest
    assert all(r["result"]["time_us"] == fastest["result"]["time_us"] for r in front)
    assert summary["statuses"].get(R.OK) == len(ok)
    assert summary["run_id"] == "e2e"

    study = optuna.load_study(study_name="evotune", storage=run.storage())
    assert len(study.trials) == len(records)
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in study.trials)


def test_repeated_proposals_are_answered_from_the_record(attention, tiny, mission):
    """In a space of two configs, repeats become duplicate records and the search ends once both are recorded."""
    run = Run.create("tiny", {})
    ev = FakeEvaluator(tiny, attention.context(mission))
    summary = search(attention, tiny, mission, run, ev, trials=4, sampler="random", max_proposals_factor=3)
    records = run.trials()
    check_records(records)
    assert summary["proposals"] == len(records) < 4 * 3  # stopped by exhaustion, not by the proposal cap
    assert summary["evaluated"] == 2 and len(ev.calls) == 2 and len(set(ev.digests())) == 2
    dups = [r for r in records if r.get("duplicate_of") is not None]
    assert len(dups) == len(records) - 2
    firsts = {r["digest"]: r["number"] for r in records if r.get("duplicate_of") is None}
    assert all(d["duplicate_of"] == firsts[d["digest"]] for d in dups)
    assert summary["statuses"] == {R.OK: 2}  # duplicates are not counted twice
    best = json.loads((run.path / "best.json").read_text())
    assert best.get("duplicate_of") is None and best["counted"] is True


# ------------------------------------------------------------------ (b) failing candidates


def test_failing_statuses_are_recorded_never_best(attention, reduced, mission):
    """WRONG, LAUNCH_ERROR and TIMEOUT answers are recorded with their status, the search goes on, and none is best."""
    cycle = [R.WRONG, R.LAUNCH_ERROR, R.TIMEOUT, R.OK]
    run = Run.create("failing", {})
    ev = FakeEvaluator(reduced, attention.context(mission), status_for=lambda i, cfg: cycle[i % len(cycle)])
    summary = search(attention, reduced, mission, run, ev, trials=8, sampler="random")
    records = [r for r in run.trials() if r.get("duplicate_of") is None]
    by_digest = {r["digest"]: r for r in records}
    for i, digest in enumerate(ev.digests()):
        assert by_digest[digest]["result"]["status"] == cycle[i % len(cycle)]
        assert by_digest[digest]["counted"] is True  # a failure still spent its GPU time
    assert summary["evaluated"] == 8
    assert summary["statuses"][R.WRONG] == 2 and summary["statuses"][R.LAUNCH_ERROR] == 2
    assert summary["statuses"][R.TIMEOUT] == 2 and summary["statuses"][R.OK] == 2
    best = json.loads((run.path / "best.json").read_text())
    assert best["result"]["status"] == R.OK and summary["best"] == best
    assert all(r["result"]["status"] == R.OK for r in json.loads((run.path / "pareto.json").read_text()))
    wrong = [r for r in records if r["result"]["status"] == R.WRONG]
    assert all(w["result"]["time_us"] < best["result"]["time_us"] for w in wrong)  # faster, yet not best
    study = optuna.load_study(study_name="evotune", storage=run.storage())
    states = Counter(t.state for t in study.trials)
    assert states[TrialState.FAIL] >= 6 and states[TrialState.COMPLETE] >= 2


def test_all_failing_search_has_no_best(attention, reduced, mission):
    """A search where every candidate fails finishes with best None and no best.json."""
    run = Run.create("allfail", {})
    ev = FakeEvaluator(reduced, attention.context(mission), status_for=lambda i, cfg: R.CRASHED)
    summary = search(attention, reduced, mission, run, ev, trials=3, sampler="random")
    assert summary["best"] is None and summary["evaluated"] == 3
    assert not (run.path / "best.json").exists()
    assert json.loads((run.path / "pareto.json").read_text()) == []


# ------------------------------------------------------------------ (c) compile errors


def test_compile_error_is_recorded(attention, reduced, mission, monkeypatch):
    """A candidate whose source does not compile is a counted compile_error trial, never handed to the evaluator."""
    real_instantiate = S.instantiate
    broken = {}

    def instantiate(problem, config, shape):
        src = real_instantiate(problem, config, shape)
        if not broken or broken["digest"] == config.digest():
            broken["digest"] = config.digest()  # the first config instantiated is the broken one
            return KernelSource(family=src.family, entry=src.entry, template_path=src.template_path,
                                code=src.code + "\nstatic int evotune_broken = ;\n")
        return src

    monkeypatch.setattr(S, "instantiate", instantiate)
    run = Run.create("cerr", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    summary = search(attention, reduced, mission, run, ev, trials=4, sampler="random")
    assert broken["digest"] not in ev.digests()
    (bad,) = [r for r in run.trials() if r["digest"] == broken["digest"] and r.get("duplicate_of") is None]
    assert bad["result"]["status"] == R.COMPILE_ERROR and bad["counted"] is True
    assert bad["result"]["message"].startswith("NVRTC: ") and "error" in bad["result"]["message"]
    assert summary["statuses"][R.COMPILE_ERROR] == 1
    assert summary["evaluated"] == 4 and len(ev.calls) == 3
    assert summary["best"]["digest"] != broken["digest"]


def test_static_gate_prunes_before_evaluation(attention, reduced, mission, monkeypatch):
    """A compiled kernel that fails the static resource gate is a counted PRUNED trial with its resources, not evaluated."""
    monkeypatch.setattr("evotune.build.compile.static_violations",
                        lambda res, threads, smem, register_split=0: ["spills registers (8 B stores, 8 B loads)"])
    run = Run.create("static", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    summary = search(attention, reduced, mission, run, ev, trials=2, sampler="random")
    assert ev.calls == [] and summary["best"] is None and summary["evaluated"] == 2
    static = [r for r in run.trials() if r["counted"]]
    assert len(static) == 2
    for r in static:
        assert r["result"]["status"] == R.PRUNED and r["result"]["message"].startswith("static: spills")
        assert r["result"]["resources"]["registers"] > 0


# ------------------------------------------------------------------ (d) resume


def test_resume_continues_without_repeating(attention, reduced, mission):
    """A run resumed with more trials reaches the new total, keeps earlier records, and never evaluates a config twice."""
    run = Run.create("resumable", {"shape_spec": mission.spec})
    ev = FakeEvaluator(reduced, attention.context(mission))
    first = search(attention, reduced, mission, run, ev, trials=4, sampler="random")
    assert first["evaluated"] == 4
    before = run.trials_path.read_text()

    # A killed process leaves its trial RUNNING in the study (asked, never told) and nothing in trials.jsonl.
    study = optuna.load_study(study_name="evotune", storage=run.storage())
    orphan = study.ask(S.distributions(reduced)).number

    again = Run.open("resumable")
    second = search(attention, reduced, mission, again, ev, trials=8, sampler="random")
    assert second["evaluated"] == 8 and len(ev.calls) == 8
    assert len(set(ev.digests())) == 8, "no config is evaluated twice across the two calls"
    after = again.trials_path.read_text()
    assert after.startswith(before)  # earlier records intact, in place
    records = again.trials()
    # The resumed random sampler restarts from the same seed, so it re-proposes the first call's configs:
    # those must be answered from the records made before the restart.
    resumed = [json.loads(line) for line in after[len(before):].splitlines()]
    assert any(r.get("duplicate_of") is not None for r in resumed)
    check_records(records)
    assert sum(r["counted"] for r in records) == 8
    assert orphan not in {r["number"] for r in records}

    study = optuna.load_study(study_name="evotune", storage=run.storage())
    assert study.trials[orphan].state == TrialState.FAIL
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert json.loads((run.path / "best.json").read_text()) == second["best"]


def test_resume_of_finished_run_does_nothing(attention, reduced, mission):
    """Resuming a run that already has its trials proposes nothing and evaluates nothing."""
    run = Run.create("done", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    search(attention, reduced, mission, run, ev, trials=2, sampler="random")
    n = len(run.trials())
    summary = search(attention, reduced, mission, Run.open("done"), ev, trials=2, sampler="random")
    assert summary["proposals"] == 0 and summary["evaluated"] == 2 and len(ev.calls) == 2
    assert len(run.trials()) == n and summary["best"] is not None


# ------------------------------------------------------------------ (e) samplers


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_each_sampler_runs(attention, reduced, mission, sampler):
    """Each named sampler drives a 3-trial search to completion."""
    run = Run.create(f"s-{sampler}", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    summary = search(attention, reduced, mission, run, ev, trials=3, sampler=sampler)
    assert summary["evaluated"] == 3 and len(set(ev.digests())) == 3
    assert summary["best"] is not None and (run.path / "best.json").exists()


def test_unknown_sampler_is_usage_error(attention, reduced, mission):
    """An unknown sampler name is a UsageError naming the choices, raised before any trial is recorded."""
    run = Run.create("bad-sampler", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    with pytest.raises(UsageError, match="unknown sampler 'annealing'; choose one of surrogate, nsga2, tpe, random, exhaustive"):
        search(attention, reduced, mission, run, ev, trials=3, sampler="annealing")
    assert run.trials() == [] and ev.calls == []


# ------------------------------------------------------------------ (f) stopping


def test_should_stop_ends_the_loop(attention, reduced, mission):
    """When should_stop turns True the loop stops before the next proposal, and what finished is recorded."""
    run = Run.create("stopped", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    finished = []
    summary = search(attention, reduced, mission, run, ev, trials=8, sampler="random",
                     on_trial=lambda record, best: finished.append(record),
                     should_stop=lambda: len(finished) >= 2)
    assert summary["proposals"] == 2 and len(finished) == 2
    assert [r["number"] for r in run.trials()] == [r["number"] for r in finished]
    assert summary["evaluated"] == sum(r["counted"] for r in finished) <= 2
    assert (run.path / "pareto.json").exists()


def test_should_stop_at_once_records_nothing(attention, reduced, mission):
    """A search told to stop before it starts proposes nothing and records nothing."""
    run = Run.create("never", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    summary = search(attention, reduced, mission, run, ev, trials=8, should_stop=lambda: True)
    assert summary["proposals"] == 0 and summary["evaluated"] == 0 and summary["best"] is None
    assert run.trials() == [] and ev.calls == []


def test_should_stop_shuts_the_compile_pool_down(attention, reduced, mission):
    """Stopping with proposals queued ahead tells them FAIL without records and leaves no compile process behind."""
    before = child_pids() if Path("/proc/self/stat").exists() else set()
    run = Run.create("stop-ahead", {})
    ev = FakeEvaluator(reduced, attention.context(mission))
    finished, pool_seen = [], []

    def on_trial(record, best):
        finished.append(record)
        if Path("/proc/self/stat").exists():
            pool_seen.append(len(child_pids() - before))

    summary = search(attention, reduced, mission, run, ev, trials=8, sampler="random", lookahead=3,
                     on_trial=on_trial, should_stop=lambda: len(finished) >= 2)
    assert summary["proposals"] == 2 and summary["abandoned"] >= 1
    assert [r["number"] for r in run.trials()] == [r["number"] for r in finished]
    study = optuna.load_study(study_name="evotune", storage=run.storage())
    assert len(study.trials) == 2 + summary["abandoned"]
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    recorded = {r["number"] for r in finished}
    assert all(t.state == TrialState.FAIL for t in study.trials if t.number not in recorded)
    if Path("/proc/self/stat").exists():
        assert max(pool_seen) >= 1, "the compile pool was running during the search"
        assert child_pids() <= before, "no compile process outlives the search"


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no process priorities here")
def test_compile_pool_runs_below_the_search(tmp_path):
    """Compile processes run COMPILE_NICENESS below the search process, so the search and its GPU worker keep their
    CPUs while every compile process is busy."""
    from evotune.build.compile import COMPILE_NICENESS, compile_pool

    pool = compile_pool(2)
    try:
        niceness = {pool.submit(os.nice, 0).result(timeout=120) for _ in range(4)}
    finally:
        pool.shutdown()
    assert niceness == {min(19, os.nice(0) + COMPILE_NICENESS)}


@needs_proc
def test_keyboard_interrupt_shuts_down_and_resumes(attention, reduced, mission):
    """A KeyboardInterrupt from the evaluator ends the search with the pool gone and no RUNNING trial, and a resume
    evaluates nothing twice."""
    before = child_pids()
    run = Run.create("interrupted", {})
    ev = FakeEvaluator(reduced, attention.context(mission))

    def interrupting(config, compiled):
        if len(ev.calls) == 2:
            raise KeyboardInterrupt
        return ev(config, compiled)

    with pytest.raises(KeyboardInterrupt):
        search(attention, reduced, mission, run, interrupting, trials=6, sampler="random", lookahead=3)
    assert child_pids() <= before, "no compile process outlives the interrupt"
    assert sum(r["counted"] for r in run.trials()) == 2
    study = optuna.load_study(study_name="evotune", storage=run.storage())
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert len(study.trials) > len(run.trials())  # the interrupted and the queued trials were told FAIL

    summary = search(attention, reduced, mission, Run.open("interrupted"), ev, trials=6, sampler="random",
                     lookahead=3)
    assert summary["evaluated"] == 6 and len(ev.calls) == 6 and len(set(ev.digests())) == 6
    check_records(run.trials())


# ------------------------------------------------------------------ (g) compile ahead


def test_compile_ahead_records_what_a_serial_search_records(attention, reduced, mission, monkeypatch):
    """With the same seed, a search compiling ahead in the pool writes the same records as a serial one, evaluates in
    ask order, and never compiles in the search process; the serial one compiles each new config once."""
    real_compile = S.compile_source
    compiled_here = []

    def counting_compile(code, entry, *args, **kwargs):
        compiled_here.append(code)
        return real_compile(code, entry, *args, **kwargs)

    monkeypatch.setattr(S, "compile_source", counting_compile)
    context = attention.context(mission)

    serial_ev = FakeEvaluator(reduced, context)
    search(attention, reduced, mission, Run.create("serial", {}), serial_ev, trials=6, sampler="random", lookahead=0)
    serial = Run.open("serial").trials()
    assert len(compiled_here) == len(set(compiled_here)) == 6 == sum(r["counted"] for r in serial)

    ahead_ev = FakeEvaluator(reduced, context)
    search(attention, reduced, mission, Run.create("ahead", {}), ahead_ev, trials=6, sampler="random", lookahead=3)
    ahead = Run.open("ahead").trials()
    assert len(compiled_here) == 6, "compile-ahead compiles in the pool, not in the search process"
    assert without_times(ahead) == without_times(serial)
    assert [r["number"] for r in ahead] == sorted(r["number"] for r in ahead)  # recorded in ask order
    assert ahead_ev.digests() == [r["digest"] for r in ahead if r["counted"]]  # evaluated in ask order
    assert all(r["result"]["compile_seconds"] >= 0 for r in ahead if r["counted"])


def test_repeats_in_flight_wait_for_their_first(attention, reduced, mission, monkeypatch):
    """A config proposed again while its first proposal is still queued is compiled and evaluated once, and the
    repeat is recorded as its duplicate; a repeated constraint-pruned config likewise."""
    context = attention.context(mission)
    admitted = reduced.admitted_configs(context)
    a, b = admitted[0], admitted[1]
    p = next(c for c in reduced.all_configs() if not reduced.admitted(c, context))
    run = Run.create("window", {})
    study = optuna.create_study(study_name="evotune", storage=run.storage(), directions=["minimize", "minimize"])
    for cfg in (a, p, a, b, p, a):
        study.enqueue_trial(cfg.as_dict())

    submitted = []
    real_pool = S.compile_pool

    def counting_pool(workers):
        pool = real_pool(workers)
        real_submit = pool.submit

        def submit(fn, code, entry):
            submitted.append(code)
            return real_submit(fn, code, entry)

        pool.submit = submit
        return pool

    monkeypatch.setattr(S, "compile_pool", counting_pool)
    ev = FakeEvaluator(reduced, context)
    summary = search(attention, reduced, mission, run, ev, trials=3, sampler="random", lookahead=5)
    records = run.trials()
    check_records(records)
    first6 = records[:6]
    assert [r["digest"] for r in first6] == [c.digest() for c in (a, p, a, b, p, a)]
    assert [r.get("duplicate_of") for r in first6] == [None, None, 0, None, 1, 0]
    assert [r["counted"] for r in first6] == [True, False, False, True, False, False]
    assert first6[1]["result"]["status"] == R.PRUNED and first6[1]["result"]["message"].startswith("constraint: ")
    assert ev.digests()[:2] == [a.digest(), b.digest()] and summary["evaluated"] == 3 == len(ev.calls)
    assert len(submitted) == len(set(submitted)) == 3, "one compile per new config, none for repeats"


def test_summary_written_once_per_distinct_config(attention, tiny, mission, monkeypatch):
    """Duplicates do not rewrite pareto/best, and the summary equals one computed from trials.jsonl."""
    from evotune.records.runs import best_record, pareto_front

    calls = []
    original = Run.update_summary

    def counting(self, records=None):
        calls.append(records is not None)
        return original(self, records)

    monkeypatch.setattr(Run, "update_summary", counting)
    run = Run.create("summary-once", {})
    search(attention, tiny, mission, run, FakeEvaluator(tiny, attention.context(mission)), trials=4,
           sampler="random", max_proposals_factor=3)
    records = run.trials()
    firsts = [r for r in records if r.get("duplicate_of") is None]
    assert len(calls) == len(firsts) and all(calls)
    assert json.loads((run.path / "best.json").read_text()) == json.loads(json.dumps(best_record(records)))
    assert json.loads((run.path / "pareto.json").read_text()) == json.loads(json.dumps(pareto_front(records)))


# ------------------------------------------------------------------ SDPA beside the best, once per run


class FakeBeside:
    """Stands in for GPUWorker.call on a "beside" job: baselines first, then the finalists re-timed; `times`
    (label -> us, else `ours`) are their interleaved medians, where `interleaved`."""

    def __init__(self, ours: float = 9.0, fail: bool = False, head_to_head: dict | None = None,
                 times: dict | None = None, interleaved: bool = False):
        self.ours, self.fail, self.head_to_head = ours, fail, head_to_head
        self.times, self.interleaved = times or {}, interleaved
        self.jobs: list[dict] = []

    def __call__(self, job: dict, timeout_s=None) -> dict:
        from evotune.gpu.workers import WorkerError

        self.jobs.append({**job, "timeout_s": timeout_s})
        if self.fail:
            raise WorkerError(R.TIMEOUT, "no answer within 900 s (hang?); worker killed")
        row = lambda t, ok: {"available": True, "time_us": t, "verification": {"passed": ok}}  # noqa: E731
        times = {label: self.times.get(label, self.ours) for label in job["labels"]}
        h2h = self.head_to_head
        if self.interleaved:
            h2h = {"rounds": 10, "winner": min(times, key=times.get),
                   "timings": {**{label: {"median_us": t} for label, t in times.items()},
                               "flash": {"median_us": 12.0}, "cudnn": {"median_us": 5.0}}}
        return {"baselines": {"flash": row(12.0, True), "cudnn": row(5.0, False),
                              "math": {"available": False, "reason": "not timed"}},
                "finalists": {label: Result(status=R.OK, time_us=t, max_abs=1e-4).as_dict()
                              for label, t in times.items()},
                "head_to_head": h2h, "device": {"name": "NVIDIA H100 80GB HBM3", "sm": "9.0"}}


def beside_run(name: str, shape, space) -> Run:
    return Run.create(name, {"family": "attention", "shape": shape.as_dict(), "shape_spec": shape.spec,
                             "space": str(space.path), "device": {"name": "NVIDIA H100 80GB HBM3", "sm": "9.0"}})


def test_best_is_timed_beside_sdpa_once_per_best(attention, tiny, mission):
    """The run's best is re-timed in the worker job that times the baselines; baselines.json records it; a
    second call for the same best measures nothing; a resume that finds a better config replaces the file."""
    from evotune.records.tuning_table import build_table

    run = beside_run("beside", mission, tiny)
    ev = FakeEvaluator(tiny, attention.context(mission))
    search(attention, tiny, mission, run, ev, trials=1, sampler="exhaustive")
    first_best = run.best()
    call = FakeBeside()
    note = F.measure_beside_best(run, attention, mission, call, reps=7)
    assert note["status"] == "measured" and "beside flash 12.00 us" in note["message"], note
    (job,) = call.jobs
    assert job["kind"] == "beside" and job["configs"] == [first_best["config"]] and job["reps"] == 7
    assert job["labels"] == [f"trial {first_best['number']}"]
    assert job["shape"] == mission.as_dict() and Path(job["compileds"][0]["cubin_path"]).is_file()
    rec = json.loads((run.path / "baselines.json").read_text())
    assert rec["kind"] == "evotune-run-baselines" and rec["run"] == "beside" and rec["reps"] == 7
    assert rec["best"]["number"] == first_best["number"] and rec["evotune"]["time_us"] == 9.0
    assert rec["device"]["name"] == "NVIDIA H100 80GB HBM3" and rec["versions"]["evotune"]
    assert set(rec["baselines"]) == {"flash", "cudnn", "math"}

    assert F.measure_beside_best(run, attention, mission, call)["status"] == "kept" and len(call.jobs) == 1

    resumed = Run.open("beside")
    search(attention, tiny, mission, resumed, ev, trials=2, sampler="exhaustive")
    assert resumed.best()["number"] != first_best["number"]  # block_n 64 is faster in fake_time
    assert F.measure_beside_best(resumed, attention, mission, call)["status"] == "measured"
    assert len(call.jobs) == 2 and call.jobs[1]["configs"][0] == resumed.best()["config"]
    assert json.loads((run.path / "baselines.json").read_text())["best"]["number"] == resumed.best()["number"]

    (entry,) = build_table(["beside"])[0].entries
    # The table compares the same-process re-time (9.0 us), not the trial's own, with the fastest passing backend.
    assert entry.evotune_us == 9.0 and entry.sdpa == {"backend": "flash", "time_us": 12.0}
    assert entry.route == "evotune" and entry.evidence["kind"] == "run"


def test_beside_route_takes_the_interleaved_medians(attention, tiny, mission):
    """Where the beside job timed the kernel and the baselines interleaved, the summary and the table's route take
    those medians, not the solo times: here solo says evotune 9.0 us beats FLASH 12.0 us, interleaved 12.5 us
    loses to 11.0 us, and the user gets SDPA."""
    from evotune.records.tuning_table import build_table

    run = beside_run("paired", mission, tiny)
    search(attention, tiny, mission, run, FakeEvaluator(tiny, attention.context(mission)), trials=1,
           sampler="exhaustive")
    label = f"trial {run.best()['number']}"
    h2h = {"rounds": 10, "winner": label, "timings": {label: {"median_us": 12.5}, "flash": {"median_us": 11.0},
                                                      "cudnn": {"median_us": 4.0}}}
    note = F.measure_beside_best(run, attention, mission, FakeBeside(head_to_head=h2h))
    assert "12.50 us beside flash 11.00 us" in note["message"], note  # cudnn did not pass the gate
    rec = json.loads((run.path / "baselines.json").read_text())
    assert rec["version"] == F.BESIDE_VERSION == 3 and rec["head_to_head"] == h2h
    (entry,) = build_table(["paired"])[0].entries
    assert entry.evotune_us == 12.5 and entry.sdpa == {"backend": "flash", "time_us": 11.0}
    assert entry.route == "sdpa" and entry.reason.startswith("slower")


def test_finalists_re_timed_interleaved_name_the_best(attention, tiny, mission):
    """The closing job re-times the fastest recorded trials (within 10%, distinct sources, at most FINALISTS)
    interleaved; the one with the fastest interleaved median becomes the run's best (best.json, Run.best, the
    table), though its search time was not the fastest; a resume that adds a new contender falls back to the
    fastest recorded trial until the finalists are re-timed, and one that adds none keeps the record."""
    from evotune.records import best as B
    from evotune.records.tuning_table import build_table

    run = beside_run("finals", mission, tiny)
    ev = FakeEvaluator(tiny, attention.context(mission))
    search(attention, tiny, mission, run, ev, trials=12, sampler="random")
    records = run.trials()
    finals = B.finalists(records)
    fastest = B.best_record(records)
    assert finals[0] is not None and finals[0]["number"] == fastest["number"]
    limit = fastest["result"]["time_us"] * (1 + B.FINALIST_WITHIN)
    inside = [r for r in B.ok_records(records) if r["result"]["time_us"] <= limit]
    assert len(finals) == min(B.FINALISTS, len({r["source_digest"] for r in inside})) >= 2, finals
    assert all(f["result"]["time_us"] <= limit for f in finals)
    underdog = finals[-1]
    call = FakeBeside(interleaved=True, times={f"trial {underdog['number']}": 7.0})
    note = F.measure_beside_best(run, attention, mission, call)
    assert note["status"] == "measured", note
    assert f"trial {underdog['number']} 7.00 us (fastest of {len(finals)} finalists" in note["message"], note
    (job,) = call.jobs
    assert job["labels"] == [f"trial {f['number']}" for f in finals]
    assert run.best()["number"] == underdog["number"] != fastest["number"]
    assert json.loads((run.path / "best.json").read_text())["number"] == underdog["number"]
    rec = json.loads((run.path / "baselines.json").read_text())
    assert rec["best"]["interleaved_us"] == 7.0 and rec["finalist_rule"] == {"count": B.FINALISTS,
                                                                             "within": B.FINALIST_WITHIN}
    (entry,) = build_table(["finals"])[0].entries
    assert entry.config == underdog["config"] and entry.evotune_us == 7.0
    assert entry.sdpa == {"backend": "flash", "time_us": 12.0}  # the other finalists are no baselines
    assert F.measure_beside_best(run, attention, mission, call)["status"] == "kept"

    # A new record faster than all: the recorded finalists are stale, the fastest recorded trial is the best again.
    newcomer = {**fastest, "number": 999, "digest": "new", "source_digest": "new-source",
                "result": {**fastest["result"], "time_us": fastest["result"]["time_us"] * 0.5}}
    assert B.final_best(records + [newcomer], B.read_beside(run.path))["number"] == 999
    # A slow new record (no contender): the finalists and their winner stand.
    slow = {**newcomer, "result": {**fastest["result"], "time_us": fastest["result"]["time_us"] * 2}}
    assert B.final_best(records + [slow], B.read_beside(run.path))["number"] == underdog["number"]


def test_finalists_rule():
    """Within the margin, fastest first, one per kernel source, at most `count`; failures and duplicates never."""
    from evotune.records.best import finalists

    def rec(n, t, source, status="ok", dup=None):
        return {"number": n, "digest": f"d{n}", "source_digest": source, "duplicate_of": dup,
                "result": {"status": status, "time_us": t, "max_abs": 1e-4}}

    records = [rec(0, 100.0, "a"), rec(1, 95.0, "b"), rec(2, 104.0, "a"), rec(3, 104.4, "c"), rec(7, 104.6, "g"), rec(4, 80.0, "x",
               status="wrong"), rec(5, 96.0, "e", dup=1), rec(6, 99.0, "f")]
    assert [r["number"] for r in finalists(records, 6, 0.10)] == [1, 6, 0, 3]
    assert [r["number"] for r in finalists(records, 2, 0.10)] == [1, 6]
    assert [r["number"] for r in finalists(records, 6, 0.05)] == [1, 6]
    assert finalists(records, 0) == [] and finalists([rec(4, 80.0, "x", status="wrong")]) == []


def test_beside_skips_without_best_and_survives_worker_failure(attention, tiny, mission):
    run = beside_run("nobest", mission, tiny)
    ev = FakeEvaluator(tiny, attention.context(mission), status_for=lambda i, c: R.WRONG)
    search(attention, tiny, mission, run, ev, trials=2, sampler="exhaustive")
    call = FakeBeside()
    assert F.measure_beside_best(run, attention, mission, call)["status"] == "skipped" and not call.jobs

    run = beside_run("hangs", mission, tiny)
    search(attention, tiny, mission, run, FakeEvaluator(tiny, attention.context(mission)), trials=1,
           sampler="exhaustive")
    note = F.measure_beside_best(run, attention, mission, FakeBeside(fail=True))
    assert note["status"] == "failed" and "worker killed" in note["message"]
    assert not (run.path / "baselines.json").exists()


def test_worker_times_finalists_after_baselines_in_one_job(monkeypatch, mission):
    """The worker's "beside" job: measure_baselines, then evaluate_compiled of each finalist, then those that
    passed, interleaved, in one process."""
    import evotune.build.compile
    from evotune.gpu import bench, evaluate, plausibility, workers

    order = []
    monkeypatch.setattr(evaluate, "measure_baselines",
                        lambda problem, shape, names=None, seeds=(), reps=0: order.append(("base", reps)) or {"x": 1})
    monkeypatch.setattr(evaluate, "evaluate_compiled", lambda problem, shape, config, compiled, seeds=(), reps=0:
                        order.append(("kernel", reps, config.as_dict())) or
                        Result(status=R.OK if config["block_m"] == 64 else R.WRONG, time_us=3.0))
    monkeypatch.setattr(evaluate, "bind_kernel", lambda problem, shape, config, kernel: config["block_m"])
    monkeypatch.setattr(evotune.build.compile, "load_kernel", lambda compiled, smem: "module")
    monkeypatch.setattr(bench, "with_head_to_head", lambda raw, problem, shape, launches, reps, rounds, **kw:
                        order.append(("interleaved", reps, launches)) or {**raw, "head_to_head": {"timings": {}}})
    monkeypatch.setattr(plausibility, "FLOORS", plausibility.Floors(lambda dtype: {  # the worker's measured roofs
        "copy": {"gb_s": 3000.0}, "matmul": {"tflop_s": 700.0}, "empty_kernel": {"time_us": 1.0}}))
    monkeypatch.setattr(workers, "_compiled_from_dict", lambda d: d)
    monkeypatch.setattr(workers, "device_info", lambda: {"name": "fake"})
    monkeypatch.setattr(workers, "gpu_clocks", lambda: {"clocks": None})
    cfgs = [{"block_m": 64}, {"block_m": 128}]
    out = workers._handle({"kind": "beside", "family": "attention", "shape": mission.as_dict(), "configs": cfgs,
                           "compileds": [{}, {}], "labels": ["trial 3", "trial 5"], "reps": 11})
    assert order == [("base", 11), ("kernel", 11, cfgs[0]), ("kernel", 11, cfgs[1]),
                     ("interleaved", 11, {"trial 3": 64})]
    assert out["baselines"] == {"x": 1} and out["finalists"]["trial 3"]["time_us"] == 3.0
    assert out["finalists"]["trial 5"]["status"] == R.WRONG and out["device"]["name"] == "fake"
    assert out["head_to_head"] == {"timings": {}}
