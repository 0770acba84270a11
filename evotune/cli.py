"""The `evotune` command line: a thin typer + rich layer over the library.

Errors the user can fix print one line and exit non-zero (2 for bad input);
tracebacks appear only with --debug. GPU work happens in worker processes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext as _nullcontext
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from .errors import EvotuneError, NoGPUError, UsageError
from .outputs import check_output_path, write_output
from .cli_display import SearchDisplay as _SearchDisplay
from .cli_display import cfg_short as _cfg_short
from .search import SAMPLERS as _SAMPLERS  # the one list --sampler takes (importing it does not import Optuna)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Autotune and evolve templated CUDA kernels (fused attention forward on the H100).")
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}

INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
_INTERRUPTED = "evotune: interrupted"
REPLAY_SEEDS = (101, 102, 103)  # not the search's seeds: replay checks on inputs the search never saw
_FAMILY_HELP = ("Kernel family: attention, softmax or package.module:ATTR (a plugin: allow its module with "
                "--plugin or EVOTUNE_PLUGINS; default: the one the --space file names, else attention).")
_SHAPE_HELP = "Preset name (`evotune shapes --family F`) or the family's spelling (default: the family's)."


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors."),
          plugin: Optional[list[str]] = typer.Option(
              None, "--plugin", help="Allow this module's kernel families (package.module; repeatable). "
              "Plugin families are code: evotune imports none that you did not allow here or in EVOTUNE_PLUGINS.")):
    _state["debug"] = debug
    if plugin:
        from .problems import allow_plugins

        allow_plugins(plugin)


def _emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _load(shape_text: Optional[str], space_path: Optional[str], family: Optional[str] = None):
    """(problem, shape, space): the family is --family, else the one the --space file names, else attention;
    the shape is parsed by that family (its default shape when none is given)."""
    from .problems import get_problem
    from .space import check_nonempty, load_builtin, load_space, space_family

    # A space file names its family, so `--space` alone picks it (a plugin `package.module:ATTR` too).
    declared = space_family(space_path) if space_path else None
    problem = get_problem(family or declared or "attention")
    if declared is not None and declared != problem.family:
        raise UsageError(f"{space_path}: space is for family {declared!r}, not {problem.family!r}")
    shape = problem.parse_shape(shape_text if shape_text is not None else problem.default_shape)
    problem.check_shape(shape)
    # The space's expressions may read exactly the names the family's context gives.
    names = tuple(problem.context(shape))
    space = (load_space(space_path, names, problem.knob_domains()) if space_path
             else load_builtin(problem.default_space, names))
    if space.family != problem.family:
        raise UsageError(f"{space.path}: space is for family {space.family!r}, not {problem.family!r}")
    check_nonempty(space, problem.context(shape))
    return problem, shape, space


def _repo_relative(path: str) -> str:
    from .template import REPO_ROOT

    try:
        return str(os.path.relpath(path, REPO_ROOT)) if os.path.abspath(path).startswith(str(REPO_ROOT)) else path
    except ValueError:
        return path


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def _require_gpu(command: str) -> None:
    if _gpu_count() < 1:
        raise NoGPUError(f"no CUDA GPU is visible: `evotune {command}` needs one "
                         f"(`evotune check` compiles and reports resources without a GPU)")


_FOLD_MIN = 24  # narrowest a folded description stays readable


def _print_fit_table(title: str, headers: list[str], rows: list[list[str]], drop_order: tuple[str, ...] = ()) -> None:
    """Print `rows` as a table that fits this console. The first column holds the names a user types (a preset,
    a run): it is never wrapped or cut. Columns of `drop_order` may fold down to _FOLD_MIN characters; where even
    that does not fit they are left out, in that order. A name wider than the console gets plain lines instead."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if widths[0] + 4 > console.width:
        console.print(title, highlight=False)
        for r in [headers, *rows]:
            console.print("  ".join(r), highlight=False, markup=False, soft_wrap=True)
        return
    foldable = {headers.index(name) for name in drop_order}
    shown = list(range(len(headers)))
    for name in drop_order:
        needed = sum(min(widths[i], _FOLD_MIN) if i in foldable else widths[i] for i in shown)
        if needed + 3 * len(shown) + 1 <= console.width:
            break
        shown.remove(headers.index(name))
    table = Table(title=title)
    for i in shown:
        first = i == 0
        table.add_column(headers[i], no_wrap=first, min_width=widths[i] if first else None, overflow="fold")
    for r in rows:
        table.add_row(*(r[i] for i in shown))
    console.print(table)


# ---------------------------------------------------------------- shapes
@app.command()
def shapes(
    family: str = typer.Option("attention", "--family", help="Kernel family whose presets to list."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
):
    """List a family's shape presets (attention's `--shape` also takes B,H,S,D or B,H,Sq,Sk,D with :bf16,
    :causal, :bshd; softmax's ROWS,COLS with :bf16)."""
    from .problems import get_problem

    problem = get_problem(family)
    presets = problem.presets()
    if json_out:
        _emit_json({name: {**s.as_dict(), "spec": s.spec, "about": about} for name, (s, about) in presets.items()})
        return
    columns = list(problem.shape_columns(next(iter(presets.values()))[0])) if presets else ["spec"]
    rows = [[name, *problem.shape_columns(s).values(), about] for name, (s, about) in presets.items()]
    _print_fit_table(f"{problem.family} shape presets", ["name", *columns, "about"], rows, ("about",))


# ---------------------------------------------------------------- check
def _progress(what: str) -> Progress:
    """A bar on stderr, gone when done; off where stderr is no terminal (rich would end it with a blank line)."""
    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, transient=True, disable=not err_console.is_terminal)


