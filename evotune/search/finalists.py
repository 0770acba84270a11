"""The search's closing job: its finalists (records.best: up to FINALISTS of the fastest recorded trials, within
FINALIST_WITHIN of the fastest) timed again beside the family's baselines in one GPU worker process, all of them
interleaved at the end (gpu.bench.kernels_beside_baselines), written as the run's baselines.json; the finalist
with the fastest interleaved median becomes the run's best. Apart from the loop (loop.py): it runs once, after
the search, and touches the GPU only through the worker's `call`."""

from __future__ import annotations

from typing import Callable

from ..build.compile import CompileError, compile_source
from ..build.template import KernelSource, instantiate
from ..records import result as R
from ..records.best import (BASELINES_FILE, BESIDE_KIND, FINALIST_WITHIN, FINALISTS, finalists, read_beside, rule_of,
                            same_finalists)
from ..records.runs import Run
from ..space.searchspace import Config

BESIDE_VERSION = 3        # 2: the kernel and the baselines timed interleaved; 3: the finalists, interleaved
BESIDE_REPS = 100        # as `evotune bench`: the best and the route rest on these medians
BESIDE_TIMEOUT_S = 900.0  # every baseline's gate and timing, then the finalists', in one job


def measure_beside_best(run: Run, problem, shape, call: Callable[..., dict], reps: int = BESIDE_REPS,
                        seeds=(1, 2, 3), compiler: Callable[[Config, KernelSource], object] | None = None,
                        count: int = FINALISTS) -> dict:
    """Time the family's baselines (evaluate.measure_baselines) and then the run's finalists (records.best:
    up to `count` of the fastest recorded trials, within FINALIST_WITHIN of the fastest) in one GPU worker
    process on the same inputs, all of them at the end interleaved; write runs/<run>/baselines.json. The
    finalist with the fastest interleaved median becomes the run's best (records.best.final_best), and the
    tuning table's route compares its median with the baselines'.

    Done when a search ends: only then are the finalists known. Once per set of finalists: where
    baselines.json already re-timed exactly these (a resumed run that found no new contender, or another agent
    of the run), nothing is measured again; a resume that found one replaces the file.
    `call(job, timeout_s=...)` is a GPUWorker's call. Returns {"status": "measured" | "kept" | "skipped" |
    "failed", "message", "path"}; a failed measurement never fails the search (the best stays the fastest
    recorded trial, and the table says "unverified")."""
    from ..gpu.workers import BesideJob, WorkerError

    path = run.path / BASELINES_FILE
    records = run.trials()
    finals = finalists(records, count)
    if not finals:
        return {"status": "skipped", "message": "no trial passed the gate: no config to time beside the baselines",
                "path": None}
    known = read_beside(run.path)
    if known is not None and rule_of(known) == (count, FINALIST_WITHIN) and same_finalists(known, records):
        return {"status": "kept", "message": f"{path} already re-timed these {len(finals)} finalists beside the "
                                             f"baselines", "path": str(path)}
    configs = [Config.from_dict(f["config"]) for f in finals]
    sources = [instantiate(problem, c, shape) for c in configs]
    labels = [f"trial {f['number']}" for f in finals]
    try:
        compileds = [compiler(c, src) if compiler else compile_source(src.code, src.entry)
                     for c, src in zip(configs, sources)]
        payload = call(BesideJob(family=problem.family, shape=shape.as_dict(), labels=labels, configs=configs,
                                 compileds=compileds, reps=reps, seeds=tuple(seeds)), timeout_s=BESIDE_TIMEOUT_S)
    except (CompileError, WorkerError) as e:
        return {"status": "failed", "message": f"{len(finals)} finalists not re-timed beside the baselines: {e}",
                "path": None}
    record = beside_record(run, finals, labels, [s.digest for s in sources], payload, reps, seeds, count)
    run.write_json(BASELINES_FILE, record)
    run.update_summary()  # best.json: the finalists' winner
    return {"status": "measured", "message": beside_summary(record), "path": str(path)}


def beside_record(run: Run, finals: list[dict], labels: list[str], source_digests: list[str], payload: dict,
                  reps: int, seeds, count: int = FINALISTS) -> dict:
    """What baselines.json holds: the baselines' rows, each finalist's re-timed result and interleaved median,
    the best (the finalist with the fastest interleaved median; where none was timed interleaved, the fastest
    recorded, without "interleaved_us"), and what was measured how."""
    import datetime as dt

    from ..records.runs import base_meta

    h2h = payload.get("head_to_head") or {}
    timings = h2h.get("timings") or {}
    results = payload.get("finalists") or {}
    entries = []
    for f, label, source_digest in zip(finals, labels, source_digests):
        median = (timings.get(label) or {}).get("median_us")
        result = results.get(label) or {"status": R.CRASHED, "message": "the job returned no result"}
        entries.append({"label": label, "number": f["number"], "digest": f.get("digest"), "config": f["config"],
                        "source_digest": source_digest, "recorded_time_us": f["result"].get("time_us"),
                        "status": result.get("status"),
                        "interleaved_us": median if result.get("status") == R.OK else None, "result": result})
    winner = h2h.get("winner")
    best = next((e for e in entries if e["label"] == winner and e["interleaved_us"] is not None), None)
    if best is None:
        best = {**entries[0], "interleaved_us": None}
    return {"version": BESIDE_VERSION, "kind": BESIDE_KIND, "run": run.run_id,
            "measured_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": payload.get("device"), "versions": base_meta().get("versions"), "reps": reps,
            "seeds": list(seeds), "finalist_rule": {"count": count, "within": FINALIST_WITHIN},
            "finalists": [{k: v for k, v in e.items() if k != "result"} for e in entries],
            "best": {k: v for k, v in best.items() if k != "result"}, "evotune": best["result"],
            "baselines": payload["baselines"], "head_to_head": payload.get("head_to_head")}


def beside_summary(record: dict) -> str:
    """One line: the finalists' winner (interleaved median) against the fastest baseline that passed the gate."""
    from ..records.tuning_table import beside_times

    ours = record["evotune"]
    ours_us, paired = beside_times(record)
    finals = record.get("finalists") or []
    best = record["best"]
    if best.get("interleaved_us") is not None and len(finals) > 1:
        rank = sorted(finals, key=lambda f: f["recorded_time_us"]).index(
            next(f for f in finals if f["label"] == best["label"])) + 1
        mine = (f"trial {best['number']} {ours_us:.2f} us (fastest of {len(finals)} finalists re-timed "
                f"interleaved; #{rank} by its search time)")
    elif ours.get("status") == R.OK:
        mine = f"trial {best['number']} {ours_us:.2f} us"
    else:
        mine = f"trial {best['number']} {ours.get('status')} on re-timing"
    rows = [(name, paired.get(name, row["time_us"])) for name, row in record["baselines"].items()
            if row.get("available") and (row.get("verification") or {}).get("passed")]
    if not rows:
        return f"{mine}; no baseline passed the gate"
    name, t = min(rows, key=lambda r: r[1])
    return f"{mine} beside {name} {t:.2f} us (fastest baseline that passed the gate)"
