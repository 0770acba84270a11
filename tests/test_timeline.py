"""Tests for evotune.timeline and the search loop's use of it: where a search's wall time goes, by phase."""

from __future__ import annotations

import json
import time

import pytest

from evotune.records.result import Result
from evotune.records.runs import new_run
from evotune.search.loop import SearchLoop, SearchOptions
from evotune.space.searchspace import load_space
from evotune.timeline import TIMELINE_FILE, Timeline, process_start
from test_search import TINY_SPACE as TWO_CONFIGS  # two configs: block_n 32 or 64

pytestmark = pytest.mark.usefixtures("runs_root")



def test_process_start_is_before_now():
    """The origin is this process's start (before this test ran), not the moment the timeline was made."""
    start = process_start()
    assert start <= time.time() and time.time() - start < 24 * 3600
    assert Timeline().since_start() > 0


def test_phases_add_up_and_count():
    """A phase run twice sums its seconds and counts 2; add() takes measured seconds; marks keep the first time."""
    tl = Timeline(origin=time.time())
    for _ in range(2):
        with tl.phase("compile wait"):
            time.sleep(0.01)
    tl.add("gpu: verify", 0.25, count=3)
    tl.mark("first result")
    first = tl.marks["first result"]
    tl.mark("first result")
    d = tl.as_dict()
    assert d["phases"]["compile wait"]["count"] == 2 and d["phases"]["compile wait"]["s"] >= 0.02
    assert d["phases"]["gpu: verify"] == {"s": 0.25, "count": 3}
    assert d["marks"]["first result"] == round(first, 3)


def test_line_nests_the_worker_phases_under_evaluate():
    """The one-line summary lists phases in order, puts `gpu: ...` ones after evaluate, and drops tiny ones."""
    d = {"wall_s": 18.24, "phases": {"start-up": {"s": 2.1, "count": 1}, "evaluate": {"s": 3.0, "count": 60},
                                     "gpu: verify": {"s": 1.2, "count": 60}, "tell": {"s": 0.01, "count": 60}}}
    assert Timeline.line_of(d) == "wall 18.2 s: start-up 2.1 s, evaluate 3.0 s x60 (gpu: verify 1.2 s x60)"


def test_append_to_keeps_one_line_per_invocation(tmp_path):
    """Each invocation appends a JSON line to timeline.jsonl (a resumed run keeps every one)."""
    for n in (1, 2):
        Timeline().append_to(tmp_path, command="search", evaluated=n)
    lines = [json.loads(x) for x in (tmp_path / TIMELINE_FILE).read_text().splitlines()]
    assert [x["evaluated"] for x in lines] == [1, 2] and all("phases" in x and "wall_s" in x for x in lines)


def test_the_loop_fills_its_phases(tmp_path, attention, mission):
    """A real (CPU) search with an injected evaluator records setup, ask, compile wait, evaluate, record, tell
    and the worker's own phases from each result; the status callback speaks before the first result."""
    problem, shape = attention, mission
    path = tmp_path / "two.yaml"
    path.write_text(TWO_CONFIGS)
    space = load_space(path)

    def evaluate(config, compiled):
        return Result(status="ok", time_us=10.0 + config["block_n"] / 64, max_abs=1e-4,
                      timing={"median_us": 10.0, "p10_us": 9.9, "p90_us": 10.1, "reps": 3},
                      extra={"eval_seconds": {"load": 0.001, "verify": 0.01, "time": 0.02}})

    said = []
    tl = Timeline()
    run = new_run("timeline-test", {"family": "attention", "shape": shape.as_dict()}, None)
    SearchLoop(problem, space, shape, run, evaluate, SearchOptions(trials=2, compile_workers=1), timeline=tl,
               on_status=said.append).run()
    phases = tl.as_dict()["phases"]
    for name in ("import optuna", "read the run", "enumerate the space", "open the study", "ask",
                 "instantiate and submit", "compile wait", "evaluate", "record", "tell"):
        assert name in phases, name
    assert phases["evaluate"]["count"] == 2 and phases["gpu: verify"] == {"s": 0.02, "count": 2}
    assert "first result" in tl.marks
    assert said and said[0].startswith("reading the run")


def test_the_worker_starts_beside_a_new_run(tmp_path):
    """A new run is created before the worker answers: the first evaluation waits for it and writes the device
    into meta.json; a worker that never starts leaves no empty run behind."""
    from concurrent.futures import Future

    from evotune.cli.search import _AfterWorker

    started: Future = Future()
    run = new_run("early", {"family": "attention", "shape": {}, "device": None}, None)
    calls = []
    evaluate = _AfterWorker(started, run, lambda config, compiled: calls.append(config) or "result", Timeline())
    started.set_result({"name": "NVIDIA H100 80GB HBM3"})
    assert evaluate("cfg", None) == "result" and calls == ["cfg"]
    assert run.meta()["device"] == {"name": "NVIDIA H100 80GB HBM3"}

    failed: Future = Future()
    doomed = new_run("no-worker", {"family": "attention", "shape": {}, "device": None}, None)
    failed.set_exception(RuntimeError("GPU worker could not start"))
    with pytest.raises(RuntimeError):
        _AfterWorker(failed, doomed, lambda c, k: None, Timeline())("cfg", None)
    assert not doomed.path.exists()


def test_the_loop_asks_while_the_gpu_measures(tmp_path, attention, mission, monkeypatch):
    """With an evaluator that starts evaluations, each candidate goes to the GPU before the next round of asks and
    its Result is taken after them; a plain callable evaluator is called in one piece."""
    path = tmp_path / "two.yaml"
    path.write_text(TWO_CONFIGS)
    space = load_space(path)
    events = []

    class Starting:
        def __call__(self, config, compiled):
            raise AssertionError("a starting evaluator is started, not called")

        def start(self, config, compiled):
            events.append("start")

            def finish():
                events.append("finish")
                return Result(status="ok", time_us=10.0 + config["block_n"] / 64, max_abs=1e-4,
                              timing={"median_us": 10.0, "p10_us": 9.9, "p90_us": 10.1, "reps": 3})
            return finish

    real_propose = SearchLoop.propose
    monkeypatch.setattr(SearchLoop, "propose", lambda self, room=0: (events.append("propose"), real_propose(self, room))[1])
    run = new_run("overlap", {"family": "attention", "shape": mission.as_dict()}, None)
    SearchLoop(attention, space, mission, run, Starting(), SearchOptions(trials=2, compile_workers=1)).run()
    assert events.count("start") == events.count("finish") == 2
    for i, e in enumerate(events):
        if e == "start":
            assert events[i + 1] == "propose" and events[i + 2] == "finish"
