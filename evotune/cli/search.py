"""`evotune search`: one agent in this process, or one agent process per `--gpus` entry on one run; then the
run's best timed beside the family's baselines. `evotune tune` (table.py) runs search_one per table key."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import typer

from ..errors import EvotuneError, UsageError
from ..search.loop import SAMPLERS  # the one list --sampler takes (importing it does not import Optuna)
from .common import (FAMILY_HELP, GPU_RANGE, INTERRUPTED, INTERRUPTED_EXIT, MAX_GPU_INDEX, MAX_TRIALS, MAX_WORKERS,
                     SEED_RANGE, SHAPE_HELP, app, check_devices, console, emit_json, err_console, load_problem,
                     require_gpu, timeout_seconds)
from .display import SearchDisplay, cfg_short


@app.command()
def search(
    shape: Optional[str] = typer.Option(None, "--shape", help=SHAPE_HELP),
    trials: int = typer.Option(60, "--trials", min=1, max=MAX_TRIALS, help="Candidates to compile and evaluate."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: timestamp + shape)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the named run."),
    sampler: str = typer.Option(SAMPLERS[0], "--sampler", help=f"Search strategy: {', '.join(SAMPLERS)} "
                                "(surrogate, the default: a model of the measured times picks the next config; nsga2: evolutionary; "
                                "exhaustive: every admitted config once, in order)."),
    population: int = typer.Option(16, "--population", min=2, max=100_000,
                                   help="NSGA-II population: parents kept per generation (elites of parents + children)."),
    mutation_prob: Optional[float] = typer.Option(None, "--mutation-prob", min=0.0, max=1.0,
                                                  help="NSGA-II: chance each knob of a child is redrawn (default: 1 / knobs)."),
    crossover_prob: float = typer.Option(0.9, "--crossover-prob", min=0.0, max=1.0,
                                         help="NSGA-II: chance a child mixes two parents' knobs (else copies one)."),
    steer: bool = typer.Option(True, "--steer/--no-steer", help="NSGA-II: breed children inside the space's "
                               "constraints and away from configs already tried (--no-steer: Optuna's NSGA-II as is)."),
    warm_start: Optional[str] = typer.Option(None, "--warm-start", help="Ask these runs' best configs first, "
                                             "after the priors (RUN[,RUN...], or 'auto', the default: runs of the "
                                             "same family on the same or a similar shape; 'none': neither runs nor "
                                             "priors). New runs only."),
    priors: bool = typer.Option(True, "--priors/--no-priors", help="Ask first the shipped priors (the best configs "
                                "of evotune's own runs, nearest shape class first) that the space admits here. New "
                                "runs only."),
    seed: int = typer.Option(0, "--seed", **SEED_RANGE),
    space: Optional[str] = typer.Option(None, "--space", help="YAML search space (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=FAMILY_HELP + " A resumed run keeps its own."),
    timeout: float = typer.Option(60.0, "--timeout", callback=timeout_seconds, help="Seconds a candidate may take on the GPU before it is killed."),
    gpu: int = typer.Option(0, "--gpu", **GPU_RANGE, help="GPU index for the worker."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPUs to search on, one agent each, all on one run "
                                       "and one study: e.g. 0,1 (0,0: two agents on GPU 0). Default: --gpu."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Keep the study in this database (e.g. "
                                          "postgresql://user@host:5432/evotune) so that agents on several hosts "
                                          "share it; default: the run's journal file (study.journal)."),
    compile_workers: Optional[int] = typer.Option(None, "--compile-workers", min=1, max=MAX_WORKERS,
                                                  help="Processes compiling candidates ahead (default: CPU count)."),
    lookahead: Optional[int] = typer.Option(None, "--lookahead", min=0, max=100_000,
                                            help="Proposals compiled ahead of the GPU (default: 2 x compile workers; 0: serial)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Search the space on the GPU; record every trial, the Pareto front and the best in runs/<run>, then the best beside the baselines."""
    from ..records.runs import check_storage_url, remote_meta, resumed_family, run_to_continue
    from ..search.loop import SearchOptions
    from ..timeline import Timeline

    timeline = Timeline()  # from this process's start: interpreter, imports and all
    timeline.add("start-up", timeline.since_start())

    if sampler not in SAMPLERS:
        raise UsageError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    devices = _parse_gpus(gpus, gpu)
    storage = check_storage_url(storage)
    remote = remote_meta(run, resume, storage)  # a run another host started in --storage: joined below
    problem, shp, spc = load_problem(shape, space, family, resumed_family(run, resume) or (remote or {}).get("family"))
    rn = run_to_continue(run, resume, storage, remote, shp.spec)
    told: list[str] = []  # said once the GPU is found: a search without one is one line
    gpu_model, prior_mean = transfer_context(warm_start, priors, problem, shp, spc, devices[0])
    warm, warm_meta = warm_start_configs(default_warm_start(warm_start, resume), resume, run, problem, shp, spc,
                                         population, json_out, priors=priors, lines=told, gpu=gpu_model)
    require_gpu("search")
    check_devices(devices)
    for line in told:
        err_console.print(line, highlight=False)
    options = SearchOptions(trials=trials, sampler=sampler, population=population, seed=seed,
                            compile_workers=compile_workers, lookahead=lookahead, mutation_prob=mutation_prob,
                            crossover_prob=crossover_prob, steer=steer, warm_start=warm, prior_mean=prior_mean)

    new_meta = new_meta_for(problem, shp, spc, options, storage, devices, warm_meta)

    def resume_hint(rn) -> str:
        return resume_command(rn, shape or shp.spec, trials, gpus, storage, problem.family)

    if len(devices) > 1:
        summary = _search_agents(rn, new_meta, run, devices, storage, options, problem, shp, spc, timeout, json_out,
                                 resume_hint)
        rn = summary.pop("_run")
        return _search_report(summary, rn, json_out, problem.family)
    summary, rn = search_one(rn, new_meta, run, devices[0], storage, options, problem, shp, spc, timeout, json_out,
                             resume_hint, timeline)
    _search_report(summary, rn, json_out, problem.family)


