"""The search loop: an Optuna study (by default strategies.SurrogateSampler: an additive model of the measured
times proposes the config it predicts fastest) over a SearchSpace, minimising (GPU time, max error). Every proposal becomes a recorded
trial: pruned by the space's constraints, failed to compile, pruned by the static
resource gate, faulted, hung, wrong, or measured. Nothing a candidate does ends the search.

Strategies: every name in SAMPLERS is an Optuna sampler behind the same ask/tell loop;
evotune's own (strategies.py) are "surrogate" (the default), "exhaustive" (each admitted config once, in the
space's order) and, unless options.steer is off, "nsga2": NSGA-II breeding from the elites of every completed
trial, inside the constraints, never repeating a config. options.warm_start configs are asked first.

Compile ahead: while the GPU measures one candidate, the loop keeps up to `lookahead` more
proposals asked and compiles the new ones in a process pool. Results are still told and
recorded strictly in ask order, so the records are what a serial search would write. Where the whole admitted
space compiles within about the GPU worker's start (PRECOMPILE_BUDGET_S at COMPILE_SECONDS each on the compile
workers), every config is submitted to the pool at the start instead, and only one proposal is asked ahead: each
one is then asked knowing every result but the one on the GPU, and is already compiled when its turn comes.

The loop is SearchLoop: named steps (propose, compile_ahead, evaluate, record, tell) returning a typed
SearchSummary; run_search is its entry point for callers that take the summary as a dict.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import BrokenExecutor, Future
from dataclasses import dataclass, field, fields
from typing import Callable, Protocol, runtime_checkable

from ..build import compile as compile_module  # the pool submits compile_module.compile_source (picklable by name)
from ..records import result as R
from ..build.compile import CompileError, compile_pool, compile_source, judged
from ..errors import UsageError
from ..records.result import Result
from ..records.runs import Run, best_record
from ..records.sources import archive_source
from .shared import SharedStudy
from ..space.searchspace import Config
from ..build.template import KernelSource, geometry_of, instantiate
from ..timeline import Timeline

SAMPLERS = ("surrogate", "nsga2", "tpe", "random", "exhaustive")
# Pacing. A proposal asked k candidates ahead of the GPU is chosen without their results; it must be asked that far
# ahead only to be compiled in time. Compiling the whole admitted space at the start removes the need where it is
# cheap: it costs no wall time while it fits in the GPU worker's start (measured 9.7 s on the H100 machine,
# docs/PERFORMANCE.md), and one NVRTC compile of a candidate took 0.50 s (median, attention-hopper on gpt2) and
# 0.57 s (attention-small on mission) there.
COMPILE_SECONDS = 0.5
PRECOMPILE_BUDGET_S = 8.0
PRECOMPILED_LOOKAHEAD = 2  # with the evaluation overlapped, one proposal waits while the GPU measures the other
WAIT_S = 0.25  # poll period while other agents finish the configs this one waits for


class Evaluator(Protocol):
    def __call__(self, config, compiled) -> Result: ...


@runtime_checkable
class StartsEvaluations(Protocol):
    """An evaluator that can hand a candidate to the GPU and return at once: start() gives the function that waits
    for its Result. The loop asks its next proposals in between (Optuna's asks cost ~80 ms each on the H100
    machine, as long as an evaluation), instead of one after the other."""

    def start(self, config, compiled) -> Callable[[], Result]: ...


@dataclass(frozen=True)
class SearchOptions:
    trials: int = 60                 # candidates to compile and evaluate (constraint-pruned proposals don't count)
    sampler: str = "surrogate"
    population: int = 16
    seed: int = 0
    max_proposals_factor: int = 30   # stop after trials * this many proposals, whatever they were
    compile_workers: int | None = None  # compile processes; None: os.cpu_count()
    lookahead: int | None = None        # proposals asked ahead of the one being evaluated; None: 2 x compile_workers;
                                        # 0: serial (ask, compile in this process, evaluate, tell), no pool
    mutation_prob: float | None = None  # NSGA-II: chance each knob of a child is redrawn; None: 1 / number of knobs
    crossover_prob: float = 0.9         # NSGA-II: chance a child mixes two parents (else it copies one)
    steer: bool = True                  # nsga2: breed children inside the constraints and away from taken configs
                                        # (strategies.SteeredNSGAIISampler); False: Optuna's NSGA-II as it is
    warm_start: tuple = ()              # config dicts asked first on a fresh study (earlier runs' best); see warmstart.py
    prior_mean: tuple = ()              # ((knob, value), mean) the surrogate shrinks toward (warmstart.knob_prior)
    precompile: bool | None = None      # compile every admitted config at the start; None: where it fits the budget
    lookahead_given: bool = field(default=False, init=False, repr=False)  # lookahead was set, not derived

    def __post_init__(self):
        if self.mutation_prob is not None and not 0.0 <= self.mutation_prob <= 1.0:
            raise UsageError(f"mutation probability must be within [0, 1], not {self.mutation_prob}")
        if not 0.0 <= self.crossover_prob <= 1.0:
            raise UsageError(f"crossover probability must be within [0, 1], not {self.crossover_prob}")
        if self.population < 2:
            raise UsageError(f"population must be at least 2, not {self.population}")
        object.__setattr__(self, "warm_start", tuple(dict(c) for c in self.warm_start))
        mean = self.prior_mean.items() if isinstance(self.prior_mean, dict) else self.prior_mean
        object.__setattr__(self, "prior_mean", tuple((tuple(key), float(mu)) for key, mu in mean))
        workers = self.compile_workers if self.compile_workers is not None else (os.cpu_count() or 1)
        lookahead = self.lookahead if self.lookahead is not None else 2 * workers
        if self.lookahead is None and self.sampler == "nsga2":
            # NSGA-II breeds only from completed trials: a proposal asked further ahead than one
            # population is bred from elites that have not seen the last population's results.
            lookahead = min(lookahead, self.population)
        if self.lookahead is None and self.sampler == "surrogate":
            # One round of compiles ahead keeps the pool busy; further ahead only asks with fewer results
            # (replaying attention-small: 31.5 evaluations to the optimum's 3% at 16 ahead, 48 at 32).
            lookahead = min(lookahead, max(workers, PRECOMPILED_LOOKAHEAD))  # at least one asked while measuring
        if workers < 1:
            raise UsageError(f"compile workers must be at least 1, not {workers}")
        if lookahead < 0:
            raise UsageError(f"lookahead must be 0 (serial) or more, not {lookahead}")
        object.__setattr__(self, "compile_workers", workers)
        object.__setattr__(self, "lookahead_given", self.lookahead is not None)
        object.__setattr__(self, "lookahead", lookahead)

    def precompiles(self, admitted: int) -> bool:
        """Whether a search over `admitted` configs compiles them all at the start (see PRECOMPILE_BUDGET_S)."""
        if self.precompile is not None:
            return self.precompile and self.lookahead > 0
        return (self.lookahead > 0 and not self.lookahead_given
                and admitted * COMPILE_SECONDS / self.compile_workers <= PRECOMPILE_BUDGET_S)

    def paced(self, admitted: int) -> int:
        """The lookahead a search over `admitted` configs uses: one proposal ahead where it precompiles them (unless
        --lookahead says otherwise)."""
        if self.precompiles(admitted) and not self.lookahead_given:
            return min(self.lookahead, PRECOMPILED_LOOKAHEAD)
        return self.lookahead


def make_sampler(name: str, population: int, seed: int, *, space=None, admitted: list[Config] | None = None,
                 taken: Callable[[str], bool] | None = None, recorded: Callable[[str], bool] | None = None,
                 context=None, steer: bool = False, mutation_prob: float | None = None,
                 crossover_prob: float = 0.9, prior_mean=()):
    """The Optuna sampler for a SAMPLERS name; "exhaustive" needs the space, its admitted configs (in the
    order to visit them) and `taken(digest)`, true for configs already recorded or in flight.

    "nsga2" with `steer` (and the space and shape context) breeds its children inside the constraints
    and away from taken configs (strategies.SteeredNSGAIISampler); without, it is Optuna's NSGA-II as is."""
    import optuna

    if name == "surrogate":
        from .strategies import SurrogateSampler

        if space is None or admitted is None:
            raise ValueError("the surrogate sampler needs the space and its admitted configs")
        return SurrogateSampler(admitted, distributions(space), taken if taken is not None else (lambda digest: False),
                                seed=seed, variant=space.variant, prior_mean=dict(prior_mean))
    if name == "nsga2":
        nsga = dict(population_size=population, seed=seed, mutation_prob=mutation_prob, crossover_prob=crossover_prob)
        if not steer:
            return optuna.samplers.NSGAIISampler(**nsga)
        from .strategies import SteeredNSGAIISampler

        if space is None or context is None:
            raise ValueError("the steered NSGA-II sampler needs the space and the shape's context")
        is_taken = taken if taken is not None else (lambda digest: False)
        # The children's constraint check, thousands per generation: a set lookup where the admitted configs
        # are known (the loop enumerates them anyway), else the space's constraints.
        admitted_set = frozenset(admitted) if admitted is not None else None
        admissible = ((lambda params: space.config(params) in admitted_set) if admitted_set is not None
                      else (lambda params: space.admitted(space.config(params), context)))
        by_variant = None
        if admitted is not None and space.variant:
            by_variant = {}
            for c in admitted:
                by_variant.setdefault(c[space.variant], []).append(c.as_dict())
        return SteeredNSGAIISampler(distributions=distributions(space), admissible=admissible,
                                    taken=lambda params: is_taken(space.config(params).digest()),
                                    variant=space.variant, admitted_by_variant=by_variant, **nsga)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "exhaustive":
        from .strategies import ExhaustiveSampler

        if space is None or admitted is None:
            raise ValueError("the exhaustive sampler needs the space and its admitted configs")
        return ExhaustiveSampler(admitted, distributions(space), taken if taken is not None else (lambda digest: False),
                                 recorded)
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
    claim: bool = False                 # this agent will measure it (the trial's tag tells other agents)


