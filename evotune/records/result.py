"""The outcome of one trial, as recorded in runs/<id>/trials.jsonl."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# Every way a candidate can end. Only OK results have objectives and can be "best".
OK = "ok"
PRUNED = "pruned"              # rejected by the space's constraints or the static resource gate
COMPILE_ERROR = "compile_error"
LAUNCH_ERROR = "launch_error"  # the launch failed or faulted (e.g. illegal address)
WRONG = "wrong"                # ran, but failed the correctness gate
TIMEOUT = "timeout"            # the worker did not answer in time (hang) and was killed
CRASHED = "crashed"            # the worker process died
# Passed the gate but timed below the shape's physical floor on this GPU (gpu/plausibility.py): it did not
# do the work it was timed on, however it got past the checks. Never best, never in a table.
IMPLAUSIBLE = "implausible"
STATUSES = (OK, PRUNED, COMPILE_ERROR, LAUNCH_ERROR, WRONG, TIMEOUT, CRASHED, IMPLAUSIBLE)

# The checks of the correctness gate (evaluate.py), as a WRONG result's message and
# Verification.failed_check name them.
NONFINITE = "non-finite"            # NaN/Inf in the output (the NaN poison left, or computed)
ERROR = "error"                     # |out - ref| beyond the tolerance
DEPENDENCY = "dependency"           # the output does not follow a perturbed input
REPEAT = "repeat"                   # repeated launches on the same inputs differ
INPUT_MUTATED = "input mutated"     # a launch changed an input tensor
WRITE_OUTSIDE = "write outside O"   # a launch wrote into a guard band before or after the output
TIMED_OUTPUT = "timed output"       # the output of the timed launches is not the output the gate checked
CHANGED_INPUT = "changed input"     # the timed launches, replayed on a changed timing input, did not follow it
CHECKS = (NONFINITE, ERROR, DEPENDENCY, REPEAT, INPUT_MUTATED, WRITE_OUTSIDE, TIMED_OUTPUT, CHANGED_INPUT)


@dataclass(frozen=True)
class Timing:
    """Per-launch GPU time from CUDA events around graph replays (microseconds)."""

    median_us: float
    p10_us: float
    p90_us: float
    reps: int
    launches_per_rep: int
    method: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Verification:
    """Errors of one output against the fp32 reference, worst over all checked seeds."""

    max_abs: float            # worst over the N(0,1) cases (stress patterns count through gate_ratio)
    max_rel: float            # max |out - ref| / max |ref|, same cases
    nonfinite: int            # NaN/Inf in the output, unwritten (NaN-poisoned) elements included
    gate_ratio: float         # max |out - ref| / (atol + rtol*|ref|): the gate passes at <= 1
    seeds: tuple[int, ...]
    atol: float
    rtol: float
    passed: bool
    patterns: tuple[str, ...] = ("normal",)  # input patterns checked (see the problem's make_inputs)
    worst_case: str = ""                     # the (seed, pattern) with the largest gate ratio
    dependency: str = "not checked"          # outcome of the perturb-one-key check
    case_ratios: dict | None = None          # gate ratio of every "seed:pattern" case
    # The launch-integrity checks (evaluate.py). Records written before they existed load with "not checked".
    guards: str = "not checked"              # nothing written in the guard bands before and after O
    inputs_intact: str = "not checked"       # every input tensor bitwise unchanged by every checked launch
    repeat: str = "not checked"              # repeated launches, O refilled between them, bitwise identical
    timed_output: str = "not checked"        # O after rotating timing equals an untimed launch; the audit replay
                                             # on a changed input follows it
    failed_check: str = ""                   # the check that failed first (CHECKS), "" when passed

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["seeds"] = list(self.seeds)
        d["patterns"] = list(self.patterns)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Verification":
        """A recorded verification, old records (without the later fields) included."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        values["seeds"] = tuple(values.get("seeds") or ())
        values["patterns"] = tuple(values.get("patterns") or ("normal",))
        return cls(**values)


@dataclass(frozen=True)
class Result:
    status: str
    message: str = ""
    time_us: float | None = None
    max_abs: float | None = None
    timing: dict | None = None
    verification: dict | None = None
    resources: dict | None = None
    compile_seconds: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "Result":
        return cls(**{k: d.get(k) for k in ("status", "message", "time_us", "max_abs", "timing", "verification",
                                           "resources", "compile_seconds")}, extra=d.get("extra") or {})
