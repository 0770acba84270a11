"""The commands on one candidate, a run's trial or a `--config` on a shape: `replay`, `bench`, `verify`,
`sanitize` (on the GPU, in worker processes) and `sass` (no GPU)."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from ..errors import EvotuneError, UsageError
from ..outputs import check_output_path, write_output
from .common import FAMILY_HELP, MAX_REPS, app, console, emit_json, err_console, load_problem, require_gpu
from .display import cfg_short

REPLAY_SEEDS = (101, 102, 103)  # not the search's seeds: replay checks on inputs the search never saw


# The options every candidate command takes the same way (one definition, read by typer for each command).
WHICH = typer.Argument("best", help="'best' or a trial number of --run.")
RUN = typer.Option(None, "--run", help="Run name (default: the latest run).")
CONFIG = typer.Option(None, "--config", help="A config as JSON instead of a run record.")
CONFIG_SPACE = typer.Option(None, "--space", help="Space for --config (default: the family's).")


@app.command()
def replay(
    which: str = typer.Argument("best", help="'best' or a trial number."),
    run: Optional[str] = RUN,
    baselines: bool = typer.Option(True, "--baselines/--no-baselines",
                                   help="Time the family's baselines beside it (attention: SDPA backends; softmax: "
                                   "torch.softmax; a family file: its baselines)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Recompile a recorded config, re-verify on fresh inputs, re-time beside the baselines, report drift."""
    from ..records.runs import Run
    from ..search.loop import worker_evaluator
    from ..gpu.workers import BaselinesJob, GPUWorker

    rn = Run.open(run)
    problem, shp = rn.problem_and_shape()
    rec = rn.select(which, "replay")
    config = rn.config_of(rec, problem)
    require_gpu("replay")
    origin = _trial_source(rn, rec, problem, config, shp, True, json_out)
    src, compiled = _compile_candidate(problem, shp, config, origin)
    with GPUWorker() as worker:
        res = worker_evaluator(worker, problem, shp, seeds=REPLAY_SEEDS)(config, compiled)
        base = worker.call(BaselinesJob(family=problem.family, shape=shp.as_dict()), timeout_s=600) if baselines else {}
    recorded = rec["result"]["time_us"]
    floor_us = (res.extra or {}).get("floor_us")
    out = {"run_id": rn.run_id, "trial": rec["number"], "config": rec["config"], "shape": shp.spec,
           "floor_us": floor_us, "recorded_implausible": bool(floor_us and recorded and recorded < floor_us),
           "status": res.status, "message": res.message, "time_us": res.time_us, "recorded_time_us": recorded,
           "drift_pct": (100.0 * (res.time_us - recorded) / recorded) if res.time_us else None,
           "max_abs": res.max_abs, "timing": res.timing, "verification": res.verification,
           "source": origin.origin, "source_digest": src.digest, "source_changed": origin.changed, "baselines": base}
    if json_out:
        emit_json(out)
    else:
        _print_comparison(out, shp, problem)
    if res.status != "ok":
        raise EvotuneError(f"replay of trial {rec['number']} failed: {res.status}: {res.message}")
    if out["recorded_implausible"]:  # the floor's rule (gpu/plausibility.py) on what the run recorded
        raise EvotuneError(f"trial {rec['number']}'s recorded {recorded:.3g} us is below this shape's floor of "
                           f"{floor_us:.3g} us on this GPU: the record is implausible, whatever the replay measures")


def _print_comparison(out: dict, shp, problem) -> None:
    def rate(time_us):
        value = problem.rate(shp, time_us) if time_us else None
        return f"{value:.1f}" if value is not None else "-"

    kind = problem.baseline_kind
    table = Table(title=f"{shp.spec}: run {out['run_id']} trial {out['trial']}")
    for col in ("kernel", "median us", "p10-p90 us", problem.rate_unit, "max abs err", "vs ours"):
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
    if out.get("source_changed"):  # said before measuring too (_trial_source); the drift compares other code
        console.print("note: the kernel template changed since this trial was recorded and the run archives no "
                      "source for it: the drift compares today's source with the recorded one")