@dataclass(frozen=True)
class SearchSummary:
    """What a search came to (SearchLoop.run); as_dict is the summary run_search returns and --json prints."""

    run_id: str
    evaluated: int          # counted candidates of the run, all agents' (the trials budget is the run's)
    measured: int           # candidates this agent compiled and evaluated
    proposals: int          # proposals this agent recorded
    abandoned: int          # proposals asked and never recorded: told FAIL, free to be proposed again
    statuses: dict          # status -> distinct configs (first records) of the run
    seconds: float
    best: dict | None       # the run's best record
    agent: str
    lookahead: int          # proposals asked ahead of the GPU (SearchOptions.paced)
    precompiled: bool       # every admitted config was compiled at the start

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class SearchLoop:
    """Run (or continue) the search recorded in `run`: run() returns a SearchSummary.

    Each turn of run(): propose (ask the study up to `lookahead` ahead, compile ahead the new configs), then take
    the proposal at the head of the queue: evaluate it (from the record of a repeat, a constraint prune, or
    compiled and measured), record it, tell the study. run_search says what the arguments do."""

    def __init__(self, problem, space, shape, run: Run, evaluate: Evaluator, options: SearchOptions,
                 on_trial: Callable[[dict, dict | None], None] | None = None,
                 should_stop: Callable[[], bool] | None = None,
                 compiler: Callable[[Config, KernelSource], object] | None = None, agent: str | None = None,
                 timeline: Timeline | None = None, on_status: Callable[[str], None] | None = None):
        self.timeline = timeline if timeline is not None else Timeline()  # where the loop's time goes, by step
        self.say = on_status or (lambda text: None)  # what it does while no result comes, for the display
        self.problem, self.space, self.shape, self.rn = problem, space, shape, run
        self.evaluator, self.options, self.on_trial, self.compiler = evaluate, options, on_trial, compiler
        self.should_stop, self.agent = should_stop, agent
        self.queue: deque[_Pending] = deque()  # asked, not yet recorded, in ask order
        self.queued: dict[str, _Pending] = {}   # digest -> first queued occurrence of a config with no record
        self.waiting: list[_Pending] = []       # asked configs another agent is measuring: recorded from its record
        self.asked = self.recorded = self.abandoned = self.measured = 0
        self.pool = None
        self.max_asks = options.trials * options.max_proposals_factor
        # An evaluator that starts evaluations lets the loop ask while the GPU measures: one proposal fewer is
        # queued ahead, so each is still asked with `lookahead` candidates unfinished, as in a serial turn (asked
        # one candidate earlier, replaying both oracles showed the evaluations to the optimum growing: 60 -> 67).
        self.evaluator_starts = isinstance(evaluate, StartsEvaluations)
        self.precompiles = False                 # every admitted config compiled at the start (set by setup)
        self.precompiled: dict[str, tuple] = {}  # digest -> (source, compile future) of those not yet asked
        self.pace(options.lookahead)

    def pace(self, lookahead: int) -> None:
        self.lookahead = lookahead
        self.overlap = self.evaluator_starts and lookahead > 1
        self.ahead = lookahead - 1 if self.overlap else lookahead

    # ------------------------------------------------------------------ the loop

    def run(self) -> SearchSummary:
        self.setup()
        try:
            while not (self.should_stop is not None and self.should_stop()):
                self.propose()
                self.bring_back_waiting()
                if self.queue:
                    self.take_turn(self.queue[0])
                elif self.waiting or (not self.done() and self.view.other_claims()):
                    time.sleep(WAIT_S)  # other agents' records will end the wait (or their deaths)
                else:
                    break
        finally:
            self.close()
        return self.summary()

    def setup(self) -> None:
        """The run as this agent knows it, the sampler, the study (trials a killed process left RUNNING closed)."""
        with self.timeline.phase("import optuna"):
            import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.context = self.problem.context(self.shape)
        self.say("reading the run and enumerating the space")
        # Every record (its own, its host's other agents', other hosts'), and the configs other agents are
        # measuring now. refresh() brings it up to date.
        with self.timeline.phase("read the run"):
            self.view = SharedStudy(self.rn, label=self.agent)
        self.by_digest = self.view.firsts  # digest -> first record of the config
        # Once every admitted config has a record there is nothing left to learn.
        with self.timeline.phase("enumerate the space"):
            admitted = self.space.admitted_configs(self.context)
        self.admitted_total = len(admitted)
        self.pace(self.options.paced(len(admitted)))
        self.precompiles = self.options.precompiles(len(admitted))
        if self.precompiles:
            self.precompile(admitted)
        self.best = best_record(list(self.view.records.values()))
        options, view = self.options, self.view
        sampler = make_sampler(options.sampler, options.population, options.seed, space=self.space, admitted=admitted,
                               taken=lambda digest: digest in self.by_digest or digest in self.queued
                               or view.claimed_elsewhere(digest) is not None,
                               recorded=lambda digest: digest in self.by_digest, context=self.context,
                               steer=options.steer, mutation_prob=options.mutation_prob,
                               crossover_prob=options.crossover_prob, prior_mean=options.prior_mean)
        with self.timeline.phase("open the study"):
            with self.rn.lock():  # agents starting at once on a new SQLite file (a run made before the journal) race to create its tables
                self.storage = self.rn.storage()
            self.study = optuna.create_study(study_name=self.rn.study_name, storage=self.storage, load_if_exists=True,
                                             directions=["minimize", "minimize"], sampler=sampler)
            # Trials left RUNNING by a killed process (this one's earlier self, or a dead agent) are lost work:
            # close them as failed. Other live agents' trials stay open.
            view.start(self.study)
            _enqueue_warm_start(self.study, view, self.rn, self.space, self.context, options.warm_start)
        self.dists = distributions(self.space)
        self.started = time.time()

    def precompile(self, admitted: list[Config]) -> None:
        """Every admitted config with no record submitted to the compile pool now (a replay's `compiler` needs none)."""
        if self.compiler is not None:
            return
        todo = [c for c in admitted if c.digest() not in self.by_digest]
        self.say(f"compiling all {len(todo)} admitted configs on {self.options.compile_workers} workers")
        with self.timeline.phase("precompile the space"):
            for config in todo:
                source = instantiate(self.problem, config, self.shape)
                self.precompiled[config.digest()] = (source, self.submit(source))

    def in_flight(self) -> int:
        # Configs being measured that have no record yet, by this agent or others: each will be counted.
        return sum(1 for it in self.queue if it.claim) + self.view.other_claims()

    def may_ask(self, room: int = 0) -> bool:
        # One proposal being evaluated plus `lookahead` ahead (`room`: queued proposals about to leave, the one on
        # the GPU while it is measured); never more than the trials still wanted.
        flying = self.in_flight()
        return (len(self.queue) - room <= self.ahead and self.view.evaluated + flying < self.options.trials
                and len(self.view.admitted_seen) + flying < self.admitted_total and self.asked < self.max_asks)

    def done(self) -> bool:
        return (self.view.evaluated >= self.options.trials or len(self.view.admitted_seen) >= self.admitted_total
                or self.asked >= self.max_asks)

    # ------------------------------------------------------------------ propose, compile ahead

    def propose(self, room: int = 0) -> None:
        """Ask proposals while may_ask(room); the new admitted configs this agent claims start compiling."""
        if len(self.queue) - room > self.ahead:
            return  # the queue is full: not even a refresh of the study (each read is a storage round trip)
        # Ask and tag as one step for this host's agents: none claims a config another just claimed. One
        # refresh of the study per round, not per proposal (each read of the trials costs a storage round trip);
        # the lock is held for the round, so this host's agents still see every claim before asking.
        with self.timeline.phase("ask"), self.rn.lock():
            self.view.refresh()
            while self.may_ask(room):
                item = self.ask()
                if item.claim:
                    self.compile_ahead(item)
                self.queue.append(item)

    def ask(self) -> _Pending:
        self.asked += 1
        trial = self.study.ask(self.dists)
        config = self.space.config(trial.params)
        item = _Pending(trial=trial, config=config, asked=time.time(), why=self.space.violations(config, self.context))
        digest = config.digest()
        # A repeat of a queued config, or of one another agent is measuring, waits for its record instead of
        # compiling again.
        item.claim = (not item.why and digest not in self.by_digest and digest not in self.queued
                      and self.view.claimed_elsewhere(digest) is None)
        self.view.tag(trial, digest, item.claim)
        return item

    def compile_ahead(self, item: _Pending) -> None:
        with self.timeline.phase("instantiate and submit"):
            self._compile_ahead(item)

    def _compile_ahead(self, item: _Pending) -> None:
        digest = item.config.digest()
        self.queued[digest] = item
        if digest in self.precompiled:
            item.source, item.future = self.precompiled.pop(digest)
            return
        item.source = instantiate(self.problem, item.config, self.shape)
        if self.options.lookahead > 0 and self.compiler is None:
            item.future = self.submit(item.source)

    def submit(self, src: KernelSource) -> Future | None:
        for _ in range(2):  # a pool broken by a dead worker is replaced once
            if self.pool is None:
                self.pool = compile_pool(self.options.compile_workers)
            try:
                return self.pool.submit(compile_module.compile_source, src.code, src.entry)
            except BrokenExecutor:
                self.pool.shutdown(wait=False, cancel_futures=True)
                self.pool = None
        return None

    def bring_back_waiting(self) -> None:
        """Proposals another agent was measuring: answered once its record is in, measured here if it died."""
        back = [it for it in self.waiting if it.config.digest() in self.by_digest
                or self.view.claimed_elsewhere(it.config.digest(), below=it.trial.number) is None]
        for it in back:
            self.waiting.remove(it)
        self.queue.extendleft(reversed(back))

    # ------------------------------------------------------------------ evaluate, record, tell

    def take_turn(self, item: _Pending) -> None:
        """The proposal at the head of the queue: evaluated, recorded and told (or set aside: ready_to_measure)."""
        prior = self.by_digest.get(item.config.digest())
        if prior is None and not item.why and not self.ready_to_measure(item):
            return
        record, res = self.evaluate(item, prior)
        with self.timeline.phase("record"):
            self.record(item, record)
        with self.timeline.phase("tell"):
            self.tell(item, res)
        self.finish(item, record, prior)

    def ready_to_measure(self, item: _Pending) -> bool:
        """For a new admitted config: False where it leaves the queue, to wait for another agent's record or told
        FAIL because other agents' earlier claims make up the trials; else it is this agent's to measure."""
        digest, number = item.config.digest(), item.trial.number
        if (self.view.claimed_elsewhere(digest, below=number) is not None
                or any(w.config.digest() == digest for w in self.waiting)):
            # Another agent asked it first and is measuring it: wait for its record, off the queue.
            self.queue.popleft()
            if item.claim:  # both asked it in the same instant; the lower trial number measures
                item.claim = False
                self.view.tag(item.trial, digest, False)
                self.unqueue(item)
            self.waiting.append(item)
            return False
        if self.view.evaluated + self.view.other_claims(below=number) >= self.options.trials:
            # Other agents' earlier claims already make up the trials asked for.
            from optuna.trial import TrialState

            self.queue.popleft()
            self.unqueue(item)
            self.study.tell(item.trial, state=TrialState.FAIL, skip_if_finished=True)
            item.told = True
            self.view.told(number)
            self.abandoned += 1
            return False
        if not item.claim:  # the agent that claimed it died: measure it here
            item.claim = True
            self.view.tag(item.trial, digest, True)
            self.queued.setdefault(digest, item)
        if item.source is None:
            item.source = instantiate(self.problem, item.config, self.shape)
        return True

    def evaluate(self, item: _Pending, prior: dict | None) -> tuple[dict, Result]:
        """The proposal's record and result: a repeat's from the first record, a constraint prune, or measured."""
        # "started" is when it was asked: with compile-ahead it may have waited in the queue since.
        record = {"number": item.trial.number, "config": item.config.as_dict(), "digest": item.config.digest(),
                  "started": item.asked, "agent": self.view.me.label}
        if prior is not None:
            # A repeated proposal is answered from the record, never measured twice.
            res = Result.from_dict(prior["result"])
            record.update(duplicate_of=prior["number"], counted=False)
        elif item.why:
            res = Result(status=R.PRUNED, message="constraint: " + "; ".join(item.why))
            record.update(counted=False, source_digest=None)
        else:
            res = self.measure(item, record)
        record["result"] = res.as_dict()
        record["finished"] = time.time()
        return record, res

    def measure(self, item: _Pending, record: dict) -> Result:
        if self.measured == 0:
            compiling = sum(1 for it in self.queue if it.future is not None and not it.future.done())
            self.say(f"compiling {compiling} candidates ahead; the first one's GPU check warms up the worker"
                     if compiling else "first candidate on the GPU (warms up the worker)")
        res = _compile_and_judge(self.problem, self.shape, item, self.compiler, self.timeline)
        if not isinstance(res, Result):
            res = self.evaluate_compiled(item, res)
        self.timeline.mark("first result")
        for name, seconds in (res.extra.get("eval_seconds") or {}).items():
            self.timeline.add(f"gpu: {name}", seconds)  # inside the worker, part of "evaluate"
        self.measured += 1
        self.view.refresh(judge=False)
        clash = self.view.conflict(item.config.digest(), item.trial.number)
        # Whatever it came to, it spent compile or GPU time.
        record.update(counted=clash is None, source_digest=item.source.digest)
        if clash is not None:
            # Another agent asked the same config in the same instant (before this one's tag was visible to
            # it) and has the lower trial number: its result is the one that counts.
            record.update(duplicate_of=clash, note=f"measured while trial {clash} of another agent had it")
        return res

    def evaluate_compiled(self, item: _Pending, compiled) -> Result:
        """The evaluator's Result for a compiled candidate that passed the static gate; one that starts evaluations
        measures it while this agent asks its next proposals."""
        if self.overlap:
            finish = self.evaluator.start(item.config, compiled)
            self.propose(room=1)  # the slot this candidate frees once recorded: its successor is asked now
            with self.timeline.phase("evaluate"):
                res = finish()
        else:
            with self.timeline.phase("evaluate"):
                res = self.evaluator(item.config, compiled)
        if res.resources is None:
            res = Result(**{**res.__dict__, "resources": compiled.resources.as_dict(),
                            "compile_seconds": compiled.compile_seconds})
        return res

    def record(self, item: _Pending, record: dict) -> None:
        # A counted trial's source goes into the run's archive first (records/sources.py), so a record never names
        # a source its own run lacks: replay, export and bench compile what was measured, whatever the template
        # says later. A kill between the two leaves an unnamed source, never a record without its source.
        if record.get("counted") and item.source is not None and record.get("source_digest") == item.source.digest:
            archive_source(self.rn.path, item.source)
        # The record goes on the trial (for other hosts), into the log, and then the study is told: a kill
        # between these leaves a RUNNING trial that the next search closes, never a lost record.
        self.view.add(record)
        self.view.store(item.trial, record)
        self.rn.append_trial(record)

    def tell(self, item: _Pending, res: Result) -> None:
        try:
            _tell(self.study, item.trial, res)
        except (ValueError, RuntimeError):
            if not _finished(self.study, item.trial.number):
                raise
            # Another agent took this one for dead and closed the trial; the record stands.
        item.told = True
        self.view.told(item.trial.number)

    def finish(self, item: _Pending, record: dict, prior: dict | None) -> None:
        """Off the queue; the front and the best brought up to date; on_trial told."""
        self.recorded += 1
        if prior is None:
            self.unqueue(item)
        self.queue.popleft()
        if prior is None and record.get("duplicate_of") is None:
            # Only a first record can change the front or the best (duplicates repeat a result), and the loop
            # already holds every first record: no re-read of trials.jsonl, whose growth made each proposal
            # slower (seen on the H100: 2216 duplicates in 2906 records).
            self.best = self.rn.update_summary(list(self.by_digest.values()))
        if self.on_trial is not None:
            self.on_trial(record, self.best)

    def unqueue(self, item: _Pending) -> None:
        digest = item.config.digest()
        if self.queued.get(digest) is item:
            del self.queued[digest]

    # ------------------------------------------------------------------ close, summary

    def close(self) -> None:
        """On every way out of the loop: tell the trials asked but not recorded FAIL, close this agent's view of
        the shared study, shut the compile pool down and close the storage's connections."""
        from optuna.trial import TrialState

        try:
            for item in list(self.queue) + self.waiting:
                if not item.told:
                    try:
                        self.study.tell(item.trial, state=TrialState.FAIL)
                        self.abandoned += 1
                    except Exception:  # best effort: the next search closes what is left RUNNING
                        pass
        finally:
            try:
                self.view.close()
            finally:
                if self.pool is not None:
                    self.pool.shutdown(wait=True, cancel_futures=True)
                engine = getattr(self.storage, "engine", None)
                if engine is not None:
                    engine.dispose()  # an RDB's: closes SQLite's connections (the last one folds the WAL into study.db)

    def summary(self) -> SearchSummary:
        if self.view.from_others:
            # Other agents wrote records too: the last word on the front and the best is the whole log's.
            self.rn.update_summary()
        records = self.rn.trials()
        return SearchSummary(run_id=self.rn.run_id, evaluated=self.view.evaluated, measured=self.measured,
                             proposals=self.recorded, abandoned=self.abandoned, statuses=status_counts(records),
                             seconds=time.time() - self.started, best=best_record(records), agent=self.view.me.label,
                             lookahead=self.lookahead, precompiled=self.precompiles)


