"""Does the search transfer? A CPU replay over the committed exhaustive runs, each shape held out of the priors.

    python docs/data/heldout/transfer_replay.py [--budget 60] [--seeds 10] [--out FILE.json]

For each exhaustive run (runs/*exhaustive*: every admitted config of its space measured on the H100), the shipped
priors minus every entry measured on that run's shape (sizes, K/V heads and mask; any dtype), so the oracle's shape is
one the priors never saw, as in the held-out benchmark. Then the default strategy (strategies.SurrogateSampler, driven
one ask and one tell at a time, Optuna's enqueue for the configs asked first, as the loop does) over the run's
recorded configs, its times answered from the run's records (a config that failed the gate there fails here):
  none       no priors (evotune before issue 40)
  priors     the priors asked first (warmstart.prior_configs, up to 8), no prior mean (issue 40 part 1)
  transfer   the priors asked first and the surrogate's prior mean (warmstart.knob_prior; the default now)
  mean-only  the prior mean without asking the priors first
Per variant and run: over seeds, the median and worst best-after-budget against the run's optimum, and the median
number of evaluations to come within 3% of it (budget+1 where not within). A table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

VARIANTS = ("none", "priors", "transfer", "mean-only")


def oracle(run_dir: Path):
    from evotune.problems import get_problem
    from evotune.problems.shapes import Shape
    from evotune.records import result as R
    from evotune.records.runs import Run
    from evotune.space.searchspace import load_space

    run = Run(run_dir)
    meta = run.meta()
    problem = get_problem("attention")
    shape = Shape.from_dict(meta["shape"])
    space = load_space(str(ROOT / meta["space"]))
    times, configs = {}, []
    for r in run.trials():
        try:
            config = space.config(r["config"])
        except Exception:  # noqa: BLE001 - a config of a knob set the space no longer has
            continue
        if config.digest() in times:
            continue
        ok = (r.get("result") or {}).get("status") == R.OK
        times[config.digest()] = r["result"]["time_us"] if ok else None
        configs.append(config)
    return problem, shape, space, configs, times


def held_out_priors(shape, path: Path) -> Path:
    """The packaged priors without the entries measured on `shape`'s sizes, K/V heads and mask."""
    from evotune.problems.shapes import Shape
    from evotune.records.priors import dump_priors, load_priors

    def dims(s):
        return (s.batch, s.heads, s.seq_q, s.seq_k, s.head_dim, s.kv_heads, s.causal)

    doc = load_priors()
    doc["entries"] = [e for e in doc["entries"] if dims(Shape.from_dict(e["shape"])) != dims(shape)]
    path.write_text(dump_priors(doc))
    return path


def replay(problem, shape, space, configs, times, priors_path, variant: str, seed: int, budget: int) -> list:
    import optuna

    from evotune.search import loop as S
    from evotune.search.strategies import SurrogateSampler
    from evotune.search.warmstart import knob_prior, prior_configs

    context = problem.context(shape)
    mean = knob_prior(problem, shape, space, path=priors_path) if variant in ("transfer", "mean-only") else {}
    firsts = prior_configs(problem, shape, space, context, path=priors_path)[0] if variant in ("priors", "transfer") \
        else []
    known = {c.digest() for c in configs}
    taken: set = set()
    sampler = SurrogateSampler(configs, S.distributions(space), lambda d: d in taken, seed=seed, prior_mean=mean)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)
    for d in firsts:
        if space.config(d).digest() in known:
            study.enqueue_trial(d)
    dists = S.distributions(space)
    out = []
    for _ in range(budget):
        trial = study.ask(dists)
        config = space.config(trial.params)
        digest = config.digest()
        taken.add(digest)
        t = times.get(digest)
        if t is None:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, [t, 1e-3])
        out.append(t)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--runs", default=None, help="comma list of run names (default: every runs/*exhaustive*)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.budget < 1 or args.seeds < 1:
        print("transfer_replay: --budget and --seeds must be at least 1", file=sys.stderr)
        return 2
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    names = args.runs.split(",") if args.runs else sorted(p.parent.name
                                                          for p in (ROOT / "runs").glob("*exhaustive*/meta.json"))
    rows, data = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            problem, shape, space, configs, times = oracle(ROOT / "runs" / name)
            best = min(t for t in times.values() if t is not None)
            priors_path = held_out_priors(shape, Path(tmp) / f"{name}.json")
            for variant in VARIANTS:
                finals, reach = [], []
                for seed in range(args.seeds):
                    got = replay(problem, shape, space, configs, times, priors_path, variant, seed, args.budget)
                    running, first = None, args.budget + 1
                    for i, t in enumerate(got):
                        if t is not None and (running is None or t < running):
                            running = t
                        if running is not None and running <= 1.03 * best and first > args.budget:
                            first = i + 1
                    finals.append((running or float("inf")) / best - 1)
                    reach.append(first)
                data.setdefault(name, {})[variant] = {"best_after_budget_vs_optimum": finals, "evals_to_3pct": reach}
                rows.append((name, len(configs), variant, statistics.median(finals), max(finals),
                             statistics.median(reach), sum(r <= args.budget for r in reach)))
                print(f"{name} {variant}: median +{statistics.median(finals) * 100:.1f}%", file=sys.stderr, flush=True)
    if args.out:
        record = {"budget": args.budget, "seeds": args.seeds, "runs": data}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'run':<42}{'configs':>8}  {'variant':<10}{'median best':>12}{'worst':>8}{'evals to 3%':>12}{'within':>8}")
    for name, n, variant, med, worst, reach, within in rows:
        print(f"{name:<42}{n:>8}  {variant:<10}{med * 100:>+11.1f}%{worst * 100:>+7.1f}%{reach:>12g}"
              f"{within:>5}/{args.seeds}")
    for variant in VARIANTS:
        mine = [r for r in rows if r[2] == variant]
        print(f"{variant}: searches within 3% after {args.budget}: {sum(r[6] for r in mine)}/{len(mine) * args.seeds}; "
              f"mean over runs of the median best {statistics.mean(r[3] for r in mine) * 100:+.2f}%, "
              f"of the worst {statistics.mean(r[4] for r in mine) * 100:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
