"""The search loop: an Optuna study (NSGA-II by default: population, crossover, mutation)
over a SearchSpace, minimising (GPU time, max error). Every proposal becomes a recorded
trial: pruned by the space's constraints, failed to compile, pruned by the static
resource gate, faulted, hung, wrong, or measured. Nothing a candidate does ends the search.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from . import result as R
from .compile import CompileError, compile_source, static_violations
from .errors import UsageError
from .result import Result
from .runs import Run, best_record
from .template import instantiate

SAMPLERS = ("nsga2", "tpe", "random")


class Evaluator(Protocol):
    def __call__(self, config, compiled) -> Result: ...


@dataclass(frozen=True)
class SearchOptions:
    trials: int = 60                 # candidates to compile and evaluate (constraint-pruned proposals don't count)
    sampler: str = "nsga2"
    population: int = 16
    seed: int = 0
    max_proposals_factor: int = 30   # stop after trials * this many proposals, whatever they were


def make_sampler(name: str, population: int, seed: int):
    import optuna

    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=population, seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise UsageError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


def distributions(space):
    import optuna

    return {p.name: optuna.distributions.CategoricalDistribution(list(p.values)) for p in space.params}


def run_search(problem, space, shape, run: Run, evaluate: Evaluator, options: SearchOptions,
               on_trial: Callable[[dict, dict | None], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> dict:
    """Run (or continue) the search recorded in `run`; return a summary dict."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    context = problem.context(shape)
    study = optuna.create_study(study_name="evotune", storage=run.storage_url, load_if_exists=True,
                                directions=["minimize", "minimize"],
                                sampler=make_sampler(options.sampler, options.population, options.seed))
    # Trials left RUNNING by a killed process are lost work: close them as failed.
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)

    records = run.trials()
    by_digest = {r["digest"]: r for r in records if r.get("duplicate_of") is None}
    evaluated = sum(1 for r in records if r.get("counted"))
    proposals = 0
    dists = distributions(space)
    # Once every admitted config has a record there is nothing left to learn.
    admitted_total = len(space.admitted_configs(context))
    admitted_seen = {r["digest"] for r in records if r.get("counted")}
    started = time.time()

    while (evaluated < options.trials and len(admitted_seen) < admitted_total
           and proposals < options.trials * options.max_proposals_factor):
        if should_stop is not None and should_stop():
            break
        proposals += 1
        trial = study.ask(dists)
        config = space.config(trial.params)
        record = {"number": trial.number, "config": config.as_dict(), "digest": config.digest(),
                  "started": time.time()}
        prior = by_digest.get(config.digest())
        if prior is not None:
            # A repeated proposal is answered from the record, never measured twice.
            res = Result.from_dict(prior["result"])
            record.update(duplicate_of=prior["number"], counted=False)
        else:
            res, counted, source_digest = _evaluate_one(problem, space, shape, context, config, evaluate)
            record.update(counted=counted, source_digest=source_digest)
            evaluated += int(counted)
            if counted:
                admitted_seen.add(record["digest"])
        if res.ok:
            study.tell(trial, [res.time_us, res.max_abs])
        else:
            study.tell(trial, state=TrialState.PRUNED if res.status == R.PRUNED else TrialState.FAIL)
        record["result"] = res.as_dict()
        record["finished"] = time.time()
        run.append_trial(record)
        if prior is None:
            by_digest[record["digest"]] = record
        best = run.update_summary()
        if on_trial is not None:
            on_trial(record, best)

    records = run.trials()
    best = best_record(records)
    counts: dict[str, int] = {}
    for r in records:
        if r.get("duplicate_of") is None:
            counts[r["result"]["status"]] = counts.get(r["result"]["status"], 0) + 1
    return {"run_id": run.run_id, "evaluated": evaluated, "proposals": proposals, "statuses": counts,
            "seconds": time.time() - started, "best": best}


def _evaluate_one(problem, space, shape, context, config, evaluate: Evaluator) -> tuple[Result, bool, str | None]:
    """(result, whether it spent compile or GPU time, source digest) for one new configuration."""
    why = space.violations(config, context)
    if why:
        return Result(status=R.PRUNED, message="constraint: " + "; ".join(why)), False, None
    src = instantiate(problem, config, shape)
    try:
        compiled = compile_source(src.code, src.entry)
    except CompileError as e:
        return Result(status=R.COMPILE_ERROR, message=str(e)), True, src.digest
    geo = problem.geometry(config, shape)
    static = static_violations(compiled.resources, geo.threads, geo.dynamic_smem)
    if static:
        return Result(status=R.PRUNED, message="static: " + "; ".join(static),
                      resources=compiled.resources.as_dict(), compile_seconds=compiled.compile_seconds), True, src.digest
    res = evaluate(config, compiled)
    if res.resources is None:
        res = Result(**{**res.__dict__, "resources": compiled.resources.as_dict(),
                        "compile_seconds": compiled.compile_seconds})
    return res, True, src.digest


def worker_evaluator(worker, problem, shape, seeds=(1, 2, 3), reps: int = 40) -> Evaluator:
    """Evaluate candidates in a GPUWorker process (the search process never touches the GPU)."""
    from .workers import compiled_to_dict

    def evaluate(config, compiled) -> Result:
        return worker.evaluate({"kind": "evaluate", "family": problem.family, "shape": shape.as_dict(),
                                "config": config.as_dict(), "compiled": compiled_to_dict(compiled),
                                "seeds": list(seeds), "reps": reps})

    return evaluate
