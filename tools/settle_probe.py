"""How long each interleaved turn must settle before it is timed (developer tool, GPU).

    python3 tools/settle_probe.py --run llama-4k-h100-warm-lean [--settle-us 0,20000,50000] [--repeats 2]
    python3 tools/settle_probe.py --shape llama-4k --config '{"block_m":128,...}'

The large shapes run at the H100's power limit, so the clock a contender gets depends on what ran just
before it: in the search's closing jobs (one settling replay, ~2 ms, per turn) a turn that followed the
EFFICIENT backend ran 4-7% faster than its contender's median. This tool times the run's best (or the
config) and every available SDPA backend interleaved (interleave.head_to_head, as `evotune bench` does)
once per settle length, the lengths in turn `--repeats` times, and prints per length: our median, CUDNN's,
CUDNN/ours over rounds (median, min-max) and the predecessor effect (interleave.predecessor_effect: how
much faster than its median a turn runs after each contender; 1.000 is no effect). settle 0 is one
settling replay, the default (interleave.SETTLE_US says why, with what this tool measured on the H100).
$OUT/settle_probe.json keeps every head-to-head.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", help="a run whose best to time (its shape and config)")
    p.add_argument("--shape", help="a shape (with --config)")
    p.add_argument("--config", help="a config as JSON (with --shape)")
    p.add_argument("--settle-us", default="0,20000,50000", help="settle lengths to compare, comma-separated us")
    p.add_argument("--repeats", type=int, default=2, help="times each length is measured, lengths in turn")
    p.add_argument("--reps", type=int, default=100, help="timed replays per contender and head-to-head")
    args = p.parse_args(argv)
    if bool(args.run) == bool(args.shape and args.config):
        p.error("give --run, or --shape with --config")
    try:
        args.settle = [float(x) for x in args.settle_us.split(",") if x.strip()]
    except ValueError:
        p.error(f"--settle-us takes comma-separated numbers, not {args.settle_us!r}")
    if not args.settle or min(args.settle) < 0 or args.repeats < 1:
        p.error("--settle-us needs non-negative lengths and --repeats at least 1")
    return args


def summary_line(settle_us: float, h2h: dict) -> str:
    """One printed row of a head-to-head (Interleaved.as_dict() with "vs_cudnn" added)."""
    t = h2h["timings"]
    ours, cudnn = t.get("evotune", {}).get("median_us"), t.get("cudnn", {}).get("median_us")
    vs = h2h.get("vs_cudnn")
    effect = h2h.get("predecessor_effect") or {}
    worst = max(effect.items(), key=lambda kv: abs(kv[1] - 1.0)) if effect else ("-", 1.0)
    ratio = f"{vs['median']:.3f} ({vs['min']:.3f}-{vs['max']:.3f})" if vs else "-"
    return (f"settle {settle_us:8.0f} us  rounds {h2h['rounds']:2d}  ours {ours or 0:9.2f}  cudnn {cudnn or 0:9.2f}  "
            f"cudnn/ours {ratio}  largest predecessor effect: after {worst[0]} {worst[1]:.3f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    from evotune.build.compile import compile_source, load_kernel
    from evotune.build.template import instantiate
    from evotune.gpu.evaluate import bind_kernel, evaluate_compiled, measure_baselines
    from evotune.gpu.interleave import DEFAULT_ROUNDS, head_to_head, split_reps, time_interleaved
    from evotune.gpu.workers import device_info
    from evotune.problems import get_problem
    from evotune.problems.shapes import parse_shape
    from evotune.records.runs import Run
    from evotune.space.searchspace import Config

    if args.run:
        run = Run.open(args.run)
        problem, shape = run.problem_and_shape()
        config = Config.from_dict(run.best()["config"])
    else:
        problem, shape = get_problem("attention"), parse_shape(args.shape)
        config = Config.from_dict(json.loads(args.config))
    src = instantiate(problem, config, shape)
    compiled = compile_source(src.code, src.entry)
    res = evaluate_compiled(problem, shape, config, compiled)
    if not res.ok:
        raise SystemExit(f"the kernel did not pass the gate: {res.status}: {res.message}")
    launch_for = bind_kernel(problem, shape, config, load_kernel(compiled, problem.geometry(config, shape).dynamic_smem))
    base = measure_baselines(problem, shape)
    available = [n for n, b in base.items() if b.get("available")]
    results, lines = [], []
    for repeat in range(args.repeats):
        for settle_us in args.settle:
            timer = functools.partial(time_interleaved, settle_us=settle_us)
            result, failures = head_to_head(problem, shape, {"evotune": launch_for}, available, DEFAULT_ROUNDS,
                                            split_reps(args.reps), timer)
            if failures or result is None:
                raise SystemExit(f"head-to-head at settle {settle_us} us: {failures or 'nothing timed'}")
            h2h = result.as_dict()
            if "cudnn" in result.timings:
                h2h["vs_cudnn"] = result.ratios("evotune", "cudnn")
            results.append({"repeat": repeat, "settle_us": settle_us, "head_to_head": h2h})
            lines.append(summary_line(settle_us, h2h))
            print(lines[-1], flush=True)
    record = {"date": dt.date.today().isoformat(), "device": device_info(), "shape": shape.spec,
              "config": config.as_dict(), "run": args.run, "baselines": base, "results": results,
              "command": "python3 tools/settle_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "settle_probe.json"), "w") as f:
        json.dump(record, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