def _parse_gpus(gpus: Optional[str], gpu: int) -> list[int]:
    """--gpus as a list of device indices, one search agent each (a repeated index: several agents on one GPU)."""
    if gpus is None:
        return [gpu]
    if gpu != 0:
        raise UsageError("give --gpus or --gpu, not both")
    parts = [p.strip() for p in gpus.split(",")]
    if not all(p.isdigit() and p.isascii() and len(p) < 6 and int(p) <= MAX_GPU_INDEX for p in parts):
        raise UsageError(f"--gpus {gpus[:40]!r}: give device indices separated by commas, e.g. 0,1 "
                         f"(0,0: two agents on GPU 0; each at most {MAX_GPU_INDEX})")
    return [int(p) for p in parts]


def resume_command(rn, shape_text: str, trials: int, gpus: Optional[str], storage: Optional[str],
                   family: Optional[str] = None) -> str:
    """The command that continues run `rn`, as the line after a Ctrl-C shows it (with --family for a family of your
    own, the consent to load it again)."""
    from ..problems import FAMILIES

    extra = (f" --gpus {gpus}" if gpus else "") + (" --storage URL" if storage else "")
    extra += f" --family {family}" if family and family not in FAMILIES else ""
    return (f"`evotune search --shape {shape_text} --run {rn.run_id} --resume --trials {trials}{extra}`")


def _stopped(rn, resume_hint, timeline=None) -> None:
    """After Ctrl-C: bring pareto.json and best.json up to date, say how to go on, exit 130."""
    rn.update_summary()
    if timeline is not None:
        timeline.append_to(rn.path, command="search", interrupted=True)
    err_console.print(f"{INTERRUPTED}: finished trials are recorded in {rn.path}; continue with {resume_hint(rn)}",
                      highlight=False, soft_wrap=True)
    raise typer.Exit(INTERRUPTED_EXIT)


def _repo_relative(path: str) -> str:
    from ..build.template import REPO_ROOT

    try:
        return str(os.path.relpath(path, REPO_ROOT)) if os.path.abspath(path).startswith(str(REPO_ROOT)) else path
    except ValueError:
        return path


def new_meta_for(problem, shp, spc, options, storage, devices, warm_meta: dict):
    """new_meta(device info) -> the meta.json of a new search run."""
    from ..records.runs import base_meta, storage_meta

    def new_meta(info: dict) -> dict:
        return {**base_meta(), "family": problem.family, "shape": shp.as_dict(), "shape_spec": shp.spec,
                "space": _repo_relative(spc.path), "options": options.__dict__, "device": info,
                **storage_meta(storage, devices), **warm_meta}

    return new_meta


