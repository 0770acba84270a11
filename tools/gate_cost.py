"""What the correctness gate costs per candidate (developer tool, GPU): for N configs of a space on a
shape, compile each (cached), then evaluate each in this process exactly as a search worker does
(evaluate.evaluate_compiled) and report the wall seconds of every phase it records in
Result.extra["eval_seconds"] (load, verify, and timed_check and time where the checkout has them),
mean and median per candidate, as JSON (--out) and a short table printed last.

It imports the evotune it finds (PYTHONPATH first), and uses only functions that older checkouts
have too, so the same command measures before and after a change of the gate:

    python tools/gate_cost.py --space attention --shape mission --n 20 --out after.json
    PYTHONPATH=/path/to/old/checkout python tools/gate_cost.py --same-configs after.json --out before.json

--same-configs evaluates exactly the configs (and shape, space, reps) of an earlier report, so two
checkouts are compared on the same candidates. The first candidate is evaluated once more, untimed,
before the measured ones, so CUDA, CuPy and torch start-up costs are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings

try:
    import evotune
except ImportError:  # not installed and not on PYTHONPATH: the checkout this tool sits in
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import evotune

from evotune.build.compile import CompileError, compile_source, launch_violations  # noqa: E402
from evotune.errors import EvotuneError  # noqa: E402
from evotune.gpu.evaluate import DEFAULT_REPS, evaluate_compiled  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.space.searchspace import load_builtin, load_space  # noqa: E402
from evotune.build.template import instantiate  # noqa: E402



def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--space", default="attention", help="a built-in space name or a space YAML file")
    ap.add_argument("--shape", default=None, help="the shape (default: the family's default shape)")
    ap.add_argument("--n", type=int, default=20, help="candidates to evaluate")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random choice of configs")
    ap.add_argument("--reps", type=int, default=DEFAULT_REPS, help="timed replays per candidate")
    ap.add_argument("--same-configs", default=None, help="an earlier report: evaluate exactly its configs")
    ap.add_argument("--out", required=True, help="where to write the JSON report")
    args = ap.parse_args(argv)
    if args.n < 1 or args.reps < 1:
        ap.error("--n and --reps must be at least 1")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        ap.error(f"--out: folder {out_dir} does not exist")
    return args


def load_any_space(text: str):
    return load_space(text) if text.endswith((".yaml", ".yml")) or os.sep in text else load_builtin(text)


def draw_configs(space, problem, shape, n: int, seed: int) -> list:
    """Up to `n` distinct admitted configs, a seeded sample of all the space admits on `shape`. The whole list is
    enumerated (attention.yaml on the mission shape: ~1 s): drawing knob by knob within a fixed budget came up
    short once knobs that few configs admit (epilogue) halved the admitted share of the raw space."""
    admitted = space.admitted_configs(problem.context(shape))
    return random.Random(seed).sample(admitted, min(n, len(admitted)))


def compile_candidates(problem, shape, configs, n: int) -> list:
    """(config, compiled) of the first `n` configs that compile and pass the static resource gate."""
    ready = []
    for config in configs:
        src = instantiate(problem, config, shape)
        try:
            compiled = compile_source(src.code, src.entry)
        except CompileError as e:
            print(f"skipped (does not compile): {config.key()}: {str(e).splitlines()[0]}", file=sys.stderr)
            continue
        geo = problem.geometry(config, shape)
        if launch_violations(compiled.resources, geo):
            continue
        ready.append((config, compiled))
        if len(ready) == n:
            break
    return ready


def evaluate_all(problem, shape, candidates, reps: int) -> list[dict]:
    """Evaluate every candidate once (after one unmeasured evaluation of the first); a record each."""
    config, compiled = candidates[0]
    evaluate_compiled(problem, shape, config, compiled, reps=reps)  # start-up costs land here, unmeasured
    records = []
    for i, (config, compiled) in enumerate(candidates):
        start = time.perf_counter()
        try:
            res = evaluate_compiled(problem, shape, config, compiled, reps=reps)
        except Exception as e:  # a CUDA fault poisons this process's context: stop with what was measured
            records.append({"config": config.as_dict(), "status": "raised", "message": f"{type(e).__name__}: {e}"})
            print(f"candidate {i} raised {type(e).__name__}; stopping", file=sys.stderr)
            break
        wall = time.perf_counter() - start
        records.append({"config": config.as_dict(), "status": res.status, "message": res.message,
                        "time_us": res.time_us, "eval_seconds": dict(res.extra.get("eval_seconds") or {}),
                        "wall_seconds": round(wall, 4)})
        print(f"{i + 1}/{len(candidates)} {res.status:<7} {wall:7.3f} s  {config.key()}", file=sys.stderr)
    return records


def summarize(records: list[dict]) -> dict:
    """Per phase (and the sum of phases, and the wall time around evaluate_compiled): mean, median, count."""
    measured = [r for r in records if "eval_seconds" in r]
    names = list(dict.fromkeys(name for r in measured for name in r["eval_seconds"]))
    columns = {name: [r["eval_seconds"][name] for r in measured if name in r["eval_seconds"]] for name in names}
    columns["total"] = [sum(r["eval_seconds"].values()) for r in measured]
    columns["wall"] = [r["wall_seconds"] for r in measured]
    phases = {name: {"mean": statistics.fmean(xs), "median": statistics.median(xs), "n": len(xs)}
              for name, xs in columns.items() if xs}
    statuses: dict[str, int] = {}
    for r in records:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {"phases": phases, "statuses": statuses}


def git_sha(path: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def table(report: dict) -> str:
    lines = [f"gate cost per candidate, seconds: {report['evaluated']} candidates of {report['space']} on "
             f"{report['shape']} ({report['device']}); evotune at {report['evotune']} ({report['git_sha']})",
             f"{'phase':<13}{'mean':>10}{'median':>10}{'n':>5}"]
    for name, s in report["summary"]["phases"].items():
        lines.append(f"{name:<13}{s['mean']:10.4f}{s['median']:10.4f}{s['n']:5d}")
    lines.append("statuses: " + ", ".join(f"{k} {v}" for k, v in report["summary"]["statuses"].items()))
    return "\n".join(lines)


def problem_space_shape(space_text: str, shape_text: str | None) -> tuple:
    space = load_any_space(space_text)
    problem = get_problem(space.family)
    shape = problem.parse_shape(shape_text or problem.default_shape)
    problem.check_shape(shape)
    return problem, space, shape


def choose(args) -> tuple:
    """(problem, shape, configs) from the arguments, or from --same-configs's earlier report."""
    if args.same_configs:
        with open(args.same_configs) as f:
            earlier = json.load(f)
        args.space, args.shape, args.reps, args.seed = earlier["space"], earlier["shape"], earlier["reps"], None
        problem, space, shape = problem_space_shape(args.space, args.shape)
        return problem, shape, [space.config(r["config"]) for r in earlier["candidates"]]
    problem, space, shape = problem_space_shape(args.space, args.shape)
    # Four draws per wanted candidate: some configs fail to compile or the static gate.
    return problem, shape, draw_configs(space, problem, shape, 4 * args.n, args.seed)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")  # the baselines' and CuPy's chatter
    args = parse_args(argv)
    try:
        problem, shape, configs = choose(args)
    except (EvotuneError, OSError, KeyError, ValueError) as e:
        print(f"gate_cost: error: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gate_cost: error: no CUDA GPU visible", file=sys.stderr)
        return 1
    candidates = compile_candidates(problem, shape, configs, len(configs) if args.same_configs else args.n)
    if not candidates:
        print("gate_cost: error: no config of the space compiles and passes the static gate on this shape",
              file=sys.stderr)
        return 1
    records = evaluate_all(problem, shape, candidates, args.reps)
    root = os.path.dirname(os.path.dirname(os.path.abspath(evotune.__file__)))
    report = {"evotune": root, "git_sha": git_sha(root), "device": torch.cuda.get_device_name(),
              "space": args.space, "shape": shape.spec, "reps": args.reps, "seed": args.seed,
              "evaluated": len(records), "summary": summarize(records), "candidates": records}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
