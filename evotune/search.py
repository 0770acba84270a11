"""The search loop: an Optuna study (NSGA-II by default: population, crossover, mutation)
over a SearchSpace, minimising (GPU time, max error). Every proposal becomes a recorded
trial: pruned by the space's constraints, failed to compile, pruned by the static
resource gate, faulted, hung, wrong, or measured. Nothing a candidate does ends the search.

Strategies: every name in SAMPLERS is an Optuna sampler behind the same ask/tell loop;
"exhaustive" is evotune's own (strategies.py): each admitted config once, in the space's order.

Compile ahead: while the GPU measures one candidate, the loop keeps up to `lookahead` more
proposals asked and compiles the new ones in a process pool. Results are still told and
recorded strictly in ask order, so the records are what a serial search would write.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import BrokenExecutor, Future
from dataclasses import dataclass
from typing import Callable, Protocol

from . import compile as compile_module  # the pool submits compile_module.compile_source (picklable by name)
from . import result as R
from .compile import CompileError, compile_pool, compile_source, static_violations
from .errors import UsageError
from .result import Result
from .runs import Run, best_record
from .space import Config
from .template import KernelSource, instantiate

SAMPLERS = ("nsga2", "tpe", "random", "exhaustive")


class Evaluator(Protocol):
    def __call__(self, config, compiled) -> Result: ...


@dataclass(frozen=True)
class SearchOptions:
    trials: int = 60                 # candidates to compile and evaluate (constraint-pruned proposals don't count)
    sampler: str = "nsga2"
    population: int = 16
    seed: int = 0
    max_proposals_factor: int = 30   # stop after trials * this many proposals, whatever they were
    compile_workers: int | None = None  # compile processes; None: os.cpu_count()
    lookahead: int | None = None        # proposals asked ahead of the one being evaluated; None: 2 x compile_workers;
                                        # 0: serial (ask, compile in this process, evaluate, tell), no pool

    def __post_init__(self):
        workers = self.compile_workers if self.compile_workers is not None else (os.cpu_count() or 1)
        lookahead = self.lookahead if self.lookahead is not None else 2 * workers
        if self.lookahead is None and self.sampler == "nsga2":
            # NSGA-II breeds a generation only from completed trials: proposals asked further
            # ahead than one population are all drawn from the previous (or the random first) one.
            lookahead = min(lookahead, self.population)
        if workers < 1:
            raise UsageError(f"compile workers must be at least 1, not {workers}")
        if lookahead < 0:
            raise UsageError(f"lookahead must be 0 (serial) or more, not {lookahead}")
        object.__setattr__(self, "compile_workers", workers)
        object.__setattr__(self, "lookahead", lookahead)


def make_sampler(name: str, population: int, seed: int, *, space=None, admitted: list[Config] | None = None,
                 taken: Callable[[str], bool] | None = None):
    """The Optuna sampler for a SAMPLERS name; "exhaustive" needs the space, its admitted configs (in the
    order to visit them) and `taken(digest)`, true for configs already recorded or in flight."""
    import optuna

    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(population_size=population, seed=seed)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "exhaustive":
        from .strategies import ExhaustiveSampler

        if space is None or admitted is None:
            raise ValueError("the exhaustive sampler needs the space and its admitted configs")
        return ExhaustiveSampler(admitted, distributions(space), taken if taken is not None else (lambda digest: False))
    raise UsageError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


def distributions(space):
    import optuna

    return {p.name: optuna.distributions.CategoricalDistribution(list(p.values)) for p in space.params}


@dataclass
class _Pending:
    """A proposal asked from the study and not yet recorded."""

    trial: object                       # optuna.trial.Trial
    config: Config
    asked: float
    why: list[str]                      # constraint violations; empty when admitted
    source: KernelSource | None = None  # set on the first queued occurrence of a config with no record
    future: Future | None = None        # its compile in the pool (None: compile when its turn comes)
    told: bool = False


def run_search(problem, space, shape, run: Run, evaluate: Evaluator, options: SearchOptions,
               on_trial: Callable[[dict, dict | None], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> dict:
    """Run (or continue) the search recorded in `run`; return a summary dict.

    Proposals are told and recorded strictly in ask order; "proposals" in the summary counts
    the recorded ones. should_stop is asked before each round of proposals and before each
    evaluation. When it says stop, or an exception (KeyboardInterrupt included) ends the loop,
    the trials asked but not yet recorded are told FAIL and get no record ("abandoned" in the
    summary), so the study holds no RUNNING trial; a kill -9 leaves them RUNNING and the next
    run_search on the run closes them as FAIL. Having no record, their configs are not taken:
    a resume may propose them again. The compile pool is shut down on every way out (queued
    compiles cancelled, running ones finished: their cubins land in the cache for the resume).
    """
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    context = problem.context(shape)
    records = run.trials()
    by_digest = {r["digest"]: r for r in records if r.get("duplicate_of") is None}
    evaluated = sum(1 for r in records if r.get("counted"))
    # Once every admitted config has a record there is nothing left to learn.
    admitted = space.admitted_configs(context)
    admitted_total = len(admitted)
    admitted_seen = {r["digest"] for r in records if r.get("counted")}
    best = best_record(records)
    queue: deque[_Pending] = deque()        # asked, not yet recorded, in ask order
    queued: dict[str, _Pending] = {}        # digest -> first queued occurrence of a config with no record
    sampler = make_sampler(options.sampler, options.population, options.seed, space=space, admitted=admitted,
                           taken=lambda digest: digest in by_digest or digest in queued)
    study = optuna.create_study(study_name="evotune", storage=run.storage_url, load_if_exists=True,
                                directions=["minimize", "minimize"], sampler=sampler)
    # Trials left RUNNING by a killed process are lost work: close them as failed.
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)

    dists = distributions(space)
    asked = recorded = abandoned = 0
    new_in_flight = 0   # queued configs with no record: each will be a counted trial
    pool = None
    started = time.time()

    def may_ask() -> bool:
        # One proposal being evaluated plus `lookahead` ahead; never more than the trials still wanted.
        return (len(queue) <= options.lookahead and evaluated + new_in_flight < options.trials
                and len(admitted_seen) + new_in_flight < admitted_total
                and asked < options.trials * options.max_proposals_factor)

    def submit(src: KernelSource) -> Future | None:
        nonlocal pool
        for _ in range(2):  # a pool broken by a dead worker is replaced once
            if pool is None:
                pool = compile_pool(options.compile_workers)
            try:
                return pool.submit(compile_module.compile_source, src.code, src.entry)
            except BrokenExecutor:
                pool.shutdown(wait=False, cancel_futures=True)
                pool = None
        return None

    try:
        while True:
            if should_stop is not None and should_stop():
                break
            while may_ask():
                asked += 1
                trial = study.ask(dists)
                config = space.config(trial.params)
                item = _Pending(trial=trial, config=config, asked=time.time(), why=space.violations(config, context))
                digest = config.digest()
                if not item.why and digest not in by_digest and digest not in queued:
                    # A repeat of a queued config waits for its record instead of compiling again.
                    item.source = instantiate(problem, config, shape)
                    queued[digest] = item
                    new_in_flight += 1
                    if options.lookahead > 0:
                        item.future = submit(item.source)
                queue.append(item)
            if not queue:
                break

            item = queue[0]
            digest = item.config.digest()
            # "started" is when it was asked: with compile-ahead it may have waited in the queue since.
            record = {"number": item.trial.number, "config": item.config.as_dict(), "digest": digest,
                      "started": item.asked}
            prior = by_digest.get(digest)
            if prior is not None:
                # A repeated proposal is answered from the record, never measured twice.
                res = Result.from_dict(prior["result"])
                record.update(duplicate_of=prior["number"], counted=False)
            elif item.why:
                res = Result(status=R.PRUNED, message="constraint: " + "; ".join(item.why))
                record.update(counted=False, source_digest=None)
            else:
                res = _compile_and_evaluate(problem, shape, item, evaluate)
                # Whatever it came to, it spent compile or GPU time.
                record.update(counted=True, source_digest=item.source.digest)
                evaluated += 1
                new_in_flight -= 1
                admitted_seen.add(digest)
            if res.ok:
                study.tell(item.trial, [res.time_us, res.max_abs])
            else:
                study.tell(item.trial, state=TrialState.PRUNED if res.status == R.PRUNED else TrialState.FAIL)
            item.told = True
            record["result"] = res.as_dict()
            record["finished"] = time.time()
            run.append_trial(record)
            recorded += 1
            if prior is None:
                by_digest[digest] = record
                queued.pop(digest, None)
            queue.popleft()
            if prior is None:
                # Only a first record can change the front or the best (duplicates repeat a result),
                # and the loop already holds every first record: no re-read of trials.jsonl, whose
                # growth made each proposal slower (seen on the H100: 2216 duplicates in 2906 records).
                best = run.update_summary(list(by_digest.values()))
            if on_trial is not None:
                on_trial(record, best)
    finally:
        try:
            for item in queue:
                if not item.told:
                    try:
                        study.tell(item.trial, state=TrialState.FAIL)
                        abandoned += 1
                    except Exception:  # best effort: the next run_search closes what is left RUNNING
                        pass
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    records = run.trials()
    best = best_record(records)
    counts: dict[str, int] = {}
    for r in records:
        if r.get("duplicate_of") is None:
            counts[r["result"]["status"]] = counts.get(r["result"]["status"], 0) + 1
    return {"run_id": run.run_id, "evaluated": evaluated, "proposals": recorded, "abandoned": abandoned,
            "statuses": counts, "seconds": time.time() - started, "best": best}


def _compiled(item: _Pending):
    """The compiled kernel of a queued config: from its pool job, or compiled here."""
    if item.future is not None:
        try:
            return item.future.result()
        except CompileError:
            raise
        except Exception:
            pass  # the job never ran (a worker died, the pool broke): compile it here instead
    return compile_source(item.source.code, item.source.entry)


def _compile_and_evaluate(problem, shape, item: _Pending, evaluate: Evaluator) -> Result:
    """The result of a new, admitted configuration: compile error, static prune, or the evaluator's answer."""
    config = item.config
    try:
        compiled = _compiled(item)
    except CompileError as e:
        return Result(status=R.COMPILE_ERROR, message=str(e))
    geo = problem.geometry(config, shape)
    static = static_violations(compiled.resources, geo.threads, geo.dynamic_smem)
    if static:
        return Result(status=R.PRUNED, message="static: " + "; ".join(static),
                      resources=compiled.resources.as_dict(), compile_seconds=compiled.compile_seconds)
    res = evaluate(config, compiled)
    if res.resources is None:
        res = Result(**{**res.__dict__, "resources": compiled.resources.as_dict(),
                        "compile_seconds": compiled.compile_seconds})
    return res


def worker_evaluator(worker, problem, shape, seeds=(1, 2, 3), reps: int = 40) -> Evaluator:
    """Evaluate candidates in a GPUWorker process (the search process never touches the GPU)."""
    from .workers import compiled_to_dict

    def evaluate(config, compiled) -> Result:
        return worker.evaluate({"kind": "evaluate", "family": problem.family, "shape": shape.as_dict(),
                                "config": config.as_dict(), "compiled": compiled_to_dict(compiled),
                                "seeds": list(seeds), "reps": reps})

    return evaluate