def _beside(rn, problem, shp, call, json_out: bool) -> tuple[dict, dict | None]:
    """The run's finalists timed again beside the family's baselines (search.finalists.measure_beside_best), said in one
    line, and the run's best after it (records.best.final_best: the finalists' winner)."""
    from ..records.best import final_best, read_beside
    from ..search.finalists import measure_beside_best

    note = measure_beside_best(rn, problem, shp, call)
    if not json_out:
        err_console.print(f"finalists: {note['status']}: {note['message']}", highlight=False, soft_wrap=True)
    return note, final_best(rn.trials(), read_beside(rn.path))


def search_one(rn, new_meta, run_name, device, storage, options, problem, shp, spc, timeout, json_out,
               resume_hint, timeline=None, should_stop=None):
    """`search` on one GPU in this process: (summary, run). The summary's "timeline" says where the wall time
    went (also appended to the run's timeline.jsonl).

    `should_stop` (default: never) is asked before each round of proposals; once it says stop, the search
    ends as after its last trial: the finalists are still timed beside the baselines.

    A new run on the local study file does not wait for the GPU worker: the worker starts (torch, CuPy, the CUDA
    context: ~10 s on the H100) while this process creates the run, enumerates the space, opens the study and
    compiles the first candidates; meta.json gets the device before the first evaluation."""
    from ..search.agents import agent_label
    from ..records.runs import new_run
    from ..search.loop import SearchLoop, worker_evaluator
    from ..gpu.workers import GPUWorker
    from ..timeline import Timeline

    timeline = timeline if timeline is not None else Timeline()
    display = SearchDisplay(rn.run_id if rn else (run_name or "new run"), options.trials, rn.trials() if rn else [],
                            json_out, err_console, problem.family)
    with GPUWorker(device=device, timeout_s=timeout) as worker, ThreadPoolExecutor(1) as background:
        try:
            with display:
                display.status(f"starting the GPU worker on device {device} (CUDA context, torch, CuPy)")
                starting = background.submit(_start_worker, worker, timeline)
                early = rn is None and storage is None
                if rn is None:
                    info = None if early else starting.result()
                    with timeline.phase("create the run"):
                        rn = new_run(run_name, new_meta(info), storage)
                    display.rename(rn.run_id)
                evaluate = _AfterWorker(starting, rn if early else None, worker_evaluator(worker, problem, shp),
                                        timeline)
                summary = SearchLoop(problem, spc, shp, rn, evaluate, options, on_trial=display.show,
                                     should_stop=should_stop or (lambda: False), agent=agent_label(device),
                                     timeline=timeline,
                                     on_status=display.status).run()
                evaluate.ready()  # a search that measured nothing still records its device
        except KeyboardInterrupt:
            if rn is None:
                raise
            _stopped(rn, resume_hint, timeline)
        with timeline.phase("the finalists beside the baselines"):
            baselines, best = _beside(rn, problem, shp, worker.call, json_out)
    timeline.append_to(rn.path, command="search", evaluated=summary.evaluated, measured=summary.measured)
    return {**summary.as_dict(), "best": best, "baselines": baselines, "timeline": timeline.as_dict()}, rn


def _start_worker(worker, timeline) -> dict:
    """Start the GPU worker and ask it for the device (run in a background thread: the timeline says how long
    it took, beside everything else)."""
    started = time.perf_counter()
    info = worker.info()
    total = time.perf_counter() - started
    timeline.add("GPU worker start (in the background)", total)
    if worker.start_phases:  # its parts: the worker's own steps, the device info's, and the rest (pipe, waits)
        parts = {**worker.start_phases, **{f"device info: {k}": s for k, s in worker.info_seconds.items()}}
        for name, seconds in parts.items():
            timeline.add(f"gpu start: {name}", seconds)
        timeline.add("gpu start: the rest", max(0.0, total - sum(parts.values())))
    return info


