"""The wall-clock figures the test suite used to assert, measured here instead (issue 38; house rule 11: speed is
measured by tools and reported in the docs, never asserted in a test). The tests keep the behaviour (the pruned walk
is taken, a cached compile does not run NVRTC, a dead holder's lock is free, a worker's timeout is its own); this
tool times the same operations on the CPU, no GPU needed:

    python tools/suite_timings.py                       # everything, once each
    python tools/suite_timings.py --only enumeration    # one measure (enumeration, compile, journal, worker)
    python tools/suite_timings.py --repeat 3 --json t.json

- enumeration: SearchSpace.admitted_configs of the full attention space on the mission shape and on a large causal
  bf16 d128 shape, and `evotune check`'s static_check.admitted_configs on the mission shape (the limits once asserted
  were 5 s and 10 s);
- compile: the default attention config compiled by NVRTC into an empty cache, then read back from it;
- journal: a process holding the run journal's lock is killed (SIGKILL); the seconds until the next append is done;
- worker: the real GPU worker on a machine without a GPU, from call() to NoGPUError; a hung stand-in worker with a
  1 s timeout, from evaluate() to its TIMEOUT result; a stand-in silent at start with a 1 s grace, to CRASHED.

Prints one line per figure (the median of --repeat runs, and the range); --json FILE writes every run's seconds.
Results go to docs/PERFORMANCE.md ("The test suite's timed operations").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "tests"))  # the worker stand-ins (tests/_fake_workers.py), importable by spawned children

MEASURES = ("enumeration", "compile", "journal", "worker")
CAUSAL_SHAPE = "4,32,4096,128:bf16:causal"


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def enumeration() -> dict[str, tuple[float, str]]:
    from evotune.problems.shapes import parse_shape
    from evotune.search import static_check
    from evotune.space.searchspace import load_builtin, shape_context

    space = load_builtin("attention")
    out = {}
    for label, shape in (("mission", "mission"), ("causal d128 bf16 S=4096", CAUSAL_SHAPE)):
        context = shape_context(parse_shape(shape))
        seconds, admitted = _timed(lambda: space.admitted_configs(context))
        out[f"enumerate full attention space, {label}"] = (seconds, f"{len(admitted)} admitted of {space.size()}")
    _, (admitted, _, seconds) = _timed(lambda: static_check.admitted_configs(space, shape_context(parse_shape("mission"))))
    out["evotune check's enumeration (static_check), mission"] = (seconds, f"{len(admitted)} admitted")
    return out


def compile_cache() -> dict[str, tuple[float, str]]:
    from evotune.build.compile import compile_source
    from evotune.build.template import instantiate
    from evotune.problems import get_problem
    from evotune.problems.shapes import parse_shape
    from evotune.space.searchspace import load_builtin

    problem = get_problem("attention")
    src = instantiate(problem, load_builtin("attention").default_config(), parse_shape("mission"))
    with tempfile.TemporaryDirectory() as cache:
        old = os.environ.get("EVOTUNE_CACHE")
        os.environ["EVOTUNE_CACHE"] = cache
        try:
            cold, first = _timed(lambda: compile_source(src.code, src.entry))
            warm, second = _timed(lambda: compile_source(src.code, src.entry))
        finally:
            if old is None:
                os.environ.pop("EVOTUNE_CACHE", None)
            else:
                os.environ["EVOTUNE_CACHE"] = old
    assert not first.cached and second.cached
    return {"compile default config, empty cache (NVRTC)": (cold, f"{first.resources.registers} registers"),
            "compile default config again (cache read)": (warm, "cached")}


def _hold_lock(path, ready):
    from evotune.records.journal import RunJournal

    with RunJournal(path)._locked():
        ready.set()
        time.sleep(600)


def journal() -> dict[str, tuple[float, str]]:
    import optuna
    from optuna.distributions import CategoricalDistribution

    from evotune.records.journal import journal_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "study.journal"
        study = optuna.create_study(study_name="evotune", storage=journal_storage(path), directions=["minimize"],
                                    sampler=optuna.samplers.RandomSampler(0))
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        holder = ctx.Process(target=_hold_lock, args=(path, ready))
        holder.start()
        assert ready.wait(120), "the lock holder did not start"
        start = time.perf_counter()
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(60)
        study.tell(study.ask({"x": CategoricalDistribution([1, 2])}), 1.0)
        seconds = time.perf_counter() - start
    return {"journal append after its lock holder is killed": (seconds, "from SIGKILL to the append done")}


def worker() -> dict[str, tuple[float, str]]:
    import _fake_workers as fake

    from evotune.errors import NoGPUError
    from evotune.gpu import workers
    from evotune.gpu.workers import GPUWorker

    out = {}
    w = GPUWorker(device=0, timeout_s=1.0)
    start = time.perf_counter()
    try:
        w.call({"kind": "info"})
        note = "a GPU answered (this figure is for machines without one)"
    except NoGPUError:
        note = "NoGPUError, as the worker reported"
    finally:
        w.close()
    out["real worker without a GPU, call() to its error"] = (time.perf_counter() - start, note)

    real_main, real_grace = workers._worker_main, workers.STARTUP_GRACE_S
    try:
        workers._worker_main = fake.hang_worker
        w = GPUWorker(device=0, timeout_s=1.0)
        seconds, res = _timed(lambda: w.evaluate({"kind": "evaluate"}))
        w.close()
        out["hung worker, 1 s timeout, evaluate() to TIMEOUT"] = (seconds, res.status)
        workers._worker_main, workers.STARTUP_GRACE_S = fake.slow_start_worker, 1.0
        w = GPUWorker(device=0, timeout_s=1.0)
        seconds, res = _timed(lambda: w.evaluate({"kind": "evaluate"}))
        w.close()
        out["silent worker, 1 s start grace, evaluate() to CRASHED"] = (seconds, res.status)
    finally:
        workers._worker_main, workers.STARTUP_GRACE_S = real_main, real_grace
    return out


FUNCTIONS = {"enumeration": enumeration, "compile": compile_cache, "journal": journal, "worker": worker}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=MEASURES, action="append", help="measure only this (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each measure (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write every run's seconds here")
    args = parser.parse_args(argv)
    runs: dict[str, list[float]] = {}
    notes: dict[str, str] = {}
    for name in args.only or MEASURES:
        for _ in range(max(1, args.repeat)):
            for label, (seconds, note) in FUNCTIONS[name]().items():
                runs.setdefault(label, []).append(seconds)
                notes[label] = note
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end"
    print(f"# {time.strftime('%Y-%m-%d')}  {machine}  (median of {max(1, args.repeat)}; range)")
    width = max(len(label) for label in runs)
    for label, seconds in runs.items():
        print(f"{label:<{width}}  {statistics.median(seconds):8.2f} s  "
              f"[{min(seconds):.2f}-{max(seconds):.2f}]  {notes[label]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": machine,
                                               "seconds": runs, "notes": notes}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
