"""Verify and time one candidate on the GPU. The one verification function and the one
timing function here are used by search, replay, bench and the GPU tests alike.

Verification: fresh random inputs per seed (never zeros), the output poisoned with NaN
before the checked launch, max-abs / max-rel error and a count of non-finite outputs
against an fp32 reference. Timing: CUDA events around CUDA-graph replays of many
back-to-back launches, after warm-up; median and p10/p90 over the replays.
"""

from __future__ import annotations

import math
import statistics
import time

from . import result as R
from .compile import Compiled, load_kernel, static_violations
from .result import Result, Timing, Verification

DEFAULT_SEEDS = (1, 2, 3)
TIMING_SEED = 1000
# Aim for replays of about this much GPU time, so event resolution (~0.5 us) and
# per-replay launch cost vanish against the measured work.
TARGET_REPLAY_US = 400.0
DEFAULT_REPS = 40


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_gpu(fn, reps: int = DEFAULT_REPS, launches_per_rep: int | None = None, warmup: int = 10) -> Timing:
    """Per-call GPU time of `fn` (which launches work on torch's current stream)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    if launches_per_rep is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        estimate_us = max(start.elapsed_time(end) * 1000.0 / 20, 1.0)
        launches_per_rep = int(min(500, max(1, math.ceil(TARGET_REPLAY_US / estimate_us))))

    method = "cuda-graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(launches_per_rep):
                fn()
        run_rep = graph.replay
    except Exception:  # some launches cannot be captured: time them back to back instead
        torch.cuda.synchronize()
        method = "stream"

        def run_rep():
            for _ in range(launches_per_rep):
                fn()

    for _ in range(3):
        run_rep()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        run_rep()
        e.record()
    torch.cuda.synchronize()
    per_call = [s.elapsed_time(e) * 1000.0 / launches_per_rep for s, e in zip(starts, ends)]
    return Timing(median_us=statistics.median(per_call), p10_us=_percentile(per_call, 0.1),
                  p90_us=_percentile(per_call, 0.9), reps=reps, launches_per_rep=launches_per_rep, method=method)


def output_errors(out, ref, atol: float, rtol: float) -> tuple[float, float, int, float]:
    """(max |out-ref|, that over max |ref|, count of non-finite outputs, gate ratio).

    The gate ratio is max |out-ref| / (atol + rtol*|ref|) elementwise (the caller scales
    atol to the inputs' magnitude); errors are inf
    when any output is non-finite.
    """
    import torch

    outf = out.float()
    nonfinite = int((~torch.isfinite(outf)).sum().item())
    if nonfinite:
        return math.inf, math.inf, nonfinite, math.inf
    diff = (outf - ref).abs()
    max_abs = float(diff.max().item())
    ratio = float((diff / (atol + rtol * ref.abs())).max().item())
    ref_max = float(ref.abs().max().item())
    return max_abs, max_abs / max(ref_max, 1e-30), 0, ratio


def gate_cases(problem, seeds=DEFAULT_SEEDS) -> list[tuple[int, str]]:
    """(seed, input pattern) pairs of the gate: fresh N(0,1) inputs per seed, then each stress pattern once."""
    stress = [p for p in getattr(problem, "PATTERNS", ("normal",)) if p != "normal"]
    return [(seed, "normal") for seed in seeds] + [(seeds[0] + 100 + i, p) for i, p in enumerate(stress)]


def _error_scale(problem, inputs) -> float:
    return problem.error_scale(inputs) if hasattr(problem, "error_scale") else 1.0


def _run_poisoned(problem, run_into, inputs):
    import torch

    out = problem.new_output(inputs)
    out.fill_(float("nan"))
    run_into(inputs, out)
    torch.cuda.synchronize()
    return out


def check_dependency(problem, shape, run_into, seed: int = 11) -> tuple[bool, str]:
    """Perturb one input (problem.perturb picks it: one key/value row, one element of a row, ...):
    the output rows that must see it change, every other row stays bitwise equal. A row is the
    output's last dimension; the problem's mask covers all the others.

    A row counts as "must change" where the fp32 reference moves by more than the gate's
    tolerance, so a legitimately tiny influence is not demanded of the kernel.
    """
    inputs = problem.make_inputs(shape, seed)
    changed_inputs, may_change = problem.perturb(shape, inputs)
    out1 = _run_poisoned(problem, run_into, inputs)
    out2 = _run_poisoned(problem, run_into, changed_inputs)
    atol, rtol = problem.tolerance(shape)
    atol *= _error_scale(problem, inputs)
    ref1, ref2 = problem.reference(shape, inputs), problem.reference(shape, changed_inputs)
    moved = (out1 != out2).any(dim=-1)
    clearly = ((ref2 - ref1).abs() > atol + rtol * ref1.abs()).any(dim=-1) & may_change
    stray = int((moved & ~may_change).sum().item())
    missed = int((clearly & ~moved).sum().item())
    what = getattr(problem, "perturbed", "input")
    if not bool(may_change.any()):  # no output can see it on this shape (a softmax row of one element): none may move
        if stray:
            return False, f"{stray} rows changed though no output can see the perturbed {what}"
        return True, f"no output can see the perturbed {what} on this shape; all rows bitwise unchanged"
    if not bool(clearly.any()):
        return False, "the perturbation moved no reference row beyond the tolerance (test is too weak)"
    if stray or missed:
        return False, f"{stray} rows changed that cannot see the perturbed {what}; {missed} rows that see it did not change"
    return True, f"{int(clearly.sum().item())} rows followed the perturbed {what}; all others bitwise unchanged"


def check_determinism(problem, shape, run_into, launches: int = 100, seed: int = 12) -> tuple[bool, str]:
    """The output is bitwise identical across `launches` launches on the same inputs."""
    import torch

    inputs = problem.make_inputs(shape, seed)
    first = _run_poisoned(problem, run_into, inputs)
    out = problem.new_output(inputs)
    differing = 0
    for _ in range(launches - 1):
        out.fill_(float("nan"))
        run_into(inputs, out)
        differing += int(not torch.equal(out, first))
    torch.cuda.synchronize()
    if differing:
        return False, f"{differing} of {launches - 1} repeated launches differ from the first"
    return True, f"{launches} launches bitwise identical"


def verify(problem, shape, run_into, seeds=DEFAULT_SEEDS, dependency: bool = True) -> Verification:
    """The correctness gate for `run_into(inputs, out)`, which must write its result into `out`.

    Every case draws fresh inputs and fills `out` with NaN first, so an element left
    unwritten shows up as non-finite; errors are against the fp32 reference. Then, with
    `dependency`, one input is perturbed and the right rows must move (check_dependency).
    """
    atol, rtol = problem.tolerance(shape)
    max_abs = max_rel = ratio = 0.0
    nonfinite = 0
    worst_case = ""
    cases = gate_cases(problem, seeds)
    per_case = {}
    for seed, pattern in cases:
        inputs = problem.make_inputs(shape, seed, pattern=pattern)
        out = _run_poisoned(problem, run_into, inputs)
        case_abs, case_rel, case_nonfinite, case_ratio = output_errors(
            out, problem.reference(shape, inputs), atol * _error_scale(problem, inputs), rtol)
        per_case[f"{seed}:{pattern}"] = case_ratio
        if case_ratio >= ratio:
            ratio, worst_case = case_ratio, f"seed {seed} {pattern}"
        nonfinite = max(nonfinite, case_nonfinite)
        # Reported errors (and the search's error objective) are those of the N(0,1) inputs;
        # the stress patterns, whose |O| reaches ~100, count through the gate ratio.
        if pattern == "normal" or case_nonfinite:
            max_abs, max_rel = max(max_abs, case_abs), max(max_rel, case_rel)
    dep_ok, dep_msg = check_dependency(problem, shape, run_into) if dependency else (True, "not checked")
    return Verification(max_abs=max_abs, max_rel=max_rel, nonfinite=nonfinite, gate_ratio=ratio,
                        seeds=tuple(seeds), atol=atol, rtol=rtol,
                        passed=nonfinite == 0 and ratio <= 1.0 and dep_ok,
                        patterns=tuple(sorted({p for _, p in cases})), worst_case=worst_case, case_ratios=per_case,
                        dependency=dep_msg if dep_ok else "FAILED: " + dep_msg)


def kernel_runner(problem, shape, config, kernel):
    """`run_into(inputs, out)` for a loaded candidate kernel."""

    def run_into(inputs, out):
        problem.launcher(kernel, config, shape, inputs, out)()

    return run_into


def evaluate_compiled(problem, shape, config, compiled: Compiled, seeds=DEFAULT_SEEDS, reps: int = DEFAULT_REPS,
                      time_it: bool = True) -> Result:
    """Gate and time one compiled candidate. Raises on CUDA faults (the worker decides what they poison)."""
    geo = problem.geometry(config, shape)
    why = static_violations(compiled.resources, geo.threads, geo.dynamic_smem)
    resources = compiled.resources.as_dict()
    if why:
        return Result(status=R.PRUNED, message="; ".join(why), resources=resources,
                      compile_seconds=compiled.compile_seconds)
    # Where a candidate's GPU-side seconds go (the search's throughput depends on it): recorded in extra.
    clock = [time.perf_counter()]
    phases: dict[str, float] = {}

    def lap(name: str) -> None:
        now = time.perf_counter()
        phases[name] = round(now - clock[0], 4)
        clock[0] = now

    kernel = load_kernel(compiled, geo.dynamic_smem)
    lap("load")
    check = verify(problem, shape, kernel_runner(problem, shape, config, kernel), seeds)
    lap("verify")
    if not check.passed:
        if check.nonfinite:
            msg = f"{check.nonfinite} non-finite outputs (NaN poison left or computed) in {check.worst_case}"
        elif check.gate_ratio > 1.0:
            msg = (f"error {check.gate_ratio:.3g}x the gate in {check.worst_case} (max abs {check.max_abs:.3g}; "
                   f"atol {check.atol:g}, rtol {check.rtol:g})")
        else:
            msg = f"dependency check {check.dependency}"
        return Result(status=R.WRONG, message=msg, max_abs=check.max_abs, verification=check.as_dict(),
                      resources=resources, compile_seconds=compiled.compile_seconds, extra={"eval_seconds": phases})
    timing = None
    if time_it:
        inputs = problem.make_inputs(shape, TIMING_SEED)
        out = problem.new_output(inputs)
        timing = time_gpu(problem.launcher(kernel, config, shape, inputs, out), reps=reps)
        lap("time")
    return Result(status=R.OK, time_us=timing.median_us if timing else None, max_abs=check.max_abs,
                  timing=timing.as_dict() if timing else None, verification=check.as_dict(), resources=resources,
                  compile_seconds=compiled.compile_seconds, extra={"eval_seconds": phases})


def measure_baselines(problem, shape, names=None, seeds=DEFAULT_SEEDS, reps: int = DEFAULT_REPS) -> dict:
    """Error and time of each of the problem's baselines (SDPA backends, torch.softmax), measured like a candidate."""
    import torch

    names = names or problem.baselines()
    report = {}
    timing_inputs = problem.make_inputs(shape, TIMING_SEED)
    for name in names:
        skip = problem.baseline_skip_reason(name, shape) if hasattr(problem, "baseline_skip_reason") else None
        if skip:
            report[name] = {"available": False, "reason": skip}
            continue
        probe = problem.baseline_launcher(name, shape, timing_inputs)
        if probe is None:
            report[name] = {"available": False, "reason": "backend does not support this shape here"}
            continue

        def run_into(inputs, out, name=name):
            out.copy_(problem.baseline_launcher(name, shape, inputs, probe=False)())

        check = verify(problem, shape, run_into, seeds)
        timing = time_gpu(probe, reps=reps)
        report[name] = {"available": True, "time_us": timing.median_us, "timing": timing.as_dict(),
                        "verification": check.as_dict()}
        del probe
        torch.cuda.synchronize()
    return report