class _AfterWorker:
    """`evaluate`, once the worker that `starting` brings up has answered: the first evaluation waits for it and,
    for a run created before it answered (`new_run`), writes the device into meta.json. `ready()` does the same
    where no candidate was evaluated, before anything else talks to the worker."""

    def __init__(self, starting, new_run, evaluate, timeline):
        self.starting, self.new_run, self.evaluate, self.timeline = starting, new_run, evaluate, timeline
        self.waited = False

    def ready(self) -> None:
        if self.waited:
            return
        with self.timeline.phase("wait for the GPU worker"):
            try:
                info = self.starting.result()
            except BaseException:
                self._drop_empty_run()
                raise
        if self.new_run is not None:
            from ..records.runs import record_device

            record_device(self.new_run, info)
        self.waited = True

    def _drop_empty_run(self) -> None:
        """The worker never started: the run this command created holds no trial, so it goes (as it never
        existed when the worker started first)."""
        import shutil

        if self.new_run is not None and not self.new_run.trials():
            shutil.rmtree(self.new_run.path, ignore_errors=True)

    def __call__(self, config, compiled):
        self.ready()
        return self.evaluate(config, compiled)

    def start(self, config, compiled):
        """The worker evaluator's start(): the candidate goes to the GPU while the loop asks its next proposals."""
        self.ready()
        return self.evaluate.start(config, compiled)


def _search_agents(rn, new_meta, run_name, devices, storage, options, problem, shp, spc, timeout, json_out,
                   resume_hint) -> dict:
    """`search --gpus` with several entries: one agent process per entry on one run and one study; this
    process shows their progress from the run's records and passes Ctrl-C on."""
    from ..search.agents import Agents, specs_for
    from ..records.runs import new_run
    from ..search.loop import status_counts
    from ..gpu.workers import GPUWorker

    if rn is None:
        with GPUWorker(device=devices[0], timeout_s=timeout) as worker:  # the run records the device it ran on
            info = worker.info()
        rn = new_run(run_name, new_meta(info), storage)
    started = time.time()
    tail = rn.tail()
    display = SearchDisplay(f"{rn.run_id} ({len(devices)} agents)", options.trials, tail.read(), json_out, err_console,
                            problem.family)
    agents = Agents(specs_for(devices, run_path=str(rn.path), storage=storage, problem=problem, shape=shp,
                              space=spc, options=options, timeout_s=timeout))
    try:
        with display:
            agents.start()
            while not agents.wait(0.5):
                display.follow(tail.read())
            display.follow(tail.read())
    except KeyboardInterrupt:
        _stop_agents(agents)
        _stopped(rn, resume_hint)
    finally:
        if agents.alive():
            agents.kill()
    failures = agents.failures()
    for label, why in failures.items():
        err_console.print(f"agent {label}: {why}", highlight=False, soft_wrap=True)
    if len(failures) == len(devices):
        raise EvotuneError(f"every agent failed; agent {next(iter(failures))}: {next(iter(failures.values()))}")
    records = rn.trials()
    with GPUWorker(device=devices[0], timeout_s=timeout) as worker:
        beside, best = _beside(rn, problem, shp, worker.call, json_out)
    return {"run_id": rn.run_id, "evaluated": sum(1 for r in records if r.get("counted")), "proposals": len(records),
            "statuses": status_counts(records), "seconds": time.time() - started, "best": best,
            "_run": rn, "baselines": beside,
            "agents": {label: (status if status != "done" else {"measured": payload.measured,
                                                                "proposals": payload.proposals})
                       for label, (status, payload) in agents.outcomes.items()}}


def _stop_agents(agents) -> None:
    """After Ctrl-C: let each agent finish the candidate it is measuring; a second Ctrl-C stops them at once."""
    agents.interrupt()
    err_console.print("stopping: each agent finishes and records the candidate it is measuring "
                      "(Ctrl-C again to stop at once)")
    try:
        agents.wait()
    except KeyboardInterrupt:
        agents.interrupt()  # the second SIGINT: the agents drop what is in flight and close its trials
        if not agents.wait(60):
            agents.kill()


def _search_report(summary: dict, rn, json_out: bool, family: str) -> None:
    if json_out:
        emit_json({**summary, "path": str(rn.path)})
        return
    best = summary["best"]
    console.print(f"run {rn.run_id}: {summary['evaluated']} candidates evaluated ({summary['statuses']}) "
                  f"in {summary['seconds']:.0f} s; records in {rn.path}")
    if summary.get("timeline"):
        from ..timeline import Timeline

        console.print(Timeline.line_of(summary["timeline"]), highlight=False, soft_wrap=True)
    if best:
        res = best["result"]
        console.print(f"best: trial {best['number']} {res['time_us']:.2f} us (p10 {res['timing']['p10_us']:.2f}, "
                      f"p90 {res['timing']['p90_us']:.2f}), max abs err {res['max_abs']:.2e}: "
                      f"{cfg_short(best['config'], family)}")
    else:
        raise EvotuneError(f"run {rn.run_id}: no candidate passed the correctness gate")