def _resolve_candidate(which: str, run: Optional[str], config_json: Optional[str], shape_text: Optional[str],
                       space_path: Optional[str], family: Optional[str], purpose: str, json_out: bool = False):
    """(problem, shape, config, TrialSource or None) from a run record (of the run's family), or from --config JSON
    on --shape (of --family, else the --space file's, else attention); --shape overrides a run's. A run's trial
    compiles the run's archived source where the shape is the run's own (records/sources.py); a --config, today's
    instantiation (None)."""
    from ..records.runs import Run

    if config_json is not None:
        problem, shp, spc = load_problem(shape_text, space_path, family)
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
        return problem, shp, config, None

    rn = Run.open(run)
    problem, own = rn.problem_and_shape()
    rec = rn.select(which, purpose, require_pass=False)
    if family is not None and family != problem.family:
        raise UsageError(f"run {rn.run_id!r} is of family {problem.family!r}, not {family!r}")
    shp = problem.parse_shape(shape_text) if shape_text else own
    problem.check_shape(shp)
    config = rn.config_of(rec, problem)
    return problem, shp, config, _trial_source(rn, rec, problem, config, shp, shp == own, json_out)


def _trial_source(rn, rec, problem, config, shp, own_shape: bool, json_out: bool = False):
    """The run's archived source of the trial, else today's instantiation (records/sources.trial_source)."""
    from ..records.sources import trial_source

    return trial_source(rn, rec, problem, config, shp, own_shape)


def _compile_candidate(problem, shp, config, origin=None):
    """(source, compiled): the TrialSource's code where there is one (a run's trial), else today's instantiation.
    Where that is not the code the trial measured, one line says so first (on stderr: --json stays one object),
    once every input and output was checked."""
    from ..build.compile import compile_source
    from ..build.template import instantiate

    if origin is not None and origin.note:
        err_console.print(f"note: {origin.note}", highlight=False, markup=False, soft_wrap=True)
    src = origin.source if origin is not None else instantiate(problem, config, shp)
    return src, compile_source(src.code, src.entry)