def run_search(problem, space, shape, run: Run, evaluate: Evaluator, options: SearchOptions,
               on_trial: Callable[[dict, dict | None], None] | None = None,
               should_stop: Callable[[], bool] | None = None,
               compiler: Callable[[Config, KernelSource], object] | None = None,
               agent: str | None = None, timeline: Timeline | None = None) -> dict:
    """Run (or continue) the search recorded in `run`; return the summary as a dict (SearchSummary.as_dict;
    SearchLoop(...).run() gives it typed).

    Proposals are told and recorded strictly in ask order; "proposals" in the summary counts
    the recorded ones. should_stop is asked before each round of proposals and before each
    evaluation. When it says stop, or an exception (KeyboardInterrupt included) ends the loop,
    the trials asked but not yet recorded are told FAIL and get no record ("abandoned" in the
    summary), so the study holds no RUNNING trial; a kill -9 leaves them RUNNING and the next
    run_search on the run closes them as FAIL. Having no record, their configs are not taken:
    a resume may propose them again. The compile pool is shut down on every way out (queued
    compiles cancelled, running ones finished: their cubins land in the cache for the resume).

    `compiler(config, source)` replaces NVRTC (returning a compile.Compiled or raising CompileError)
    for replays of recorded runs (tools/efficiency_report.py); it runs in this process, with no pool.

    Several agents (processes, hosts) may run this on one run and one study at once (shared.py says
    how they share it); `agent` names this one in its records. The trials budget, the de-duplication
    and "space exhausted" are then the run's, not the agent's: options.trials counted candidates in
    all, no config measured twice. A config another agent is measuring waits for that agent's record
    (or is measured here if that agent dies); these are the only records not written in ask order.
    "evaluated" in the summary is the run's total, "measured" this agent's part.
    """
    return SearchLoop(problem, space, shape, run, evaluate, options, on_trial=on_trial, should_stop=should_stop,
                      compiler=compiler, agent=agent, timeline=timeline).run().as_dict()


