"""`evotune bench`: a tuned kernel beside every baseline of its family, in one process.

Everything is measured the one way evotune measures (evaluate.time_gpu: CUDA-graph replay
after warm-up, many repetitions, median and p10/p90), on the same inputs, and every
baseline passes the same gate as the kernel. The kernel goes through evaluate_compiled, as in
the search: a kernel whose timed output is not what the gate checked (or that writes outside
its output, changes an input, or differs on a repeat) is reported WRONG with the check that
caught it, and gets no time. Next to the times go the machine's ceilings,
measured in the same process: device-to-device copy bandwidth, the tensor rate of a large
torch.matmul (cuBLAS) in the shape's dtype, and the time of an empty kernel in a graph.
From those, each shape gets its floor: the empty-kernel time plus
max(compulsory bytes / bandwidth, FLOPs / tensor rate).

After those solo timings, when the kernel passed, comes the head-to-head (interleave.py): the
kernel and every available baseline timed again, interleaved in rounds on the same inputs, because
timings taken one after the other carry a drift of 3-6% on the H100 from what ran just before. The
rows' headline times and speedups come from the head-to-head (the solo figure is kept as
solo_time_us), with the spread of the per-round speedup; the kernel's output after it must still be
bitwise the untimed launch's (else it is WRONG). Records without a head-to-head summarize as before.

The GPU parts (`ceilings`, `bench_candidate`) run in a worker process; `floor_analysis`,
`with_head_to_head` (given a timer) and `summarize` run on the CPU in the tests.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from ..records import result as R
from ..records.result import Result, Verification
from .evaluate import DEFAULT_SEEDS, failure_message, with_violation
from .interleave import DEFAULT_ROUNDS, head_to_head, split_reps, time_interleaved
from .plausibility import Floors, ceilings, floor_analysis  # noqa: F401 (bench's API)

BENCH_REPS = 100
OURS = "evotune"            # the kernel's row, and its name among the head-to-head's contenders


def flops_and_bytes(shape, problem=None) -> tuple[float | None, float | None]:
    """The FLOPs and compulsory bytes of one call on `shape`: its family's Problem.work (the contract's way to say
    them); without a problem, the shape's own flops()/min_bytes() as Problem.work's default reads them."""
    if problem is not None:
        return problem.work(shape)
    from ..problems import Problem

    return Problem.work(None, shape)


def bench_candidate(problem, shape, config, compiled, reps: int = BENCH_REPS, seeds=DEFAULT_SEEDS,
                    baselines: list[str] | None = None, rounds: int = DEFAULT_ROUNDS) -> dict:
    """The kernel (gate + time) and every baseline (gate + time), then, if the kernel passed, all of them
    again interleaved (with_head_to_head), and the device's ceilings (runs on the GPU)."""
    raw = kernels_beside_baselines(problem, shape, {OURS: (config, compiled)}, reps, seeds, baselines, rounds=rounds)
    kernel = raw.pop("kernels")[OURS]
    from . import plausibility

    return {"kernel": kernel, **raw, "ceilings": plausibility.FLOORS.ceilings_for(shape)}


def kernels_beside_baselines(problem, shape, kernels: dict, reps: int, seeds, baselines: list[str] | None = None,
                             baselines_first: bool = False, rounds: int = DEFAULT_ROUNDS,
                             floors: Floors | None = None) -> dict:
    """{"kernels": {label: its Result dict}, "baselines": measure_baselines' report[, "head_to_head"]}: each
    kernel (`kernels`: label -> (config, compiled)) and the baselines gated and timed alone (the baselines first
    where `baselines_first`), then the kernels that passed and the baselines all interleaved (with_head_to_head).
    `evotune bench` (one kernel) and the search's closing job (its finalists) both measure this way (runs on the
    GPU). Every kernel's time, solo and interleaved, is judged against the shape's floor (plausibility.py)."""
    from ..build.compile import load_kernel
    from . import evaluate, plausibility

    floors = floors or plausibility.FLOORS

    def measure():
        return evaluate.measure_baselines(problem, shape, names=baselines, seeds=seeds, reps=reps)

    base = measure() if baselines_first else None
    results = {label: plausibility.evaluate_plausible(problem, shape, config, compiled, floors, seeds=seeds, reps=reps)
               for label, (config, compiled) in kernels.items()}
    raw = {"kernels": {label: res.as_dict() for label, res in results.items()},
           "baselines": base if baselines_first else measure()}
    # Modules of their own: evaluate_compiled keeps the one it loaded to itself.
    launches = {label: evaluate.bind_kernel(problem, shape, config,
                                            load_kernel(compiled, problem.geometry(config, shape).dynamic_smem))
                for label, (config, compiled) in kernels.items() if results[label].ok}
    if launches:
        raw = with_head_to_head(raw, problem, shape, launches, reps, rounds, floors=floors)
    return raw