@app.command()
def bench(
    which: str = WHICH,
    run: Optional[str] = RUN,
    config: Optional[str] = CONFIG,
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape to bench on (default: the run's)."),
    space: Optional[str] = CONFIG_SPACE,
    family: Optional[str] = typer.Option(None, "--family", help=FAMILY_HELP + " A run's is its own."),
    reps: int = typer.Option(100, "--reps", min=5, max=MAX_REPS, help="Timed CUDA-graph replays per kernel, solo and again "
                             "interleaved in rounds (median, p10, p90)."),
    baselines: Optional[str] = typer.Option(None, "--baselines", help="Comma list of baselines (default: all of the family's)."),
    out: Optional[str] = typer.Option(None, "--out", help="Also write the full JSON record to this file."),
    json_out: bool = typer.Option(False, "--json"),
):
    """The tuned kernel beside its family's baselines (attention: every SDPA backend) on one shape: same inputs, same
    gate, same timing."""
    problem, shp, cfg, origin = _resolve_candidate(which, run, config, shape, space, family, "bench", json_out)
    names = [n.strip() for n in baselines.split(",") if n.strip()] if baselines else None
    if names:
        unknown = sorted(set(names) - set(problem.baselines_for(shp)))
        if unknown:
            raise UsageError(f"unknown baseline(s) {', '.join(unknown)}; {problem.family} has {', '.join(problem.baselines_for(shp))}")
    if out is not None:
        check_output_path(out, "--out")
    require_gpu("bench")
    record = bench_record(problem, shp, cfg, origin, reps, names,
                          {"run": run, "trial": which} if config is None else {"config": config})
    if out is not None:
        write_output(out, json.dumps(record, indent=1, default=str), "--out")
    if json_out:
        emit_json(record)
    else:
        _print_bench(record)
    if record["rows"][0]["time_us"] is None:
        raise EvotuneError(f"the kernel did not pass on {shp.spec}: {record['rows'][0]['reason']}")


def bench_record(problem, shp, cfg, origin, reps: int, names, source: dict) -> dict:
    """The `evotune bench --out` record of `cfg` (its source from `origin`, a run's archived trial, or the template)
    on `shp` beside the family's baselines `names` (None: all), measured in one GPU worker."""
    from ..gpu.bench import flops_and_bytes, header, summarize
    from ..gpu.workers import BenchJob, GPUWorker
    from ..records.runs import base_meta

    src, compiled = _compile_candidate(problem, shp, cfg, origin)
    with GPUWorker(timeout_s=900) as worker:
        raw = worker.call(BenchJob(family=problem.family, shape=shp.as_dict(), config=cfg, compiled=compiled,
                                   reps=reps, seeds=REPLAY_SEEDS, names=names))
    flops, nbytes = flops_and_bytes(shp, problem)
    summary = summarize(raw, flops, nbytes)
    meta = base_meta()
    return {**header(raw["device"], meta["command_line"], meta.get("git_sha")), "versions": meta["versions"],
            "family": problem.family, "shape": shp.spec, "shape_dict": shp.as_dict(), "config": cfg.as_dict(),
            "source_digest": src.digest, "source_origin": origin.origin if origin else "config", "flops": flops,
            "min_bytes": nbytes, "reps": reps, "source": source, **summary, "raw": raw}


def _print_bench(rec: dict) -> None:
    from ..gpu.bench import speedup_text, timing_note

    dev = rec["device"]
    clocks = dev.get("clocks") or {}
    console.print(f"{rec['date']}  {dev.get('name')}  SM clock {clocks.get('sm', '?')} (max {clocks.get('max_sm', '?')}), "
                  f"mem {clocks.get('mem', '?')}  driver {dev.get('driver')}  torch {dev.get('torch')} "
                  f"(CUDA {dev.get('torch_cuda')}, cuDNN {dev.get('cudnn')})  cupy {dev.get('cupy')}  "
                  f"evotune {rec.get('git_sha') or '?'}")
    console.print(f"config: {cfg_short(rec['config'], rec.get('family'))}")
    table = Table(title=f"{rec['shape']}  ({'interleaved' if rec.get('interleaved') else 'solo'} timing)",
                  caption=timing_note(rec, rec["reps"]))
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
                      speedup_text(r))
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
    which: str = WHICH,
    run: Optional[str] = RUN,
    config: Optional[str] = CONFIG,
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape to check on (default: the run's)."),
    space: Optional[str] = CONFIG_SPACE,
    family: Optional[str] = typer.Option(None, "--family", help=FAMILY_HELP + " A run's is its own."),
    launches: int = typer.Option(100, "--launches", min=2, max=MAX_REPS, help="Launches for the bitwise determinism check."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Deep check of one config: the gate (seeds + stress inputs + dependency) and bitwise determinism."""
    from ..gpu.workers import GPUWorker, VerifyJob

    problem, shp, cfg, origin = _resolve_candidate(which, run, config, shape, space, family, "verify", json_out)
    require_gpu("verify")
    _, compiled = _compile_candidate(problem, shp, cfg, origin)
    with GPUWorker(timeout_s=600) as worker:
        rep = worker.call(VerifyJob(family=problem.family, shape=shp.as_dict(), config=cfg, compiled=compiled,
                                    launches=launches, seeds=REPLAY_SEEDS))
    ver, det = rep["verification"], rep["determinism"]
    plausible = rep.get("status", "ok") != "implausible"  # timed below the shape's floor (gpu/plausibility.py)
    ok = ver["passed"] and det["passed"] and plausible
    if json_out:
        emit_json({"shape": shp.spec, "config": cfg.as_dict(), "passed": ok, **rep})
    else:
        console.print(f"{shp.spec}  {cfg_short(cfg.as_dict(), problem.family)}")
        console.print(f"  gate         {'pass' if ver['passed'] else 'FAIL'}: ratio {ver['gate_ratio']:.3g} (worst: "
                      f"{ver['worst_case']}), max abs {ver['max_abs']:.3g}, non-finite {ver['nonfinite']}, "
                      f"patterns {', '.join(ver['patterns'])}")
        console.print(f"  dependency   {ver['dependency']}")
        for label, key in (("guard bands", "guards"), ("inputs", "inputs_intact"), ("repeat", "repeat"),
                           ("timed output", "timed_output")):
            console.print(f"  {label:<12} {ver.get(key, 'not checked')}")
        console.print(f"  determinism  {'pass' if det['passed'] else 'FAIL'}: {det['detail']}")
        if not plausible:
            console.print(f"  plausibility FAIL: {rep['message']}")
        elif not ver["passed"] and rep.get("message"):
            console.print(f"  failed: {rep['message']}")
    if not ok:
        raise EvotuneError(f"{cfg_short(cfg.as_dict(), problem.family)} failed the deep check on {shp.spec}")


@app.command()
def sanitize(
    which: str = WHICH,
    run: Optional[str] = RUN,
    config: Optional[str] = CONFIG,
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape (default: a small ragged one of the run's class)."),
    space: Optional[str] = CONFIG_SPACE,
    family: Optional[str] = typer.Option(None, "--family", help=FAMILY_HELP + " A run's is its own."),
    tool: list[str] = typer.Option(["memcheck", "racecheck", "synccheck"], "--tool", help="Sanitizer tool(s)."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Run compute-sanitizer (memcheck, racecheck, synccheck) on one config and report clean or the finding."""
    from ..gpu.sanitize import TOOLS, run_tool

    for t in tool:
        if t not in TOOLS:
            raise UsageError(f"unknown sanitizer tool {t!r}; tools: {', '.join(TOOLS)}")
    problem, shp, cfg, origin = _resolve_candidate(which, run, config, shape, space, family, "sanitize", json_out)
    if shape is None:  # sanitizers run ~100x slower: a small shape of the same class
        small = problem.sanitize_shape(shp)
        # The archived source is the run's shape's; the small shape's source is the same code only where
        # today's template gives the same digest for both (the shape enters the source through its class).
        if origin is not None and origin.archived and small != shp:
            from ..build.template import instantiate

            if instantiate(problem, cfg, small).digest != instantiate(problem, cfg, shp).digest:
                origin = None
        shp = small
    require_gpu("sanitize")
    _, compiled = _compile_candidate(problem, shp, cfg, origin)
    job = {"family": problem.family, "shape": shp.as_dict(), "config": cfg.as_dict(),
           "compiled": compiled.as_dict()}
    reports = [run_tool(t, job) for t in tool]
    if json_out:
        emit_json({"shape": shp.spec, "config": cfg.as_dict(), "reports": reports})
    else:
        console.print(f"{shp.spec}  {cfg_short(cfg.as_dict(), problem.family)}")
        for r in reports:
            console.print(f"  {r['tool']:<10} {r['summary']}")
            if not r["clean"]:
                console.print(r["output_tail"], markup=False, highlight=False)
    bad = [r["tool"] for r in reports if not r["clean"]]
    if bad:
        raise EvotuneError(f"compute-sanitizer reported findings ({', '.join(bad)}) for "
                           f"{cfg_short(cfg.as_dict(), problem.family)} on {shp.spec}")


@app.command()
def sass(
    which: str = WHICH,
    run: Optional[str] = RUN,
    config: Optional[str] = CONFIG,
    shape: Optional[str] = typer.Option(None, "--shape", help="Shape (default: the run's)."),
    space: Optional[str] = CONFIG_SPACE,
    family: Optional[str] = typer.Option(None, "--family", help=FAMILY_HELP),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="Also write the whole SASS listing here."),
    json_out: bool = typer.Option(False, "--json"),
):
    """Disassemble one config's kernel (no GPU): tensor-core instructions (HGMMA/HMMA), TMA and cp.async loads,
    local memory, with ptxas's registers and spills."""
    from ..build.sass import CLASSES, disassemble, summary

    problem, shp, cfg, origin = _resolve_candidate(which, run, config, shape, space, family, "sass", json_out)
    if output is not None:
        check_output_path(output, "-o")
    _, compiled = _compile_candidate(problem, shp, cfg, origin)
    text = disassemble(compiled.cubin_path)
    info = summary(text)
    res = compiled.resources
    info.update({"shape": shp.spec, "config": cfg.as_dict(), "registers": res.registers,
                 "spill_bytes": res.spill_stores + res.spill_loads, "stack_frame": res.stack_frame, "arch": compiled.arch})
    if output is not None:
        write_output(output, text, "-o")
    if json_out:
        emit_json(info)
        return
    console.print(f"{shp.spec}  {cfg_short(cfg.as_dict(), problem.family)}  ({compiled.arch}, "
                  f"{info['instructions']} instructions)")
    for op, what in CLASSES.items():
        console.print(f"  {op:<8} {info['classes'][op]:>5}  {what}")
    console.print(f"tensor cores: {info['tensor_core']}; local memory instructions: {info['local_memory']}; "
                  f"{res.registers} registers, {info['spill_bytes']} B spilled, {res.stack_frame} B stack frame")
    if info["exp2_under_wgmma"]:
        console.print(f"softmax under the warpgroup's own P V: {max(info['exp2_under_wgmma'])} MUFU.EX2 between the "
                      "wait for S and the wait for P V (0: ptxas put that wait above the softmax)")
    if info["wgmma_issue_gaps"]:
        gaps = info["wgmma_issue_gaps"]
        console.print(f"between a product's wgmma: {sum(gaps)} instructions over {len(gaps)} gaps, at most {max(gaps)} "
                      "(mostly the next k-step's descriptor)")
    if output is not None:
        console.print(f"wrote {output}")