def _enqueue_warm_start(study, view, run: Run, space, context, warm_start: tuple) -> None:
    """On a fresh study (never on resume), earlier runs' best configs become its first proposals, in order."""
    if not warm_start:
        return
    with run.lock():
        if not study.get_trials(deepcopy=False) and not view.records:
            from .warmstart import admitted as warm_admitted

            for config in warm_admitted(space, context, warm_start)[0]:
                study.enqueue_trial(config.as_dict())


def status_counts(records: list[dict]) -> dict[str, int]:
    """How many distinct configs (first records) ended in each status."""
    counts: dict[str, int] = {}
    for r in records:
        if r.get("duplicate_of") is None:
            counts[r["result"]["status"]] = counts.get(r["result"]["status"], 0) + 1
    return counts


def _finished(study, number: int) -> bool:
    try:
        return study.get_trials(deepcopy=False)[number].state.is_finished()
    except Exception:
        return False


def _tell(study, trial, res: Result) -> None:
    """Tell the study a result: passing ones with their objectives, the rest PRUNED (constraints, static
    gate) or FAIL. Optuna's NSGA-II reads only COMPLETE trials; TPE reads PRUNED ones as bad
    observations. Telling the failures as COMPLETE trials with an Optuna constraint violation was
    tried (Trial.set_constraint) and changed nothing: TPE proposed exactly the same configs on
    attention-small (3 seeds), and NSGA-II ranks infeasible trials below every feasible one, so they
    never breed while a population of feasible ones exists. What steers is checking each child
    before it is proposed (strategies.SteeredNSGAIISampler)."""
    from optuna.trial import TrialState

    if res.ok:
        study.tell(trial, [res.time_us, res.max_abs])
    else:
        study.tell(trial, state=TrialState.PRUNED if res.status == R.PRUNED else TrialState.FAIL)


