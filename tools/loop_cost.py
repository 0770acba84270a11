"""What the search loop itself costs per candidate, on a CPU: the real loop (evotune.search.loop.run_search) over a
real space, a real run folder and study storage, with the GPU and NVRTC replaced by instant stand-ins (a fixed
pseudo-random time per config, resources that pass the static gate). Every second it reports is the loop's own:
asks (the sampler and the storage), tells, records.

    python tools/loop_cost.py                                  # surrogate, 300 trials, full attention space, journal
    python tools/loop_cost.py --storage sqlite --trials 60     # the SQLite study of runs made before the journal
    python tools/loop_cost.py --sampler nsga2 --space search_spaces/attention-small.yaml

Prints the wall time and each phase's total and mean (ms); --json FILE writes them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evotune.build.compile import Compiled, Resources  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.records import result as R  # noqa: E402
from evotune.records.result import Result  # noqa: E402
from evotune.records.runs import Run  # noqa: E402
from evotune.search.loop import SAMPLERS, SearchOptions, run_search  # noqa: E402
from evotune.space.searchspace import load_space  # noqa: E402
from evotune.timeline import Timeline  # noqa: E402


def stand_in_time(config) -> float:
    """A fixed time per config (5-15 us), so samplers see a landscape with no structure to exploit."""
    return 5.0 + int(hashlib.sha1(config.digest().encode()).hexdigest()[:8], 16) % 1000 / 100.0


class InstantGPU:
    """A starting evaluator (loop.StartsEvaluations) that answers at once."""

    def __call__(self, config, compiled) -> Result:
        return self.start(config, compiled)()

    def start(self, config, compiled):
        t = stand_in_time(config)
        return lambda: Result(status=R.OK, time_us=t, max_abs=1e-4)


def instant_compiler(config, source) -> Compiled:
    return Compiled(key=config.digest(), entry=source.entry, arch="stand-in", cubin_path="", options=(), log="",
                    resources=Resources(64, 0, 0, 0, 0, 1), compile_seconds=0.0, cached=True)


def measure(sampler: str, trials: int, storage: str, space_path: Path, shape_text: str, seed: int = 1) -> dict:
    os.environ["EVOTUNE_RUNS"] = tempfile.mkdtemp(prefix="loop-cost-")
    problem = get_problem("attention")
    shape = problem.parse_shape(shape_text)
    space = load_space(space_path, tuple(problem.context(shape)))
    run = Run.create("loop-cost", {"shape_spec": shape_text, "family": "attention", "space": str(space_path)})
    if storage == "sqlite":
        (run.path / "study.db").touch()  # a run folder made before the journal: Run opens its SQLite study
    timeline = Timeline()
    options = SearchOptions(trials=trials, sampler=sampler, seed=seed, compile_workers=16)
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's experimental-feature warnings
        summary = run_search(problem, space, shape, run, InstantGPU(), options, compiler=instant_compiler,
                             timeline=timeline)
    wall = time.perf_counter() - started
    phases = {name: {"s": round(s, 4), "count": n, "mean_ms": round(s / n * 1e3, 2)}
              for name, (s, n) in timeline.phases.items()}
    return {"sampler": sampler, "trials": trials, "storage": storage, "space": str(space_path), "shape": shape_text,
            "wall_s": round(wall, 3), "evaluated": summary["evaluated"], "lookahead": summary["lookahead"],
            "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sampler", default=SearchOptions.sampler, choices=SAMPLERS)
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--storage", default="journal", choices=("journal", "sqlite"))
    ap.add_argument("--space", type=Path, default=Path("search_spaces/attention.yaml"))
    ap.add_argument("--shape", default="mission")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = measure(args.sampler, args.trials, args.storage, args.space, args.shape)
    if args.json:  # first: a reader that stops early (| head) must not lose the record
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{out['sampler']} x{out['evaluated']} on {out['storage']}: {out['wall_s']:.2f} s "
          f"({out['wall_s'] / max(1, out['evaluated']) * 1e3:.1f} ms per candidate), lookahead {out['lookahead']}")
    for name, p in out["phases"].items():
        print(f"  {name:28s} {p['s']:8.3f} s  x{p['count']:<4d} {p['mean_ms']:8.1f} ms")


if __name__ == "__main__":
    main()