def default_warm_start(spec: Optional[str], resume: bool) -> Optional[str]:
    """--warm-start as given, else for a new run 'auto': the user's own runs on a shape like this one come after the
    priors (issue 40: a user's runs add to the shipped priors)."""
    return spec if spec is not None or resume else "auto"


def transfer_context(spec: Optional[str], priors: bool, problem, shp, spc, gpu: int) -> tuple[Optional[str], dict]:
    """(the model name of GPU `gpu`, whose priors rank first: None without one; the surrogate's prior mean from the
    priors, {} where they are off: search.warmstart.search_prior_mean)."""
    from ..search.warmstart import gpu_name, search_prior_mean

    model = gpu_name(gpu)
    return model, search_prior_mean(spec, priors, problem, shp, spc, gpu=model)


def warm_start_configs(spec: Optional[str], resume: bool, run: Optional[str], problem, shp, spc, population: int,
                       json_out: bool, priors: bool = False, lines: list | None = None,
                       gpu: str | None = None) -> tuple[tuple, dict]:
    """The configs asked first (admitted on this shape): with `priors`, the shipped priors' (nearest shape class
    first, at most warmstart.PRIORS), then those of the runs --warm-start names; and what meta.json records of it.
    What it tells the user is printed, or appended to `lines` (printed by the caller once the GPU is found)."""
    def say(text: str) -> None:
        if lines is None:
            err_console.print(text, highlight=False)
        else:
            lines.append(text)

    if spec and spec.strip() == "none":  # --warm-start none: nothing asked first, neither runs nor priors
        spec, priors = None, False
    if resume:
        if spec:
            raise UsageError("--warm-start seeds a new run; a resumed run goes on from its own trials")
        return (), {}
    if not spec and not priors:
        return (), {}
    from ..search.warmstart import admitted, configs_from, pick_runs, prior_configs, with_new_knobs

    context = problem.context(shp)
    firsts, origin = prior_configs(problem, shp, spc, context, gpu=gpu) if priors else ([], [])
    if priors and not json_out:
        runs = sorted({o["run"] for o in origin})
        adapted = [o for o in origin if o.get("adapted")]
        knobs = sorted({k for o in adapted for k in o["adapted"]})
        say((f"priors: {len(firsts)} configs asked first, from {len(runs)} runs (nearest: {origin[0]['run']})"
             + (f"; {len(adapted)} adapted to this shape ({', '.join(knobs)} changed)" if adapted else ""))
            if origin else f"priors: none for {problem.family} on a shape class like {shp.spec}")
    meta = {"priors": {"configs": len(firsts), "runs": sorted({o["run"] for o in origin}),
                       "adapted": sum(1 for o in origin if o.get("adapted"))}} if priors else {}
    if not spec:
        return tuple(firsts), meta
    shipped = set()
    if priors:  # the runs the shipped priors come from were asked as priors already
        from ..records.priors import load_priors

        shipped = {source["run"] for source in load_priors()["sources"]}
    sources = pick_runs(spec, problem, shp, exclude=shipped | ({run} if run else set()))
    # At most a population's worth: NSGA-II's first generation, from which the first elites are chosen.
    configs, notes = admitted(spc, context, with_new_knobs(spc, context, configs_from(sources, limit=None)))
    configs = configs[:population]
    if not json_out:
        if sources:
            names = ", ".join(f"{s.run.run_id} ({'same shape' if s.same_shape else 'similar shape'})" for s in sources)
            say(f"warm start: {len(configs)} configs from {names}")
        else:
            say(f"warm start: no earlier run of {problem.family} on a shape like {shp.spec}")
        for note in notes[:5]:
            say(f"  dropped {note}")
        if len(notes) > 5:
            say(f"  ... and {len(notes) - 5} more dropped")
    meta["warm_start"] = {"spec": spec, "runs": [s.run.run_id for s in sources], "configs": len(configs),
                          "dropped": notes}
    ours = [c.as_dict() for c in configs]
    return tuple((firsts + [c for c in ours if c not in firsts])[:max(population, len(firsts))]), meta
