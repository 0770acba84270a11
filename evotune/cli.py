"""The `evotune` command line: a thin typer + rich layer over the library.

Errors the user can fix print one line and exit non-zero (2 for bad input);
tracebacks appear only with --debug. GPU work happens in worker processes.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext as _nullcontext
from typing import Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .errors import EvotuneError, NoGPUError, UsageError
from .search import SAMPLERS as _SAMPLERS  # the one list --sampler takes (importing it does not import Optuna)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Autotune and evolve templated CUDA kernels (fused attention forward on the H100).")
console = Console()
err_console = Console(stderr=True)
_state = {"debug": False}

REPLAY_SEEDS = (101, 102, 103)  # not the search's seeds: replay checks on inputs the search never saw


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")):
    _state["debug"] = debug


def _emit_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


def _load(shape_text: str, space_path: Optional[str], family: str = "attention"):
    from .problems import get_problem
    from .shapes import parse_shape
    from .space import check_nonempty, load_builtin, load_space

    problem = get_problem(family)
    shape = parse_shape(shape_text)
    problem.check_shape(shape)
    space = load_space(space_path) if space_path else load_builtin(problem.default_space)
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


def _cfg_short(cfg: dict) -> str:
    abbrev = {"block_m": "M", "block_n": "N", "compute_warps": "cw", "producer_warps": "pw", "stages": "st",
              "smem_layout": "", "q_in_regs": "qreg", "kv_splits": "kv"}
    parts = []
    for k, v in cfg.items():
        if k == "q_in_regs":
            parts.append("qreg" if v else "qsmem")
        else:
            parts.append(f"{abbrev.get(k, k)}{v}")
    return " ".join(parts)


def _best_table(best: Optional[dict], recent: list[dict]) -> Table:
    table = Table(title="best so far" if best else "no passing candidate yet", expand=False)
    for col in ("trial", "status", "time us", "max abs err", "regs", "config"):
        table.add_column(col)
    rows = ([best] if best else []) + [r for r in recent[-6:] if not best or r["number"] != best["number"]]
    for i, r in enumerate(rows):
        res = r["result"]
        t = f"{res['time_us']:.2f}" if res.get("time_us") else "-"
        e = f"{res['max_abs']:.2e}" if res.get("max_abs") is not None and res.get("max_abs") != float("inf") else "-"
        regs = str((res.get("resources") or {}).get("registers", "-"))
        status = res["status"] + (" (best)" if i == 0 and best else "") + (" dup" if r.get("duplicate_of") is not None else "")
        table.add_row(str(r["number"]), status, t, e, regs, _cfg_short(r["config"]))
    return table


# ---------------------------------------------------------------- shapes
@app.command()
def shapes(json_out: bool = typer.Option(False, "--json", help="Machine-readable output.")):
    """List shape presets (`--shape` also takes B,H,S,D or B,H,Sq,Sk,D with :bf16, :causal, :bshd)."""
    from .shapes import PRESETS

    if json_out:
        _emit_json({name: {**s.as_dict(), "spec": s.spec, "about": about} for name, (s, about) in PRESETS.items()})
        return
    table = Table(title="shape presets")
    for col in ("name", "B", "H", "Sq", "Sk", "D", "dtype", "causal", "about"):
        table.add_column(col)
    for name, (s, about) in PRESETS.items():
        table.add_row(name, str(s.batch), str(s.heads), str(s.seq_q), str(s.seq_k), str(s.head_dim), s.dtype,
                      "yes" if s.causal else "no", about)
    console.print(table)


# ---------------------------------------------------------------- check
def _check_one(args):
    family, shape_dict, space_path, cfg_dict = args
    from .compile import CompileError, compile_source, static_violations
    from .problems import get_problem
    from .shapes import Shape
    from .space import load_space
    from .template import instantiate

    problem = get_problem(family)
    shape = Shape.from_dict(shape_dict)
    space = load_space(space_path)
    cfg = space.config(cfg_dict)
    geo = problem.geometry(cfg, shape)
    src = instantiate(problem, cfg, shape)
    try:
        c = compile_source(src.code, src.entry)
    except CompileError as e:
        return {"config": cfg_dict, "status": "compile_error", "message": str(e)}
    why = static_violations(c.resources, geo.threads, geo.dynamic_smem)
    return {"config": cfg_dict, "status": "pruned" if why else "ok", "message": "; ".join(why),
            "resources": c.resources.as_dict(), "threads": geo.threads, "dynamic_smem": geo.dynamic_smem,
            "compile_seconds": c.compile_seconds, "cached": c.cached}


@app.command()
def check(
    shape: str = typer.Option("mission", "--shape", help="Preset name or B,H,S,D[:flags]."),
    space: Optional[str] = typer.Option(None, "--space", help="YAML search space (default: the family's)."),
    sample: int = typer.Option(24, "--sample", help="Compile this many admitted configs, sampled (0 = all)."),
    seed: int = typer.Option(0, "--seed"),
    jobs: int = typer.Option(0, "--jobs", help="Parallel compiles (default: CPU cores)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Static check of a space without a GPU: constraints, real NVRTC compiles, registers, spills, shared memory."""
    problem, shp, spc = _load(shape, space)
    ctx = problem.context(shp)
    all_cfgs = list(spc.all_configs())
    admitted = [c for c in all_cfgs if spc.admitted(c, ctx)]
    picked = admitted if sample <= 0 or sample >= len(admitted) else random.Random(seed).sample(admitted, sample)
    work = [(problem.family, shp.as_dict(), spc.path, c.as_dict()) for c in picked]
    start = time.time()
    rows = []
    with Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err_console, disable=json_out, transient=True) as progress:
        task = progress.add_task("compile", total=len(work))
        with ProcessPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
            for row in pool.map(_check_one, work):
                rows.append(row)
                progress.advance(task)
    summary = {"space": spc.path, "shape": shp.spec, "space_size": len(all_cfgs), "admitted": len(admitted),
               "compiled": len(rows), "ok": sum(r["status"] == "ok" for r in rows),
               "pruned_static": sum(r["status"] == "pruned" for r in rows),
               "compile_errors": sum(r["status"] == "compile_error" for r in rows),
               "seconds": round(time.time() - start, 1)}
    if json_out:
        _emit_json({"summary": summary, "configs": rows})
    else:
        table = Table(title=f"{spc.family} on {shp.spec}: {len(rows)} of {len(admitted)} admitted configs "
                            f"(space {len(all_cfgs)})")
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
                      f"compile errors {summary['compile_errors']} ({summary['seconds']} s)")
    if summary["compile_errors"]:
        raise EvotuneError(f"{summary['compile_errors']} admitted configs failed to compile: the space admits code "
                           f"the template cannot build")