@app.command()
def check(
    shape: Optional[str] = typer.Option(None, "--shape", help=_SHAPE_HELP),
    space: Optional[str] = typer.Option(None, "--space", help="YAML search space (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=_FAMILY_HELP),
    sample: int = typer.Option(24, "--sample", min=0, help="Compile this many admitted configs, sampled (0 = all)."),
    seed: int = typer.Option(0, "--seed"),
    jobs: int = typer.Option(0, "--jobs", min=0, help="Parallel compiles (default: CPU cores)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Static check of a space without a GPU: constraints, real NVRTC compiles, registers, spills, shared memory."""
    from .static_check import admitted_configs, compile_all, pick, summarize

    problem, shp, spc = _load(shape, space, family)
    with _progress("enumerating") as progress:
        task = progress.add_task("enumerate", total=spc.size())
        admitted, enumerated, enum_s = admitted_configs(spc, problem.context(shp),
                                                         lambda done, _: progress.update(task, completed=done))
    picked = pick(admitted, sample, seed)
    start = time.time()
    with _progress("compiling") as progress:
        task = progress.add_task("compile", total=len(picked))
        rows = compile_all(problem, shp, spc, picked, jobs or os.cpu_count() or 1,
                           lambda done, _: progress.update(task, completed=done))
    summary = summarize(spc, shp, enumerated, len(admitted), rows, enum_s, time.time() - start)
    if json_out:
        _emit_json({"summary": summary, "configs": rows})
    else:
        _print_check(summary, rows, spc.family)
    if summary["compile_errors"]:
        raise EvotuneError(f"{summary['compile_errors']} admitted configs failed to compile: the space admits code "
                           f"the template cannot build")


def _print_check(summary: dict, rows: list[dict], family: str) -> None:
    table = Table(title=f"{family} on {summary['shape']}: {len(rows)} of {summary['admitted']} admitted configs "
                        f"(space {summary['space_size']})")
    for col in ("config", "threads", "smem KB", "regs", "spill B", "stack B", "status"):
        table.add_column(col)
    for r in sorted(rows, key=lambda r: (r["status"] != "ok", (r.get("resources") or {}).get("registers", 0))):
        res = r.get("resources") or {}
        table.add_row(_cfg_short(r["config"]), str(r.get("threads", "-")),
                      f"{r.get('dynamic_smem', 0) / 1024:.1f}", str(res.get("registers", "-")),
                      str(res.get("spill_stores", "-")), str(res.get("stack_frame", "-")),
                      r["status"] + (f": {r['message']}" if r["message"] else ""))
    console.print(table)
    console.print(f"ok {summary['ok']}, pruned by the static gate {summary['pruned_static']}, "
                  f"compile errors {summary['compile_errors']} (enumerating {summary['enumerate_seconds']} s, "
                  f"compiling {summary['seconds']} s)")


# ---------------------------------------------------------------- search
def _parse_gpus(gpus: Optional[str], gpu: int) -> list[int]:
    """--gpus as a list of device indices, one search agent each (a repeated index: several agents on one GPU)."""
    if gpus is None:
        return [gpu]
    if gpu != 0:
        raise UsageError("give --gpus or --gpu, not both")
    parts = [p.strip() for p in gpus.split(",")]
    if not all(p.isdigit() for p in parts):
        raise UsageError(f"--gpus {gpus!r}: give device indices separated by commas, e.g. 0,1 "
                         f"(0,0: two agents on GPU 0)")
    return [int(p) for p in parts]


def _check_devices(devices: list[int]) -> None:
    count = _gpu_count()
    missing = sorted({d for d in devices if d >= count})
    if missing:
        seen = f"{count} CUDA device{'s' if count != 1 else ''} visible (indices 0-{count - 1})"
        raise UsageError(f"--gpus names GPU {', '.join(map(str, missing))}, but there {'are' if count != 1 else 'is'} "
                         f"{seen}; CUDA_VISIBLE_DEVICES renumbers them")


def _resume_hint(rn, shape_text: str, trials: int, gpus: Optional[str], storage: Optional[str]) -> str:
    extra = (f" --gpus {gpus}" if gpus else "") + (" --storage URL" if storage else "")
    return (f"`evotune search --shape {shape_text} --run {rn.run_id} --resume --trials {trials}{extra}`")


def _stopped(rn, resume_hint) -> None:
    """After Ctrl-C: bring pareto.json and best.json up to date, say how to go on, exit 130."""
    rn.update_summary()
    err_console.print(f"{_INTERRUPTED}: finished trials are recorded in {rn.path}; continue with {resume_hint(rn)}",
                      highlight=False, soft_wrap=True)
    raise typer.Exit(INTERRUPTED_EXIT)


def _search_agents(rn, new_meta, run_name, devices, storage, options, problem, shp, spc, timeout, json_out,
                   resume_hint) -> dict:
    """`search --gpus` with several entries: one agent process per entry on one run and one study; this
    process shows their progress from the run's records and passes Ctrl-C on."""
    from .agents import Agents, specs_for
    from .runs import best_record, new_run
    from .search import status_counts
    from .workers import GPUWorker, InfoJob

    if rn is None:
        with GPUWorker(device=devices[0], timeout_s=timeout) as worker:  # the run records the device it ran on
            info = worker.call(InfoJob())
        rn = new_run(run_name, new_meta(info), storage)
    started = time.time()
    tail = rn.tail()
    before = tail.read()
    best = best_record(before)
    display = _SearchDisplay(f"{rn.run_id} ({len(devices)} agents)", options.trials,
                             sum(1 for r in before if r.get("counted")), json_out, err_console)
    live = display.live

    def show(records: list[dict]) -> None:
        nonlocal best
        for record in records:
            best = best_record([r for r in (best, record) if r is not None])
            display.show(record, best, record.get("agent", ""))

    agents = Agents(specs_for(devices, run_path=str(rn.path), storage=storage, problem=problem, shape=shp,
                              space=spc, options=options, timeout_s=timeout))
    try:
        with live if live is not None else _nullcontext():
            agents.start()
            while not agents.wait(0.5):
                show(tail.read())
            show(tail.read())
    except KeyboardInterrupt:
        agents.interrupt()
        err_console.print("stopping: each agent finishes and records the candidate it is measuring "
                          "(Ctrl-C again to stop at once)")
        try:
            agents.wait()
        except KeyboardInterrupt:
            agents.interrupt()  # the second SIGINT: the agents drop what is in flight and close its trials
            if not agents.wait(60):
                agents.kill()
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
        beside = _beside(rn, problem, shp, worker.call, json_out)
    return {"run_id": rn.run_id, "evaluated": sum(1 for r in records if r.get("counted")), "proposals": len(records),
            "statuses": status_counts(records), "seconds": time.time() - started, "best": best_record(records),
            "_run": rn, "baselines": beside,
            "agents": {label: (status if status != "done" else {"measured": payload.measured,
                                                                "proposals": payload.proposals})
                       for label, (status, payload) in agents.outcomes.items()}}


@app.command()
def search(
    shape: Optional[str] = typer.Option(None, "--shape", help=_SHAPE_HELP),
    trials: int = typer.Option(60, "--trials", min=1, help="Candidates to compile and evaluate."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: timestamp + shape)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the named run."),
    sampler: str = typer.Option("nsga2", "--sampler", help=f"Search strategy: {', '.join(_SAMPLERS)} "
                                "(nsga2: evolutionary; exhaustive: every admitted config once, in order)."),
    population: int = typer.Option(16, "--population", min=2,
                                   help="NSGA-II population: parents kept per generation (elites of parents + children)."),
    mutation_prob: Optional[float] = typer.Option(None, "--mutation-prob", min=0.0, max=1.0,
                                                  help="NSGA-II: chance each knob of a child is redrawn (default: 1 / knobs)."),
    crossover_prob: float = typer.Option(0.9, "--crossover-prob", min=0.0, max=1.0,
                                         help="NSGA-II: chance a child mixes two parents' knobs (else copies one)."),
    steer: bool = typer.Option(True, "--steer/--no-steer", help="NSGA-II: breed children inside the space's "
                               "constraints and away from configs already tried (--no-steer: Optuna's NSGA-II as is)."),
    warm_start: Optional[str] = typer.Option(None, "--warm-start", help="Ask these runs' best configs first "
                                             "(RUN[,RUN...], or 'auto': runs of the same family on the same or a "
                                             "similar shape). New runs only."),
    seed: int = typer.Option(0, "--seed"),
    space: Optional[str] = typer.Option(None, "--space", help="YAML search space (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=_FAMILY_HELP + " A resumed run keeps its own."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds a candidate may take on the GPU before it is killed."),
    gpu: int = typer.Option(0, "--gpu", help="GPU index for the worker."),
    gpus: Optional[str] = typer.Option(None, "--gpus", help="GPUs to search on, one agent each, all on one run "
                                       "and one study: e.g. 0,1 (0,0: two agents on GPU 0). Default: --gpu."),
    storage: Optional[str] = typer.Option(None, "--storage", help="Keep the study in this database (e.g. "
                                          "postgresql://user@host:5432/evotune) so that agents on several hosts "
                                          "share it; default: the run's SQLite file."),
    compile_workers: Optional[int] = typer.Option(None, "--compile-workers", min=1,
                                                  help="Processes compiling candidates ahead (default: CPU count)."),
    lookahead: Optional[int] = typer.Option(None, "--lookahead", min=0,
                                            help="Proposals compiled ahead of the GPU (default: 2 x compile workers; 0: serial)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Search the space on the GPU; record every trial, the Pareto front and the best in runs/<run>, then the best beside SDPA."""
    from .runs import check_storage_url, remote_meta, resumed_family, run_to_continue
    from .search import SAMPLERS, SearchOptions

    if sampler not in SAMPLERS:
        raise UsageError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    devices = _parse_gpus(gpus, gpu)
    storage = check_storage_url(storage)
    remote = remote_meta(run, resume, storage)  # a run another host started in --storage: joined below
    problem, shp, spc = _load(shape, space, family or resumed_family(run, resume) or (remote or {}).get("family"))
    rn = run_to_continue(run, resume, storage, remote, shp.spec)
    warm, warm_meta = _warm_start(warm_start, resume, run, problem, shp, spc, population, json_out)
    _require_gpu("search")
    _check_devices(devices)
    options = SearchOptions(trials=trials, sampler=sampler, population=population, seed=seed,
                            compile_workers=compile_workers, lookahead=lookahead, mutation_prob=mutation_prob,
                            crossover_prob=crossover_prob, steer=steer, warm_start=warm)

    new_meta = _meta_for(problem, shp, spc, options, storage, devices, warm_meta)

    def resume_hint(rn) -> str:
        return _resume_hint(rn, shape or shp.spec, trials, gpus, storage)

    if len(devices) > 1:
        summary = _search_agents(rn, new_meta, run, devices, storage, options, problem, shp, spc, timeout, json_out,
                                 resume_hint)
        rn = summary.pop("_run")
        return _search_report(summary, rn, json_out)
    summary, rn = _search_one(rn, new_meta, run, devices[0], storage, options, problem, shp, spc, timeout, json_out,
                              resume_hint)
    _search_report(summary, rn, json_out)


def _meta_for(problem, shp, spc, options, storage, devices, warm_meta: dict):
    """new_meta(device info) -> the meta.json of a new search run."""
    from .runs import base_meta, storage_meta

    def new_meta(info: dict) -> dict:
        return {**base_meta(), "family": problem.family, "shape": shp.as_dict(), "shape_spec": shp.spec,
                "space": _repo_relative(spc.path), "options": options.__dict__, "device": info,
                **storage_meta(storage, devices), **warm_meta}

    return new_meta


def _beside(rn, problem, shp, call, json_out: bool) -> dict:
    """The run's best timed again beside the family's baselines (search.measure_beside_best), said in one line."""
    from .search import measure_beside_best

    note = measure_beside_best(rn, problem, shp, call)
    if not json_out:
        err_console.print(f"baselines: {note['status']}: {note['message']}", highlight=False, soft_wrap=True)
    return note


def _search_one(rn, new_meta, run_name, device, storage, options, problem, shp, spc, timeout, json_out,
                resume_hint):
    """`search` on one GPU in this process: (summary, run)."""
    from .agents import agent_label
    from .runs import new_run
    from .search import SearchLoop, worker_evaluator
    from .workers import GPUWorker, InfoJob

    with GPUWorker(device=device, timeout_s=timeout) as worker:
        info = worker.call(InfoJob())
        if rn is None:
            rn = new_run(run_name, new_meta(info), storage)
        evaluate = worker_evaluator(worker, problem, shp)
        display = _SearchDisplay(rn.run_id, options.trials, sum(1 for r in rn.trials() if r.get("counted")),
                                 json_out, err_console)
        try:
            with display.live if display.live is not None else _nullcontext():
                summary = SearchLoop(problem, spc, shp, rn, evaluate, options, on_trial=display.show,
                                     should_stop=lambda: False, agent=agent_label(device)).run()
        except KeyboardInterrupt:
            _stopped(rn, resume_hint)
        baselines = _beside(rn, problem, shp, worker.call, json_out)
    return {**summary.as_dict(), "baselines": baselines}, rn


def _search_report(summary: dict, rn, json_out: bool) -> None:
    if json_out:
        _emit_json({**summary, "path": str(rn.path)})
        return
    best = summary["best"]
    console.print(f"run {rn.run_id}: {summary['evaluated']} candidates evaluated ({summary['statuses']}) "
                  f"in {summary['seconds']:.0f} s; records in {rn.path}")
    if best:
        res = best["result"]
        console.print(f"best: trial {best['number']} {res['time_us']:.2f} us (p10 {res['timing']['p10_us']:.2f}, "
                      f"p90 {res['timing']['p90_us']:.2f}), max abs err {res['max_abs']:.2e}: {_cfg_short(best['config'])}")
    else:
        raise EvotuneError(f"run {rn.run_id}: no candidate passed the correctness gate")


def _warm_start(spec: Optional[str], resume: bool, run: Optional[str], problem, shp, spc, population: int,
                json_out: bool) -> tuple[tuple, dict]:
    """The configs --warm-start asks first (admitted on this shape), and what meta.json records of it."""
    if not spec:
        return (), {}
    if resume:
        raise UsageError("--warm-start seeds a new run; a resumed run goes on from its own trials")
    from .warmstart import admitted, configs_from, pick_runs

    sources = pick_runs(spec, problem, shp, exclude=run)
    # At most a population's worth: NSGA-II's first generation, from which the first elites are chosen.
    configs, notes = admitted(spc, problem.context(shp), configs_from(sources, limit=None))
    configs = configs[:population]
    if not json_out:
        if sources:
            names = ", ".join(f"{s.run.run_id} ({'same shape' if s.same_shape else 'similar shape'})" for s in sources)
            err_console.print(f"warm start: {len(configs)} configs from {names}", highlight=False)
        else:
            err_console.print(f"warm start: no earlier run of {problem.family} on a shape like {shp.spec}", highlight=False)
        for note in notes[:5]:
            err_console.print(f"  dropped {note}", highlight=False)
        if len(notes) > 5:
            err_console.print(f"  ... and {len(notes) - 5} more dropped", highlight=False)
    meta = {"warm_start": {"spec": spec, "runs": [s.run.run_id for s in sources], "configs": len(configs),
                           "dropped": notes}}
    return tuple(c.as_dict() for c in configs), meta


# ---------------------------------------------------------------- replay
@app.command()
def replay(
    which: str = typer.Argument("best", help="'best' or a trial number."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines",
                                   help="Time the family's baselines beside it (SDPA backends, torch.softmax)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Recompile a recorded config, re-verify on fresh inputs, re-time beside the baselines, report drift."""
    from .runs import Run
    from .search import worker_evaluator
    from .space import Config
    from .workers import BaselinesJob, GPUWorker

    rn = Run.open(run)
    problem, shp = rn.problem_and_shape()
    rec = rn.select(which, "replay")
    config = Config.from_dict(rec["config"])
    _require_gpu("replay")
    src, compiled = _compile_candidate(problem, shp, config)
    with GPUWorker() as worker:
        res = worker_evaluator(worker, problem, shp, seeds=REPLAY_SEEDS)(config, compiled)
        base = worker.call(BaselinesJob(family=problem.family, shape=shp.as_dict()), timeout_s=600) if baselines else {}
    recorded = rec["result"]["time_us"]
    out = {"run_id": rn.run_id, "trial": rec["number"], "config": rec["config"], "shape": shp.spec,
           "status": res.status, "message": res.message, "time_us": res.time_us, "recorded_time_us": recorded,
           "drift_pct": (100.0 * (res.time_us - recorded) / recorded) if res.time_us else None,
           "max_abs": res.max_abs, "timing": res.timing, "verification": res.verification,
           "source_changed": rec.get("source_digest") not in (None, src.digest), "baselines": base}
    if json_out:
        _emit_json(out)
    else:
        _print_comparison(out, shp, problem)
    if res.status != "ok":
        raise EvotuneError(f"replay of trial {rec['number']} failed: {res.status}: {res.message}")


def _print_comparison(out: dict, shp, problem) -> None:
    def rate(time_us):
        value = problem.rate(shp, time_us) if time_us else None
        return f"{value:.1f}" if value is not None else "-"

    kind = getattr(problem, "baseline_kind", "baseline")
    table = Table(title=f"{shp.spec}: run {out['run_id']} trial {out['trial']}")
    for col in ("kernel", "median us", "p10-p90 us", getattr(problem, "rate_unit", "rate"), "max abs err", "vs ours"):
        table.add_column(col)
    t = out["time_us"]
    tim = out.get("timing") or {}
    table.add_row("evotune (replay)", f"{t:.2f}" if t else "-",
                  f"{tim.get('p10_us', 0):.2f}-{tim.get('p90_us', 0):.2f}" if tim else "-", rate(t),
                  f"{out['max_abs']:.2e}" if out.get("max_abs") is not None else "-", "1.00x")
    table.add_row("evotune (recorded)", f"{out['recorded_time_us']:.2f}", "", "", "", "")
    for name, b in (out.get("baselines") or {}).items():
        if not b.get("available"):
            table.add_row(f"{kind} {name}", "n/a", b.get("reason", ""), "", "", "")
            continue
        bt = b["timing"]
        table.add_row(f"{kind} {name}", f"{b['time_us']:.2f}", f"{bt['p10_us']:.2f}-{bt['p90_us']:.2f}",
                      rate(b["time_us"]), f"{b['verification']['max_abs']:.2e}",
                      f"{b['time_us'] / t:.2f}x" if t else "-")
    console.print(table)
    if out.get("drift_pct") is not None:
        console.print(f"drift from the record: {out['drift_pct']:+.1f}%")
    if out.get("source_changed"):
        console.print("note: the kernel template changed since this trial was recorded")


# ---------------------------------------------------------------- verify / sanitize
def _resolve_candidate(which: str, run: Optional[str], config_json: Optional[str], shape_text: Optional[str],
                       space_path: Optional[str], family: Optional[str], purpose: str):
    """(problem, shape, config) from a run record (of the run's family), or from --config JSON on --shape
    (of --family, else the --space file's, else attention); --shape overrides a run's."""
    from .runs import Run

    if config_json is not None:
        problem, shp, spc = _load(shape_text, space_path, family)
        try:
            cfg_dict = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise UsageError(f"--config is not valid JSON: {e}") from None
        except RecursionError:  # json gives up on deep nesting this way, not with a JSONDecodeError
            raise UsageError("--config is nested too deeply: give one JSON object of knob values") from None
        if not isinstance(cfg_dict, dict):
            raise UsageError("--config must be a JSON object of knob values")
        config = spc.config(cfg_dict)
        why = spc.violations(config, problem.context(shp))
        if why:
            raise UsageError(f"--config is not admitted on {shp.spec}: {'; '.join(why)}")
        return problem, shp, config
    from .space import Config

    rn = Run.open(run)
    problem, shp = rn.problem_and_shape()
    rec = rn.select(which, purpose, require_pass=False)
    if family is not None and family != problem.family:
        raise UsageError(f"run {rn.run_id!r} is of family {problem.family!r}, not {family!r}")
    shp = problem.parse_shape(shape_text) if shape_text else shp
    problem.check_shape(shp)
    return problem, shp, Config.from_dict(rec["config"])


def _compile_candidate(problem, shp, config):
    from .compile import compile_source
    from .template import instantiate

    src = instantiate(problem, config, shp)
    return src, compile_source(src.code, src.entry)


@app.command()
def bench(
    which: str = typer.Argument("best", help="'best' or a trial number of --run."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    config: Optional[str] = typer.Option(None, "--config", help="A config as JSON instead of a run record."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape to bench on (default: the run's)."),
    space: Optional[str] = typer.Option(None, "--space", help="Space for --config (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=_FAMILY_HELP + " A run's is its own."),
    reps: int = typer.Option(100, "--reps", min=5, help="Timed CUDA-graph replays per kernel (median, p10, p90)."),
    baselines: Optional[str] = typer.Option(None, "--baselines", help="Comma list of baselines (default: all of the family's)."),
    out: Optional[str] = typer.Option(None, "--out", help="Also write the full JSON record to this file."),
    json_out: bool = typer.Option(False, "--json"),
):
    """The tuned kernel beside every SDPA backend on one shape: same inputs, same gate, same timing."""
    from .bench import flops_and_bytes, header, summarize
    from .workers import BenchJob, GPUWorker

    problem, shp, cfg = _resolve_candidate(which, run, config, shape, space, family, "bench")
    names = [n.strip() for n in baselines.split(",") if n.strip()] if baselines else None
    if names:
        unknown = sorted(set(names) - set(problem.baselines()))
        if unknown:
            raise UsageError(f"unknown baseline(s) {', '.join(unknown)}; {problem.family} has {', '.join(problem.baselines())}")
    if out is not None:
        check_output_path(out, "--out")
    _require_gpu("bench")
    src, compiled = _compile_candidate(problem, shp, cfg)
    with GPUWorker(timeout_s=900) as worker:
        raw = worker.call(BenchJob(family=problem.family, shape=shp.as_dict(), config=cfg, compiled=compiled,
                                   reps=reps, seeds=REPLAY_SEEDS, names=names))
    flops, nbytes = flops_and_bytes(shp)
    summary = summarize(raw, flops, nbytes)
    from .runs import base_meta

    meta = base_meta()
    record = {**header(raw["device"], meta["command_line"], meta.get("git_sha")), "versions": meta["versions"],
              "family": problem.family, "shape": shp.spec, "shape_dict": shp.as_dict(), "config": cfg.as_dict(),
              "source_digest": src.digest, "flops": flops, "min_bytes": nbytes, "reps": reps,
              "source": {"run": run, "trial": which} if config is None else {"config": config},
              **summary, "raw": raw}
    if out is not None:
        write_output(out, json.dumps(record, indent=1, default=str), "--out")
    if json_out:
        _emit_json(record)
    else:
        _print_bench(record)
    if record["rows"][0]["time_us"] is None:
        raise EvotuneError(f"the kernel did not pass on {shp.spec}: {record['rows'][0]['reason']}")


def _print_bench(rec: dict) -> None:
    dev = rec["device"]
    clocks = dev.get("clocks") or {}
    console.print(f"{rec['date']}  {dev.get('name')}  SM clock {clocks.get('sm', '?')} (max {clocks.get('max_sm', '?')}), "
                  f"mem {clocks.get('mem', '?')}  driver {dev.get('driver')}  torch {dev.get('torch')} "
                  f"(CUDA {dev.get('torch_cuda')}, cuDNN {dev.get('cudnn')})  cupy {dev.get('cupy')}  "
                  f"evotune {rec.get('git_sha') or '?'}")
    console.print(f"config: {_cfg_short(rec['config'])}")
    table = Table(title=f"{rec['shape']}  ({rec['reps']} CUDA-graph replays each, median)")
    for col in ("kernel", "median us", "p10-p90 us", "TFLOP/s", "GB/s", "gate ratio", "ours faster by"):
        table.add_column(col, justify="right" if col != "kernel" else "left")

    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    for r in rec["rows"]:
        if not r["available"]:
            table.add_row(r["name"], "n/a", r["reason"][:60], "", "", "", "")
            continue
        table.add_row(r["name"], f(r["time_us"], ".2f"), f"{f(r['p10_us'], '.2f')}-{f(r['p90_us'], '.2f')}",
                      f(r["tflop_s"], ".1f"), f(r["gb_s"], ".0f"), f(r["gate_ratio"], ".3f"),
                      f"{r['ours_speedup']:.2f}x" if r["ours_speedup"] else "-")
    console.print(table)
    fl, ce = rec["floor"], rec["ceilings"]
    console.print(f"ceilings (same process): copy {ce['copy']['gb_s']:.0f} GB/s, {ce['matmul']['dtype']} matmul "
                  f"{ce['matmul']['n']}^3 {ce['matmul']['tflop_s']:.0f} TFLOP/s, empty kernel {ce['empty_kernel']['time_us']:.2f} us")
    console.print(f"floor: memory {f(fl['memory_us'], '.2f')} us, compute {f(fl['compute_us'], '.2f')} us "
                  f"({fl['bound'] or '?'}-bound), launch {fl['launch_us']:.2f} us; "
                  f"ours is {f(rec['rows'][0]['vs_floor'], '.2f')}x its floor")
    if rec.get("ours_over_best_baseline"):
        console.print(f"ours / best baseline ({rec['best_baseline']}): {rec['ours_over_best_baseline']:.3f} of its time")


@app.command("verify")
def verify_cmd(
    which: str = typer.Argument("best", help="'best' or a trial number of --run."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    config: Optional[str] = typer.Option(None, "--config", help="A config as JSON instead of a run record."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape to check on (default: the run's)."),
    space: Optional[str] = typer.Option(None, "--space", help="Space for --config (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=_FAMILY_HELP + " A run's is its own."),
    launches: int = typer.Option(100, "--launches", min=2, help="Launches for the bitwise determinism check."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Deep check of one config: the gate (seeds + stress inputs + dependency) and bitwise determinism."""
    from .workers import GPUWorker, VerifyJob

    problem, shp, cfg = _resolve_candidate(which, run, config, shape, space, family, "verify")
    _require_gpu("verify")
    _, compiled = _compile_candidate(problem, shp, cfg)
    with GPUWorker(timeout_s=600) as worker:
        rep = worker.call(VerifyJob(family=problem.family, shape=shp.as_dict(), config=cfg, compiled=compiled,
                                    launches=launches, seeds=REPLAY_SEEDS))
    ver, det = rep["verification"], rep["determinism"]
    ok = ver["passed"] and det["passed"]
    if json_out:
        _emit_json({"shape": shp.spec, "config": cfg.as_dict(), "passed": ok, **rep})
    else:
        console.print(f"{shp.spec}  {_cfg_short(cfg.as_dict())}")
        console.print(f"  gate         {'pass' if ver['passed'] else 'FAIL'}: ratio {ver['gate_ratio']:.3g} (worst: "
                      f"{ver['worst_case']}), max abs {ver['max_abs']:.3g}, non-finite {ver['nonfinite']}, "
                      f"patterns {', '.join(ver['patterns'])}")
        console.print(f"  dependency   {ver['dependency']}")
        for label, key in (("guard bands", "guards"), ("inputs", "inputs_intact"), ("repeat", "repeat"),
                           ("timed output", "timed_output")):
            console.print(f"  {label:<12} {ver.get(key, 'not checked')}")
        console.print(f"  determinism  {'pass' if det['passed'] else 'FAIL'}: {det['detail']}")
        if not ver["passed"] and rep.get("message"):
            console.print(f"  failed: {rep['message']}")
    if not ok:
        raise EvotuneError(f"{_cfg_short(cfg.as_dict())} failed the deep check on {shp.spec}")


@app.command()
def sanitize(
    which: str = typer.Argument("best", help="'best' or a trial number of --run."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    config: Optional[str] = typer.Option(None, "--config", help="A config as JSON instead of a run record."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape (default: a small ragged one of the run's class)."),
    space: Optional[str] = typer.Option(None, "--space", help="Space for --config (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=_FAMILY_HELP + " A run's is its own."),
    tool: list[str] = typer.Option(["memcheck", "racecheck", "synccheck"], "--tool", help="Sanitizer tool(s)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Run compute-sanitizer (memcheck, racecheck, synccheck) on one config and report clean or the finding."""
    from .sanitize import TOOLS, run_tool

    for t in tool:
        if t not in TOOLS:
            raise UsageError(f"unknown sanitizer tool {t!r}; tools: {', '.join(TOOLS)}")
    problem, shp, cfg = _resolve_candidate(which, run, config, shape, space, family, "sanitize")
    if shape is None:  # sanitizers run ~100x slower: a small shape of the same class
        shp = problem.sanitize_shape(shp)
    _require_gpu("sanitize")
    _, compiled = _compile_candidate(problem, shp, cfg)
    job = {"family": problem.family, "shape": shp.as_dict(), "config": cfg.as_dict(),
           "compiled": compiled.as_dict()}
    reports = [run_tool(t, job) for t in tool]
    if json_out:
        _emit_json({"shape": shp.spec, "config": cfg.as_dict(), "reports": reports})
    else:
        console.print(f"{shp.spec}  {_cfg_short(cfg.as_dict())}")
        for r in reports:
            console.print(f"  {r['tool']:<10} {r['summary']}")
            if not r["clean"]:
                console.print(r["output_tail"], markup=False, highlight=False)
    bad = [r["tool"] for r in reports if not r["clean"]]
    if bad:
        raise EvotuneError(f"compute-sanitizer reported findings ({', '.join(bad)}) for {_cfg_short(cfg.as_dict())} on {shp.spec}")


# ---------------------------------------------------------------- sass
@app.command()
def sass(
    which: str = typer.Argument("best", help="'best' or a trial number of --run."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    config: Optional[str] = typer.Option(None, "--config", help="A config as JSON instead of a run record."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape (default: the run's)."),
    space: Optional[str] = typer.Option(None, "--space", help="Space for --config (default: the family's)."),
    family: Optional[str] = typer.Option(None, "--family", help=_FAMILY_HELP),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Also write the whole SASS listing here."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Disassemble one config's kernel (no GPU): tensor-core instructions (HGMMA/HMMA), TMA and cp.async loads,
    local memory, with ptxas's registers and spills."""
    from .sass import CLASSES, disassemble, summary

    problem, shp, cfg = _resolve_candidate(which, run, config, shape, space, family, "sass")
    if output is not None:
        check_output_path(output, "-o")
    _, compiled = _compile_candidate(problem, shp, cfg)
    text = disassemble(compiled.cubin_path)
    info = summary(text)
    res = compiled.resources
    info.update({"shape": shp.spec, "config": cfg.as_dict(), "registers": res.registers,
                 "spill_bytes": res.spill_stores + res.spill_loads, "stack_frame": res.stack_frame, "arch": compiled.arch})
    if output is not None:
        write_output(output, text, "-o")
    if json_out:
        _emit_json(info)
        return
    console.print(f"{shp.spec}  {_cfg_short(cfg.as_dict())}  ({compiled.arch}, {info['instructions']} instructions)")
    for op, what in CLASSES.items():
        console.print(f"  {op:<8} {info['classes'][op]:>5}  {what}")
    console.print(f"tensor cores: {info['tensor_core']}; local memory instructions: {info['local_memory']}; "
                  f"{res.registers} registers, {info['spill_bytes']} B spilled, {res.stack_frame} B stack frame")
    if output is not None:
        console.print(f"wrote {output}")


# ---------------------------------------------------------------- export
@app.command()
def export(
    which: str = typer.Argument("best", help="'best' or a trial number."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    output: str = typer.Option(..., "-o", "--output", help="Path of the .cu file to write."),
    force: bool = typer.Option(False, "--force", help="Export a trial that did not pass the gate (pruned, "
                               "failed to compile, wrong): its header says so."),
):
    """Write a standalone .cu with the config baked in (builds with `nvcc -gencode arch=compute_90a,code=sm_90a -c`)."""
    from .export import export_source, write_export
    from .runs import Run
    from .space import Config

    check_output_path(output, "-o", create_parents=True)
    rn = Run.open(run)
    problem, shp = rn.problem_and_shape()
    rec = rn.select(which, "export", require_pass=not force, hint=" (--force exports it anyway)")
    text = export_source(problem, shp, Config.from_dict(rec["config"]), rec, rn.meta())
    path = write_export(output, text)
    status = rec["result"]["status"]
    note = f"; it did not pass ({status})" if status != "ok" else ""
    console.print(f"wrote {path} (run {rn.run_id}, trial {rec['number']}{note})", highlight=False)


# ---------------------------------------------------------------- runs
@app.command("runs")
def list_runs(json_out: bool = typer.Option(False, "--json")):
    """List recorded runs with their best result; a damaged run is listed with what is wrong."""
    from .runs import list_runs as rows_of, runs_dir

    rows = rows_of()
    if json_out:
        _emit_json(rows)
        return
    cells = [[r["run"], str(r["shape"]) if r["shape"] else "-", str(r["trials"]) if r["trials"] is not None else "-",
              f"{r['best_us']:.2f}" if r["best_us"] else ("DAMAGED" if r["damaged"] else "-"), str(r["device"] or "-")]
             for r in rows]
    _print_fit_table(f"runs in {runs_dir()}", ["run", "shape", "trials", "best us", "device"], cells,
                     ("device", "shape"))
    for r in rows:
        if r["damaged"]:  # whole, on its own line: a table cell would cut or fold it
            console.print(f"damaged: {r['run']}: {r['damaged']}", highlight=False, markup=False, soft_wrap=True)


def _invoke(args: list[str]) -> None:
    """Parse `args` and run the command, as click's main would but letting exceptions through: its main
    turns Ctrl-C into an exit code (typer) or a bare newline (click) before main() below could say so."""
    command = typer.main.get_command(app)
    with command.make_context("evotune", args) as ctx:
        command.invoke(ctx)


def _parser_error(e: Exception) -> str:
    """A parser usage error (no such option, a value out of range, ...) as one line."""
    ctx = getattr(e, "ctx", None)
    where = f"; see `{ctx.command_path} --help`" if ctx is not None else ""
    return " ".join(e.format_message().split()).rstrip(".") + where


def main() -> None:
    try:
        _invoke(sys.argv[1:])
    except EvotuneError as e:
        if _state["debug"]:
            raise
        err_console.print(f"evotune: error: {e}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print(_INTERRUPTED, highlight=False)
        sys.exit(INTERRUPTED_EXIT)
    except typer.Exit as e:  # --help, or a command's own exit code (a search stopped by Ctrl-C)
        sys.exit(e.exit_code)
    except Exception as e:  # the parser's own usage errors, and anything unexpected
        # Typer vendors click; its exceptions carry `format_message()` and an exit code (2 for usage).
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # `evotune` alone: the help text
            sys.exit(e.exit_code)
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            err_console.print(f"evotune: error: {_parser_error(e)}", highlight=False, markup=False, soft_wrap=True)
            sys.exit(e.exit_code)
        if _state["debug"]:
            raise
        err_console.print(f"evotune: internal error: {type(e).__name__}: {str(e)[:300]} "
                          f"(rerun with --debug for the traceback)",
                          highlight=False, markup=False, soft_wrap=True)
        sys.exit(1)


from . import cli_table as _cli_table  # noqa: E402,F401  registers `table build|show` and `tune` on app

if __name__ == "__main__":
    main()
