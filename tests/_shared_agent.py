"""A search agent as its own process, for tests/test_shared_study.py: the real run_search on a shared run
and study, with an evaluator that needs no GPU.

It lives in its own importable module because the spawn start method pickles a process target by its
qualified name and the child imports it: keeping it out of the test module keeps the child's imports
small (no pytest). EVOTUNE_CACHE comes from the environment.
"""

from __future__ import annotations

import os
import time

from evotune.records import result as R
from evotune.records.result import Result


class LoggingEvaluator:
    """Appends `digest label pid` to a log as each call starts (one short O_APPEND write: lines from several
    processes never mix), sleeps, and answers OK with a time computed from the config alone."""

    def __init__(self, log_path: str, label: str, sleep_s: float):
        self.log_path, self.label, self.sleep_s = log_path, label, sleep_s

    def __call__(self, config, compiled) -> Result:
        with open(self.log_path, "a") as f:
            f.write(f"{config.digest()} {self.label} {os.getpid()} {time.time():.3f}\n")
        time.sleep(self.sleep_s)
        t = round(10.0 + config["block_m"] / 64 + config["block_n"] / 128 + config["stages"] / 8
                  + 0.25 * config["producer_warps"] + (0.5 if config["smem_layout"] == "pad" else 0.0)
                  + (0.0625 if not config["q_in_regs"] else 0.0) + 0.03125 * config["compute_warps"], 6)
        return Result(status=R.OK, time_us=t, max_abs=1e-4 * (1 + config["stages"]),
                      timing={"median_us": t, "p10_us": t, "p90_us": t, "reps": 1, "launches_per_rep": 1,
                              "method": "fake"})


def agent(space_path: str, run_path: str, storage: str | None, trials: int, sampler: str, seed: int, label: str,
          log_path: str, sleep_s: float, barrier=None, lookahead: int = 2) -> None:
    """Open the run, wait for the other agents (barrier), and search it; the summary goes to SUMMARY_DIR/label.json."""
    import json

    from evotune.problems import get_problem
    from evotune.records.runs import Run
    from evotune.search.loop import SearchOptions, run_search
    from evotune.problems.shapes import parse_shape
    from evotune.space.searchspace import load_space

    problem, shape, space = get_problem("attention"), parse_shape("mission"), load_space(space_path)
    run = Run(run_path, storage)
    options = SearchOptions(trials=trials, sampler=sampler, population=4, seed=seed, compile_workers=1,
                            lookahead=lookahead)
    if barrier is not None:
        barrier.wait(120)
    summary = run_search(problem, space, shape, run, LoggingEvaluator(log_path, label, sleep_s), options,
                         agent=label)
    out = os.path.join(os.path.dirname(log_path), f"summary-{label}.json")
    with open(out, "w") as f:
        json.dump(summary, f)


def cpu_evaluator(spec):
    """An evotune.search.agents evaluator factory: a LoggingEvaluator (log and sleep from EVOTUNE_TEST_EVAL_LOG and
    EVOTUNE_TEST_EVAL_SLEEP) in place of a GPU worker."""
    return LoggingEvaluator(os.environ["EVOTUNE_TEST_EVAL_LOG"], spec.label,
                            float(os.environ.get("EVOTUNE_TEST_EVAL_SLEEP", "0.2"))), (lambda: None)