# ---------------------------------------------------------------- search
@app.command()
def search(
    shape: str = typer.Option("mission", "--shape", help="Preset name or B,H,S,D[:flags]."),
    trials: int = typer.Option(60, "--trials", min=1, help="Candidates to compile and evaluate."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: timestamp + shape)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the named run."),
    sampler: str = typer.Option("nsga2", "--sampler", help=f"Search strategy: {', '.join(_SAMPLERS)} "
                                "(nsga2: evolutionary; exhaustive: every admitted config once, in order)."),
    population: int = typer.Option(16, "--population", min=2, help="NSGA-II population size."),
    seed: int = typer.Option(0, "--seed"),
    space: Optional[str] = typer.Option(None, "--space", help="YAML search space (default: the family's)."),
    timeout: float = typer.Option(60.0, "--timeout", help="Seconds a candidate may take on the GPU before it is killed."),
    gpu: int = typer.Option(0, "--gpu", help="GPU index for the worker."),
    compile_workers: Optional[int] = typer.Option(None, "--compile-workers", min=1,
                                                  help="Processes compiling candidates ahead (default: CPU count)."),
    lookahead: Optional[int] = typer.Option(None, "--lookahead", min=0,
                                            help="Proposals compiled ahead of the GPU (default: 2 x compile workers; 0: serial)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Search the space on the GPU; record every trial, the Pareto front and the best in runs/<run>."""
    from .runs import Run, base_meta
    from .search import SAMPLERS, SearchOptions, run_search, worker_evaluator
    from .workers import GPUWorker

    if sampler not in SAMPLERS:
        raise UsageError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    problem, shp, spc = _load(shape, space)
    if resume:
        if not run:
            raise UsageError("--resume needs --run NAME")
        rn = Run.open(run)
        meta = rn.meta()
        if meta.get("shape_spec") != shp.spec:
            raise UsageError(f"run {run!r} searched {meta.get('shape_spec')}, not {shp.spec}")
    else:
        rn = None
        if run is not None:
            Run.check_new_name(run)  # before the slow worker start
    _require_gpu("search")
    options = SearchOptions(trials=trials, sampler=sampler, population=population, seed=seed,
                            compile_workers=compile_workers, lookahead=lookahead)
    with GPUWorker(device=gpu, timeout_s=timeout) as worker:
        info = worker.call({"kind": "info"})
        if rn is None:
            meta = {**base_meta(), "family": problem.family, "shape": shp.as_dict(), "shape_spec": shp.spec,
                    "space": _repo_relative(spc.path), "options": options.__dict__, "device": info}
            rn = Run.create(run, meta)
        evaluate = worker_evaluator(worker, problem, shp)
        stop = {"flag": False}
        recent: list[dict] = []
        progress = Progress(TextColumn("[bold]search[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TimeRemainingColumn(), console=err_console)
        task = progress.add_task(rn.run_id, total=trials,
                                 completed=sum(1 for r in rn.trials() if r.get("counted")))
        # On a terminal: a live progress bar with ETA and the best-so-far table; elsewhere a line per trial.
        live = (Live(Group(progress), console=err_console, refresh_per_second=4)
                if err_console.is_terminal and not json_out else None)

        def on_trial(record, best):
            recent.append(record)
            if record.get("counted"):
                progress.advance(task)
            if live is not None:
                live.update(Group(progress, _best_table(best, recent)))
            elif not json_out:
                res = record["result"]
                t = f"{res['time_us']:.2f} us" if res.get("time_us") else res["message"][:80]
                err_console.print(f"trial {record['number']:4d} {res['status']:<13} {t:<14} {_cfg_short(record['config'])}")

        try:
            with live if live is not None else _nullcontext():
                summary = run_search(problem, spc, shp, rn, evaluate, options, on_trial=on_trial,
                                     should_stop=lambda: stop["flag"])
        except KeyboardInterrupt:
            rn.update_summary()
            err_console.print(f"interrupted: finished trials are recorded in {rn.path}; continue with "
                              f"`evotune search --shape {shape} --run {rn.run_id} --resume --trials {trials}`")
            raise typer.Exit(130)
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


# ---------------------------------------------------------------- replay
def _select(rn, which: str) -> dict:
    if which == "best":
        return rn.best()
    try:
        return rn.trial(int(which))
    except ValueError:
        raise UsageError(f"replay/export takes 'best' or a trial number, not {which!r}") from None


@app.command()
def replay(
    which: str = typer.Argument("best", help="'best' or a trial number."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    baselines: bool = typer.Option(True, "--baselines/--no-baselines", help="Time the SDPA backends beside it."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Recompile a recorded config, re-verify on fresh inputs, re-time beside SDPA, report drift."""
    from .problems import get_problem
    from .runs import Run
    from .search import worker_evaluator
    from .shapes import Shape
    from .space import Config
    from .workers import GPUWorker

    rn = Run.open(run)
    meta = rn.meta()
    rec = _select(rn, which)
    if (rec.get("result") or {}).get("status") != "ok":
        raise EvotuneError(f"trial {rec['number']} of run {rn.run_id} did not pass ({rec['result']['status']}); nothing to replay")
    problem = get_problem(meta["family"])
    shp = Shape.from_dict(meta["shape"])
    config = Config.from_dict(rec["config"])
    _require_gpu("replay")
    src, compiled = _compile_candidate(problem, shp, config)
    with GPUWorker() as worker:
        res = worker_evaluator(worker, problem, shp, seeds=REPLAY_SEEDS)(config, compiled)
        base = worker.call({"kind": "baselines", "family": problem.family, "shape": shp.as_dict()}, timeout_s=600) if baselines else {}
    recorded = rec["result"]["time_us"]
    out = {"run_id": rn.run_id, "trial": rec["number"], "config": rec["config"], "shape": shp.spec,
           "status": res.status, "message": res.message, "time_us": res.time_us, "recorded_time_us": recorded,
           "drift_pct": (100.0 * (res.time_us - recorded) / recorded) if res.time_us else None,
           "max_abs": res.max_abs, "timing": res.timing, "verification": res.verification,
           "source_changed": rec.get("source_digest") not in (None, src.digest), "baselines": base}
    if json_out:
        _emit_json(out)
    else:
        _print_comparison(out, shp)
    if res.status != "ok":
        raise EvotuneError(f"replay of trial {rec['number']} failed: {res.status}: {res.message}")


def _print_comparison(out: dict, shp) -> None:
    flops = shp.flops()
    table = Table(title=f"{shp.spec}: run {out['run_id']} trial {out['trial']}")
    for col in ("kernel", "median us", "p10-p90 us", "TFLOP/s", "max abs err", "vs ours"):
        table.add_column(col)
    t = out["time_us"]
    tim = out.get("timing") or {}
    table.add_row("evotune (replay)", f"{t:.2f}" if t else "-",
                  f"{tim.get('p10_us', 0):.2f}-{tim.get('p90_us', 0):.2f}" if tim else "-",
                  f"{flops / t / 1e6:.1f}" if t else "-",
                  f"{out['max_abs']:.2e}" if out.get("max_abs") is not None else "-", "1.00x")
    table.add_row("evotune (recorded)", f"{out['recorded_time_us']:.2f}", "", "", "", "")
    for name, b in (out.get("baselines") or {}).items():
        if not b.get("available"):
            table.add_row(f"SDPA {name}", "n/a", b.get("reason", ""), "", "", "")
            continue
        bt = b["timing"]
        table.add_row(f"SDPA {name}", f"{b['time_us']:.2f}", f"{bt['p10_us']:.2f}-{bt['p90_us']:.2f}",
                      f"{flops / b['time_us'] / 1e6:.1f}", f"{b['verification']['max_abs']:.2e}",
                      f"{b['time_us'] / t:.2f}x" if t else "-")
    console.print(table)
    if out.get("drift_pct") is not None:
        console.print(f"drift from the record: {out['drift_pct']:+.1f}%")
    if out.get("source_changed"):
        console.print("note: the kernel template changed since this trial was recorded")


# ---------------------------------------------------------------- verify / sanitize
def _resolve_candidate(which: str, run: Optional[str], config_json: Optional[str], shape_text: Optional[str],
                       space_path: Optional[str]):
    """(problem, shape, config) from a run record, or from --config JSON on --shape; --shape overrides a run's."""
    from .problems import get_problem
    from .runs import Run
    from .shapes import Shape, parse_shape

    if config_json is not None:
        problem, shp, spc = _load(shape_text or "mission", space_path)
        try:
            cfg_dict = json.loads(config_json)
        except json.JSONDecodeError as e:
            raise UsageError(f"--config is not valid JSON: {e}") from None
        if not isinstance(cfg_dict, dict):
            raise UsageError("--config must be a JSON object of knob values")
        config = spc.config(cfg_dict)
        why = spc.violations(config, problem.context(shp))
        if why:
            raise UsageError(f"--config is not admitted on {shp.spec}: {'; '.join(why)}")
        return problem, shp, config
    from .space import Config

    rn = Run.open(run)
    meta = rn.meta()
    rec = _select(rn, which)
    problem = get_problem(meta["family"])
    shp = parse_shape(shape_text) if shape_text else Shape.from_dict(meta["shape"])
    problem.check_shape(shp)
    return problem, shp, Config.from_dict(rec["config"])


def _compile_candidate(problem, shp, config):
    from .compile import compile_source
    from .template import instantiate

    src = instantiate(problem, config, shp)
    return src, compile_source(src.code, src.entry)


@app.command("verify")
def verify_cmd(
    which: str = typer.Argument("best", help="'best' or a trial number of --run."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    config: Optional[str] = typer.Option(None, "--config", help="A config as JSON instead of a run record."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape to check on (default: the run's)."),
    space: Optional[str] = typer.Option(None, "--space", help="Space for --config (default: the family's)."),
    launches: int = typer.Option(100, "--launches", min=2, help="Launches for the bitwise determinism check."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Deep check of one config: the gate (seeds + stress inputs + dependency) and bitwise determinism."""
    from .workers import GPUWorker, compiled_to_dict

    problem, shp, cfg = _resolve_candidate(which, run, config, shape, space)
    _require_gpu("verify")
    _, compiled = _compile_candidate(problem, shp, cfg)
    with GPUWorker(timeout_s=600) as worker:
        rep = worker.call({"kind": "verify", "family": problem.family, "shape": shp.as_dict(),
                           "config": cfg.as_dict(), "compiled": compiled_to_dict(compiled), "launches": launches,
                           "seeds": list(REPLAY_SEEDS)})
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
        console.print(f"  determinism  {'pass' if det['passed'] else 'FAIL'}: {det['detail']}")
    if not ok:
        raise EvotuneError(f"{_cfg_short(cfg.as_dict())} failed the deep check on {shp.spec}")


def _sanitize_shape(shp):
    """A small ragged shape of the same class (head dim, dtype, mask, layout): sanitizers run ~100x slower."""
    from dataclasses import replace

    return replace(shp, batch=1, heads=2, seq_q=197, seq_k=300 if not shp.causal else 197)


@app.command()
def sanitize(
    which: str = typer.Argument("best", help="'best' or a trial number of --run."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    config: Optional[str] = typer.Option(None, "--config", help="A config as JSON instead of a run record."),
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape (default: a small ragged one of the run's class)."),
    space: Optional[str] = typer.Option(None, "--space", help="Space for --config (default: the family's)."),
    tool: list[str] = typer.Option(["memcheck", "racecheck", "synccheck"], "--tool", help="Sanitizer tool(s)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Run compute-sanitizer (memcheck, racecheck, synccheck) on one config and report clean or the finding."""
    from .sanitize import TOOLS, run_tool
    from .workers import compiled_to_dict

    for t in tool:
        if t not in TOOLS:
            raise UsageError(f"unknown sanitizer tool {t!r}; tools: {', '.join(TOOLS)}")
    problem, shp, cfg = _resolve_candidate(which, run, config, shape, space)
    if shape is None:
        shp = _sanitize_shape(shp)
    _require_gpu("sanitize")
    _, compiled = _compile_candidate(problem, shp, cfg)
    job = {"family": problem.family, "shape": shp.as_dict(), "config": cfg.as_dict(),
           "compiled": compiled_to_dict(compiled)}
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


# ---------------------------------------------------------------- export
@app.command()
def export(
    which: str = typer.Argument("best", help="'best' or a trial number."),
    run: Optional[str] = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    output: str = typer.Option(..., "-o", "--output", help="Path of the .cu file to write."),
):
    """Write a standalone .cu with the config baked in (builds with `nvcc -arch=sm_90a -c`)."""
    from .export import export_source, write_export
    from .problems import get_problem
    from .runs import Run
    from .shapes import Shape
    from .space import Config

    rn = Run.open(run)
    meta = rn.meta()
    rec = _select(rn, which)
    problem = get_problem(meta["family"])
    text = export_source(problem, Shape.from_dict(meta["shape"]), Config.from_dict(rec["config"]), rec, meta)
    path = write_export(output, text)
    console.print(f"wrote {path} (run {rn.run_id}, trial {rec['number']})")


# ---------------------------------------------------------------- runs
@app.command("runs")
def list_runs(json_out: bool = typer.Option(False, "--json")):
    """List recorded runs with their best result."""
    from .runs import Run, best_record, runs_dir

    rows = []
    root = runs_dir()
    for meta_path in sorted(root.glob("*/meta.json")) if root.exists() else []:
        rn = Run(meta_path.parent)
        try:
            meta = rn.meta()
        except EvotuneError as e:  # one damaged run must not hide the others
            rows.append({"run": rn.run_id, "shape": None, "device": None, "trials": 0, "best_us": None,
                         "error": str(e)})
            continue
        recs = rn.trials()
        best = best_record(recs)
        rows.append({"run": rn.run_id, "shape": meta.get("shape_spec"), "device": (meta.get("device") or {}).get("name"),
                     "trials": len(recs), "best_us": best["result"]["time_us"] if best else None})
    if json_out:
        _emit_json(rows)
        return
    table = Table(title=f"runs in {root}")
    for col in ("run", "shape", "device", "trials", "best us"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["run"], str(r["shape"]), str(r["device"]), str(r["trials"]),
                      f"{r['best_us']:.2f}" if r["best_us"] else "-")
    console.print(table)


def main() -> None:
    try:
        app(standalone_mode=False)
    except EvotuneError as e:
        if _state["debug"]:
            raise
        err_console.print(f"evotune: error: {e}", highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("evotune: interrupted")
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:  # the parser's own usage errors, and anything unexpected
        # Typer vendors click; its exceptions carry `show()` and an exit code (2 for usage).
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            sys.exit(130)
        if _state["debug"]:
            raise
        err_console.print(f"evotune: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
                          highlight=False, soft_wrap=True)
        sys.exit(1)

if __name__ == "__main__":
    main()
