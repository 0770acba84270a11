"""A search run as its own process, for tests/test_resume_kill.py to kill with SIGKILL.

    python tests/_search_child.py SPACE_YAML RUN_NAME TRIALS DIGEST_LOG SLEEP_S

Runs run_search (random sampler, seed 0, compile-ahead on) on the mission shape with a
SlowEvaluator in place of the GPU worker; EVOTUNE_RUNS and EVOTUNE_CACHE come from the
environment. The test imports SlowEvaluator too, so the resumed search logs the same way.
"""

from __future__ import annotations

import os
import sys
import time

from evotune.records import result as R
from evotune.records.result import Result


class SlowEvaluator:
    """Appends `digest pid` to a log as each call starts, sleeps, and answers OK with a time
    computed from the config: the log shows every evaluation any process began."""

    def __init__(self, log_path: str, sleep_s: float):
        self.log_path, self.sleep_s = log_path, sleep_s

    def __call__(self, config, compiled) -> Result:
        with open(self.log_path, "a") as f:  # one short O_APPEND write: lines from two processes never mix
            f.write(f"{config.digest()} {os.getpid()}\n")
        time.sleep(self.sleep_s)
        t = 10.0 + config["block_m"] / 64 + config["block_n"] / 128 + config["stages"] / 8
        return Result(status=R.OK, time_us=t, max_abs=1e-4,
                      timing={"median_us": t, "p10_us": t, "p90_us": t, "reps": 1, "launches_per_rep": 1,
                              "method": "fake"})


def options(trials: int):
    from evotune.search.loop import SearchOptions

    return SearchOptions(trials=trials, sampler="random", seed=0, compile_workers=2, lookahead=3)


def main(space_path: str, run_name: str, trials: str, log_path: str, sleep_s: str) -> None:
    from evotune.problems import get_problem
    from evotune.records.runs import Run
    from evotune.search.loop import run_search
    from evotune.problems.shapes import parse_shape
    from evotune.space.searchspace import load_space

    problem, shape = get_problem("attention"), parse_shape("mission")
    run = Run.create(run_name, {"shape_spec": shape.spec})
    run_search(problem, load_space(space_path), shape, run, SlowEvaluator(log_path, float(sleep_s)),
               options(int(trials)))


if __name__ == "__main__":  # the compile pool's spawned processes import this file too
    main(*sys.argv[1:])
