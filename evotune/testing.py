"""Checking a kernel family without a GPU: what evotune's own tests use, for a family of your own.

    from evotune import testing
    problem = testing.on_cpu(get_problem("my_family.yaml"))        # inputs made on the CPU
    check = testing.gate_on_cpu(problem, problem.parse_shape("M=64,N=32:fp16"))
    assert check.passed                                               # the reference, launched as if a kernel

    summary = testing.search_on_cpu(problem, shape, testing.ModelEvaluator(cost), trials=4)

The gate (gpu/evaluate.py) is device-agnostic: on the CPU a Python function stands in for the kernel launch, so
a family's inputs, outputs, reference, tolerance and dependency check are all exercised, and a launch that is
wrong (tests pass `launch_for` of their own) fails the same checks a kernel would. The search loop runs with
real NVRTC compiles of the family's template and an injected evaluator (a cost model in place of the GPU worker):
what a search records, prunes and picks is tested without timing anything.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

from .gpu import evaluate as E
from .records import result as R
from .records.result import Result, Timing


def on_cpu(problem):
    """A copy of `problem` whose inputs are made on the CPU (the gate asks make_inputs for no device)."""
    base = type(problem)

    class OnCPU(base):
        def make_inputs(self, shape, seed, device="cpu", pattern="normal"):
            return base.make_inputs(self, shape, seed, device="cpu", pattern=pattern)

    OnCPU.__name__ = OnCPU.__qualname__ = f"OnCPU{base.__name__}"
    cpu = copy.copy(problem)
    cpu.__class__ = OnCPU
    return cpu


def reference_launch(problem, shape) -> Callable:
    """`launch_for(inputs, out)` of a stand-in kernel that writes the family's reference into O (each named output),
    rounded to O's dtype: the launch every honest kernel is compared with."""

    def launch_for(inputs, out):
        def launch():
            E.copy_output(out, problem.reference(shape, inputs))

        return launch

    return launch_for


def gate_on_cpu(problem, shape, launch_for: Callable | None = None, seeds=E.DEFAULT_SEEDS):
    """The correctness gate (evaluate.verify: errors, repeats, guard bands, inputs intact, the dependency check) of
    `launch_for` (default: reference_launch) on CPU tensors: its Verification."""
    launch_for = launch_for or reference_launch(problem, shape)

    def run_into(inputs, out):
        launch_for(inputs, out)()

    return E.verify(problem, shape, run_into, seeds)


def cpu_timer(launch, reps: int):
    """A `timer` for evaluate.check_timed on the CPU: a few launches, the replay the audit reruns, and their wall
    time on this CPU (method "cpu-wall": a figure of the Python stand-in, never of a kernel)."""
    for _ in range(2):
        launch()

    def replay():
        for _ in range(2):
            launch()

    samples = []
    for _ in range(max(1, min(reps, 3))):
        start = time.perf_counter()
        replay()
        samples.append((time.perf_counter() - start) * 1e6 / 2)
    samples.sort()
    return Timing(median_us=samples[len(samples) // 2], p10_us=samples[0], p90_us=samples[-1], reps=len(samples),
                  launches_per_rep=2, method="cpu-wall"), replay


def evaluate_on_cpu(problem, shape, launch_for: Callable | None = None, seeds=E.DEFAULT_SEEDS) -> Result:
    """The whole evaluation a candidate gets (the gate, then the timed launches' checks and audit) on the CPU, timed
    by cpu_timer: a Result, WRONG naming the failed check where one fails."""
    return E.evaluate_launches(problem, shape, launch_for or reference_launch(problem, shape), seeds,
                               timer=cpu_timer)


class ModelEvaluator:
    """An evaluator for the search loop in place of the GPU worker: each compiled config's time is `cost(config)`
    (a model the test chooses), recorded as method "model". `calls` lists the configs evaluated, in order."""

    def __init__(self, cost: Callable[[dict], float]):
        self.cost = cost
        self.calls: list[dict] = []

    def __call__(self, config, compiled) -> Result:
        self.calls.append(config.as_dict())
        t = float(self.cost(config.as_dict()))
        return Result(status=R.OK, time_us=t, max_abs=0.0,
                      timing={"median_us": t, "p10_us": t, "p90_us": t, "reps": 1, "launches_per_rep": 1,
                              "method": "model"},
                      verification={"max_abs": 0.0, "gate_ratio": 0.0, "atol": 0.0, "rtol": 0.0, "seeds": [1]})


def search_on_cpu(problem, shape, evaluate, trials: int = 4, space=None, run_name: str | None = None,
                  sampler: str = "random", seed: int = 0, lookahead: int = 0) -> dict:
    """A search of `problem` on `shape` with real NVRTC compiles and the injected `evaluate` (ModelEvaluator), into a
    new run (under EVOTUNE_RUNS): the search's summary, with "run" its folder. `lookahead` 0 (the default) compiles
    in this process, one proposal at a time (no compile pool to start: a test's few trials cost their compiles)."""
    from .records.runs import Run
    from .search.loop import SearchOptions, run_search

    space = space or problem.load_space(tuple(problem.context(shape)))
    run = Run.create(run_name, {"family": problem.family, "shape": shape.as_dict(), "shape_spec": shape.spec,
                                "space": space.path})
    options = SearchOptions(trials=trials, sampler=sampler, population=4, seed=seed, lookahead=lookahead)
    return {**run_search(problem, space, shape, run, evaluate, options), "run": str(run.path)}