def _compiled(item: _Pending, compiler=None):
    """The compiled kernel of a queued config: from its pool job, or compiled here."""
    if compiler is not None:
        return compiler(item.config, item.source)
    if item.future is not None:
        try:
            return item.future.result()
        except CompileError:
            raise
        except Exception:
            pass  # the job never ran (a worker died, the pool broke): compile it here instead
    return compile_source(item.source.code, item.source.entry)


def _compile_and_judge(problem, shape, item: _Pending, compiler, timeline: Timeline):
    """A new, admitted configuration compiled and judged by the static gate: the Compiled to evaluate, or the
    Result it came to (compile error, static prune)."""
    config = item.config
    try:
        with timeline.phase("compile wait"):  # the GPU idles while the head of the queue is still compiling
            compiled = _compiled(item, compiler)
    except CompileError as e:
        return Result(status=R.COMPILE_ERROR, message=str(e))
    # Judged by the geometry the instantiation carries (a source made otherwise: the family's); the worker reads
    # this verdict, not again.
    compiled = judged(compiled, geometry_of(item.source, problem, config, shape))
    static = list(compiled.static_verdict)
    if static:
        return Result(status=R.PRUNED, message="static: " + "; ".join(static),
                      resources=compiled.resources.as_dict(), compile_seconds=compiled.compile_seconds)
    return compiled


def worker_evaluator(worker, problem, shape, seeds=(1, 2, 3), reps: int = 40) -> "WorkerEvaluator":
    """Evaluate candidates in a GPUWorker process (the search process never touches the GPU)."""
    return WorkerEvaluator(worker, problem, shape, tuple(seeds), reps)


@dataclass
class WorkerEvaluator:
    """An Evaluator (and StartsEvaluations) over one GPUWorker: jobs go to the worker as plain data."""

    worker: object
    problem: object
    shape: object
    seeds: tuple
    reps: int

    def _job(self, config, compiled) -> dict:
        from ..gpu.workers import EvaluateJob

        return EvaluateJob(family=self.problem.family, shape=self.shape.as_dict(), config=config, compiled=compiled,
                           seeds=self.seeds, reps=self.reps).as_dict()  # plain data, as the pipe carries it

    def __call__(self, config, compiled) -> Result:
        return self.worker.evaluate(self._job(config, compiled))

    def start(self, config, compiled) -> Callable[[], Result]:
        self.worker.send(self._job(config, compiled))
        return self.worker.evaluated


# --------------------------------------------------------------------------- the finalists beside the baselines, once per run