def with_head_to_head(raw: dict, problem, shape, launches: dict, reps: int, rounds: int = DEFAULT_ROUNDS,
                      timer=time_interleaved, floors: Floors | None = None) -> dict:
    """`raw` (the kernels' and the baselines' solo records, as kernels_beside_baselines makes them) with the
    head-to-head: each kernel's `launch_for(inputs, out)` (`launches`: label -> launch_for) and every available
    baseline timed interleaved (interleave.head_to_head, `rounds` rounds of about reps / rounds replays each).
    A kernel whose output after the interleaved timing is not its untimed launch's becomes WRONG (no time),
    naming the timed-output check, and one whose interleaved median is below the shape's floor becomes
    IMPLAUSIBLE (`floors`). `winner`: the passing kernel with the fastest median; `ours_speedup`: per
    baseline, the per-round speedup of the winner (the baseline's time over its) with median, min and max."""
    from . import plausibility

    floors = floors or plausibility.FLOORS
    names = [n for n, b in raw["baselines"].items() if b.get("available")]
    result, failures = head_to_head(problem, shape, launches, names, rounds, split_reps(reps, rounds), timer)
    kernels = dict(raw["kernels"])
    for label, violation in failures.items():
        res = Result.from_dict(kernels[label])
        check = with_violation(Verification.from_dict(res.verification), violation)
        kernels[label] = replace(res, status=R.WRONG, message=failure_message(check), time_us=None, timing=None,
                                 verification=check.as_dict()).as_dict()
    for label in launches:
        if label in failures or not result or label not in result.timings:
            continue
        judged = floors.judge(shape, replace(Result.from_dict(kernels[label]),
                                             time_us=result.timings[label].median_us))
        if not judged.ok:
            failures[label] = judged.message
            kernels[label] = replace(judged, timing=None).as_dict()
    raw = {**raw, "kernels": kernels}
    timed = [label for label in launches if label not in failures and result and label in result.timings]
    if not timed:
        return raw
    winner = min(timed, key=lambda label: result.timings[label].median_us)
    h2h = result.as_dict()
    h2h["winner"] = winner
    h2h["ours_speedup"] = {n: result.ratios(winner, n) for n in names if n in result.timings}
    h2h["timed_output"] = ("O after the interleaved timing over rotating input sets bitwise equal to an untimed "
                           "launch on the last set; an audit replay on a changed input passes the gate on it")
    return {**raw, "head_to_head": h2h}


def summarize(raw: dict, flops: float | None, nbytes: float | None) -> dict:
    """Rows (kernel first, then each baseline) with TFLOP/s, GB/s and speedups, plus the floor analysis.
    Times are the head-to-head's where the record has one (the solo time stays as solo_time_us)."""
    kernel = raw["kernel"]
    ceil = raw["ceilings"]
    floor = floor_analysis(flops, nbytes, ceil)
    h2h = raw.get("head_to_head") or {}
    paired, spreads = h2h.get("timings") or {}, h2h.get("ours_speedup") or {}
    ok = kernel.get("status") == "ok"
    t_ours = (paired[OURS]["median_us"] if OURS in paired else kernel.get("time_us")) if ok else None
    rows = []

    def row(name: str, solo_us, solo_timing, verification, available=True, reason=""):
        timing = paired.get(name) if available else None
        time_us = timing["median_us"] if timing else solo_us
        timing = timing or solo_timing
        spread = spreads.get(name) or {}
        r = {"name": name, "available": available, "reason": reason, "time_us": time_us,
             "p10_us": (timing or {}).get("p10_us"), "p90_us": (timing or {}).get("p90_us"),
             "solo_time_us": solo_us, "interleaved": name in paired and available,
             "tflop_s": flops / time_us / 1e6 if (flops and time_us) else None,
             "gb_s": nbytes / time_us / 1e3 if (nbytes and time_us) else None,
             "gate_ratio": (verification or {}).get("gate_ratio"),
             "max_abs": (verification or {}).get("max_abs"),
             "passed": (verification or {}).get("passed")}
        # speedup of ours over this row (>1: ours is faster); the ratio the targets are stated in.
        r["ours_speedup"] = time_us / t_ours if (time_us and t_ours) else None
        # its spread over the head-to-head's rounds (per round: this row's median over ours)
        r["ours_speedup_min"], r["ours_speedup_max"] = spread.get("min"), spread.get("max")
        r["vs_floor"] = time_us / floor["floor_us"] if time_us else None
        rows.append(r)

    row(OURS, kernel.get("time_us") if ok else None, kernel.get("timing"), kernel.get("verification"),
        available=ok, reason="" if ok else f"{kernel.get('status')}: {kernel.get('message', '')}")
    for name, b in raw["baselines"].items():
        if not b.get("available"):
            row(name, None, None, None, available=False, reason=b.get("reason", ""))
        else:
            row(name, b["time_us"], b.get("timing"), b.get("verification"))
    avail = [r for r in rows[1:] if r["time_us"]]
    best_base = min(avail, key=lambda r: r["time_us"]) if avail else None
    return {"rows": rows, "floor": floor, "ceilings": ceil,
            "interleaved": ({"rounds": h2h["rounds"], "reps_per_round": h2h["reps_per_round"]} if paired else None),
            "best_baseline": best_base["name"] if best_base else None,
            "ours_over_best_baseline": (t_ours / best_base["time_us"]) if (t_ours and best_base) else None}


def speedup_text(row: dict) -> str:
    """A row's "ours faster by": "1.05x", with the head-to-head's spread over rounds where it has one."""
    if not row.get("ours_speedup"):
        return "-"
    text = f"{row['ours_speedup']:.2f}x"
    if row.get("ours_speedup_min") is not None:
        text += f" ({row['ours_speedup_min']:.2f}-{row['ours_speedup_max']:.2f})"
    return text


def timing_note(summary: dict, reps: int) -> str:
    """How a bench record's times were taken, in one short line."""
    il = summary.get("interleaved")
    if not il:
        return f"{reps} CUDA-graph replays each, one kernel after another; medians"
    return f"interleaved: {il['rounds']} rounds x {il['reps_per_round']} replays per kernel; (min-max) over rounds"


def header(device: dict, command: str, sha: str | None) -> dict:
    return {"date": dt.date.today().isoformat(), "device": device, "command": command, "git_sha": sha}
