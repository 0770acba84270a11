"""GPU worker processes. The search process never touches the GPU: it sends jobs to a
worker and waits with a deadline. A worker that hangs is killed (TIMEOUT), one that
dies is reported (CRASHED), and one whose candidate raised a CUDA error exits after
answering, because such an error can poison its CUDA context; the next job gets a
fresh worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, ClassVar

from ..records import result as R
from ..records.result import Result

if TYPE_CHECKING:
    from ..build.compile import Compiled
    from ..space.searchspace import Config

# A fresh worker imports torch and CuPy and creates a context: allow for it once.
STARTUP_GRACE_S = 120.0


# --------------------------------------------------------------------------- jobs: typed here, plain data on the pipe

DEFAULT_SEEDS = (1, 2, 3)
# The deep check's timed-output check needs a timing, not a precise one: a few replays.
VERIFY_TIMING_REPS = 5


class Job(Mapping):
    """A job for a GPU worker. Built typed; crosses the pipe as plain data (as_dict, read back by job_from_dict).

    A job also reads as its plain-data form (job["kind"], dict(job), == a dict), so that stand-ins for a
    GPUWorker that take jobs as dicts take the typed ones unchanged."""

    kind: ClassVar[str] = ""

    def as_dict(self) -> dict:
        return {"kind": self.kind, **{f.name: _plain(getattr(self, f.name)) for f in fields(self)}}

    @classmethod
    def from_dict(cls, d: dict) -> "Job":
        """The job a plain-data form describes; keys it lacks take the field's default (older senders)."""
        from ..space.searchspace import Config

        parse = {"config": Config.from_dict, "compiled": lambda c: _compiled_from_dict(c), "seeds": tuple,
                 "configs": lambda cs: [Config.from_dict(c) for c in cs],
                 "compileds": lambda cs: [_compiled_from_dict(c) for c in cs]}
        kw = {}
        for f in fields(cls):
            if f.name not in d or (f.name == "seeds" and not d[f.name]):  # no seeds: the default ones
                continue
            kw[f.name] = parse.get(f.name, lambda v: v)(d[f.name])
        return cls(**kw)

    def __getitem__(self, key):
        return self.as_dict()[key]

    def __iter__(self):
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


@dataclass(frozen=True, eq=False)  # eq: Mapping's (the plain-data forms compare)
class InfoJob(Job):
    """The GPU and the software driving it (device_info), for a run's meta.json."""

    kind: ClassVar[str] = "info"


@dataclass(frozen=True, eq=False)
class EvaluateJob(Job):
    """One search candidate through the gate and the timing (evaluate.evaluate_compiled)."""

    kind: ClassVar[str] = "evaluate"
    family: str
    shape: dict               # problem.shape_from_dict reads it, once the family's problem is known
    config: Config
    compiled: Compiled
    seeds: tuple = DEFAULT_SEEDS
    reps: int = 40
    time_it: bool = True


@dataclass(frozen=True, eq=False)
class VerifyJob(Job):
    """`evotune verify`: the gate and timed-output check, then bitwise determinism over many launches."""

    kind: ClassVar[str] = "verify"
    family: str
    shape: dict
    config: Config
    compiled: Compiled
    seeds: tuple = DEFAULT_SEEDS
    reps: int = VERIFY_TIMING_REPS
    launches: int = 100


@dataclass(frozen=True, eq=False)
class BaselinesJob(Job):
    """The family's baselines gated and timed (evaluate.measure_baselines); names None: all of them."""

    kind: ClassVar[str] = "baselines"
    family: str
    shape: dict
    names: list | None = None
    reps: int = 40


@dataclass(frozen=True, eq=False)
class BenchJob(Job):
    """`evotune bench`: the candidate beside the baselines (bench.bench_candidate), with the clocks."""

    kind: ClassVar[str] = "bench"
    family: str
    shape: dict
    config: Config
    compiled: Compiled
    reps: int = 100
    seeds: tuple = DEFAULT_SEEDS
    names: list | None = None


@dataclass(frozen=True, eq=False)
class BesideJob(Job):
    """search.finalists.measure_beside_best: the baselines, then the run's finalists (labels[i]: configs[i] compiled as
    compileds[i]), in one process on the same inputs, all timed interleaved at the end."""

    kind: ClassVar[str] = "beside"
    family: str
    shape: dict
    labels: list
    configs: list
    compileds: list
    reps: int = 100
    seeds: tuple = DEFAULT_SEEDS
    names: list | None = None


def _plain(value):
    """A job field as plain data: a Config or a Compiled as its dict (also in a list), seeds as a list."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def builtin_data(value):
    """An answer as builtin types only, so that unpickling it in the search process imports nothing.

    A str subclass is the trap: torch.__version__ is a torch.torch_version.TorchVersion, and unpickling one
    imports torch, which made the search process spend 3.6-5.3 s (measured on the H100 host) in `import torch`
    on the device info, the first answer of every search's worker. numpy scalars likewise import numpy."""
    import numbers

    if isinstance(value, dict):
        return {builtin_data(k): builtin_data(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(builtin_data(v) for v in value)
    if isinstance(value, (list, tuple)):  # a named tuple, a list subclass
        return [builtin_data(v) for v in value]
    if value is None or type(value) in (str, int, float, bool, bytes):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
        return builtin_data(value.item())  # a numpy scalar that is not a number (numpy.bool_)
    return value


JOB_TYPES: dict[str, type[Job]] = {t.kind: t for t in (InfoJob, EvaluateJob, VerifyJob, BaselinesJob, BenchJob,
                                                         BesideJob)}


def job_from_dict(d: dict) -> Job:
    try:
        kind = JOB_TYPES[d["kind"]]
    except KeyError:
        raise ValueError(f"unknown job kind {d.get('kind')!r}") from None
    return kind.from_dict(d)


def _wire(job: Job | dict) -> dict:
    """What crosses the pipe: plain data (a legacy dict job goes as it is)."""
    return job.as_dict() if isinstance(job, Job) else job


def _compiled_from_dict(d: dict):
    """Compiled.from_dict, looked up by name when a job is read (the CPU tests swap it)."""
    from ..build.compile import Compiled

    return Compiled.from_dict(d)


def compiled_to_dict(c) -> dict:
    """Compiled.as_dict, for callers that import it from here."""
    return c.as_dict()


def device_info(phases=None) -> dict:
    """What a run's meta.json records about the GPU and the software driving it; `phases` (an evaluate.Phases)
    gets what each part took (a search's timeline shows them: they are part of every worker's start)."""
    import cupy
    import torch

    from .evaluate import Phases

    phases = phases or Phases()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    phases.lap("device properties")
    driver = cupy.cuda.runtime.driverGetVersion()
    phases.lap("CUDA driver version")
    driver_string = _driver_string()
    phases.lap("driver version")
    cudnn = torch.backends.cudnn.version()
    phases.lap("cuDNN version")
    return {
        "name": props.name,
        "sm": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gb": round(props.total_memory / 2**30, 1),
        "driver": driver_string,
        "cuda_driver_api": f"{driver // 1000}.{driver % 1000 // 10}",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": cudnn,
        "cupy": cupy.__version__,
    }


def gpu_clocks() -> dict:
    """SM and memory clocks now and at most, and the power limit, as nvidia-smi reports them
    (read, never set: evotune leaves the GPU's clocks alone)."""
    fields = ("clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem", "power.limit")
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        values = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
        return {"clocks": dict(zip(("sm", "max_sm", "mem", "max_mem", "power_limit"), values))}
    except Exception:
        return {"clocks": None}


DRIVER_PROC_FILE = "/proc/driver/nvidia/version"  # Linux: the loaded kernel module's version, read in microseconds


def driver_from_proc(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version's text ("... Kernel Module [for x86_64]  580.159.04 ...")."""
    import re

    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def _driver_string() -> str:
    # The kernel module's own file first: nvidia-smi costs a process start and an NVML init (part of every
    # search's worker start, before the first candidate can be measured).
    try:
        with open(DRIVER_PROC_FILE) as f:
            found = driver_from_proc(f.read())
        if found:
            return found
    except OSError:
        pass
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except Exception:
        return "unknown"


def _handle(job: Job | dict) -> dict:
    """The worker's answer to one job (as plain data for the pipe)."""
    job = job_from_dict(job) if isinstance(job, dict) else job
    return _HANDLERS[type(job)](job)


def _problem_shape(job: Job):
    from ..problems import get_problem

    problem = get_problem(job.family)
    return problem, problem.shape_from_dict(job.shape)


INFO_TIMING_KEY = "_timing"  # an InfoJob answer's own timing, taken off by GPUWorker.info


def _info_job(job: InfoJob) -> dict:
    import time

    from .evaluate import Phases

    received, phases = time.time(), Phases()
    info = device_info(phases)
    return {**info, INFO_TIMING_KEY: {"seconds": phases.as_dict(), "received": received, "answered": time.time()}}


def _evaluate_job(job: EvaluateJob) -> dict:
    from .plausibility import evaluate_plausible

    problem, shape = _problem_shape(job)
    res = evaluate_plausible(problem, shape, job.config, job.compiled, seeds=job.seeds, reps=job.reps,
                             time_it=job.time_it)
    return res.as_dict()


def _baselines_job(job: BaselinesJob) -> dict:
    from .evaluate import measure_baselines

    problem, shape = _problem_shape(job)
    return measure_baselines(problem, shape, names=job.names, reps=job.reps)


def _bench_job(job: BenchJob) -> dict:
    from .bench import bench_candidate

    problem, shape = _problem_shape(job)
    raw = bench_candidate(problem, shape, job.config, job.compiled, reps=job.reps, seeds=job.seeds,
                          baselines=job.names)
    return {**raw, "device": {**device_info(), **gpu_clocks()}}


def _beside_job(job: BesideJob) -> dict:
    """search.finalists.measure_beside_best: the family's baselines, then each finalist gated and timed again, in this one
    process on the same inputs, then the finalists that passed and the baselines timed interleaved
    (bench.with_head_to_head): the run's best is the finalist with the fastest interleaved median, and the route
    compares it with the baselines' medians; timed one after the other, they carry an order bias as large as
    many of the differences they decide."""
    from .bench import kernels_beside_baselines

    problem, shape = _problem_shape(job)
    kernels = dict(zip(job.labels, zip(job.configs, job.compileds)))
    raw = kernels_beside_baselines(problem, shape, kernels, job.reps, job.seeds, job.names, baselines_first=True)
    return {"baselines": raw["baselines"], "finalists": raw["kernels"], "head_to_head": raw.get("head_to_head"),
            "device": {**device_info(), **gpu_clocks()}}


def _verify_job(job: VerifyJob) -> dict:
    """`evotune verify`: the search's gate and timed-output check (evaluate_launches), then bitwise
    determinism over many launches, all on one loaded module. `message` names the check that failed."""
    from ..build.compile import load_kernel
    from .evaluate import bind_kernel, check_determinism, evaluate_launches, kernel_runner
    from .plausibility import FLOORS

    problem, shape = _problem_shape(job)
    config = job.config
    kernel = load_kernel(job.compiled, problem.geometry(config, shape).dynamic_smem)
    res = FLOORS.judge(shape, evaluate_launches(problem, shape, bind_kernel(problem, shape, config, kernel),
                                                seeds=job.seeds, reps=job.reps))
    det_ok, det_msg = check_determinism(problem, shape, kernel_runner(problem, shape, config, kernel),
                                        launches=job.launches)
    return {"verification": res.verification, "determinism": {"passed": det_ok, "detail": det_msg},
            "message": res.message, "status": res.status}


_HANDLERS: dict[type[Job], Callable[[Job], dict]] = {
    InfoJob: _info_job, EvaluateJob: _evaluate_job, VerifyJob: _verify_job, BaselinesJob: _baselines_job,
    BenchJob: _bench_job, BesideJob: _beside_job}


def worker_jobs(conn):
    """The jobs the parent sends a worker, until it closes the pipe or sends None (the stop)."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        yield job


def _worker_process(main, conn, device: int) -> None:
    """A worker process's entry point: ignore SIGINT, then run `main` (normally _worker_main).

    Ctrl-C in a terminal signals the whole foreground process group. The search process
    handles it (records what finished, closes its workers); a worker that died of it instead
    would lose the answer in flight and leave a KeyboardInterrupt traceback in the output.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    main(conn, device)


def _worker_main(conn, device: int) -> None:
    import time

    entered = time.time()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    import warnings

    warnings.filterwarnings("ignore")  # baselines' chatter (SDPA's "kernel not used because")
    from .evaluate import Phases  # no torch or CuPy behind it

    phases = Phases()  # the start's own steps, for the search's timeline ("gpu start: ...")
    try:
        import cupy

        phases.lap("import cupy")
        import torch

        phases.lap("import torch")
        torch.cuda.set_device(device)
        cupy.cuda.Device(device).use()
        phases.lap("CUDA context")
    except Exception as e:
        conn.send(("fatal", f"GPU worker could not start on device {device}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", {"entered": entered, "phases": phases.as_dict(), "ready_at": time.time()}))
    for job in worker_jobs(conn):
        try:
            conn.send(("ok", builtin_data(_handle(job))))
        except Exception as e:
            conn.send(("error", {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}))
            return  # the CUDA context may be poisoned: let the parent start a fresh worker


class WorkerError(Exception):
    """A job that did not produce an answer: carries the Result status to record."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class GPUWorker:
    """One worker process bound to one GPU, restarted after faults, hangs and crashes."""

    def __init__(self, device: int = 0, timeout_s: float = 60.0):
        self.device = device
        self.timeout_s = timeout_s
        self._proc = None
        self._conn = None
        self._lost: WorkerError | None = None  # a job send() could not hand over: receive() raises it
        self.restarts = 0
        self.start_phases: dict[str, float] = {}  # seconds of the last start's steps (spawn, imports, context)
        self.info_seconds: dict[str, float] = {}  # seconds of the last info()'s parts (device_info)

    def _start(self) -> None:
        import time

        spawned = time.time()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        # _worker_main is looked up now, not at import: the CPU tests swap in stand-ins.
        proc = ctx.Process(target=_worker_process, args=(_worker_main, child, self.device), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(STARTUP_GRACE_S):
            proc.kill()
            raise WorkerError(R.CRASHED, f"GPU worker did not start within {STARTUP_GRACE_S:.0f} s")
        try:
            tag, payload = parent.recv()
        except EOFError:
            raise WorkerError(R.CRASHED, "GPU worker died while starting") from None
        if tag == "fatal":
            proc.join(5)
            from ..errors import NoGPUError

            raise NoGPUError(payload)
        self._proc, self._conn = proc, parent
        # Where the start went: the new interpreter and its imports up to the worker's entry (spawn), then the
        # worker's own steps. Stand-in workers report nothing.
        if isinstance(payload, dict):
            self.start_phases = {"spawn (interpreter, imports)": max(0.0, payload["entered"] - spawned),
                                 **payload["phases"]}
            if "ready_at" in payload:
                self.start_phases["ready message to the parent"] = max(0.0, time.time() - payload["ready_at"])

    def _stop(self, kill: bool) -> None:
        if self._proc is None:
            return
        if kill:
            self._proc.kill()
        self._proc.join(10)
        if not kill and self._proc.is_alive():  # busy (a kernel that never ends) though asked to exit: kill it
            self._proc.kill()
            self._proc.join(10)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def info(self) -> dict:
        """The device and versions (an InfoJob, starting the worker if needed); what their parts took goes to
        info_seconds."""
        import time

        self.send(InfoJob())
        sent = time.time()
        info = dict(self.receive())
        back = time.time()
        timing = info.pop(INFO_TIMING_KEY, {})
        self.info_seconds = dict(timing.get("seconds", {}))
        if "received" in timing:  # where the job's round trip went: to the worker, in it, back
            self.info_seconds.update({"job to the worker": max(0.0, timing["received"] - sent),
                                      "answer to the parent": max(0.0, back - timing["answered"])})
        return info

    def call(self, job: Job | dict, timeout_s: float | None = None):
        """Run one job (a Job, or its plain-data form); return its payload or raise WorkerError(status, message)."""
        self.send(job)
        return self.receive(timeout_s)

    def send(self, job: Job | dict) -> None:
        """Hand one job to the worker (starting it if needed) without waiting for the answer: receive() takes it.
        Meanwhile the caller may do other work (the search asks its next proposals while the GPU measures)."""
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self._stop(kill=True)
                self.restarts += 1
            try:
                self._start()
            except WorkerError as e:  # it never came up: receive() says so, as for a job it died on
                self._lost = e
                return
        try:
            self._conn.send(_wire(job))
        except (BrokenPipeError, OSError):
            self._stop(kill=True)
            self.restarts += 1
            self._lost = WorkerError(R.CRASHED, "GPU worker died before it took the job")
            return
        self._lost = None

    def receive(self, timeout_s: float | None = None):
        """The answer to the job send() handed over: its payload, or WorkerError(status, message)."""
        if self._lost is not None:
            lost, self._lost = self._lost, None
            raise lost
        if not self._conn.poll(timeout_s or self.timeout_s):
            self._stop(kill=True)
            self.restarts += 1
            raise WorkerError(R.TIMEOUT, f"no answer within {timeout_s or self.timeout_s:.0f} s (hang?); worker killed")
        try:
            tag, payload = self._conn.recv()
        except (EOFError, ConnectionResetError):
            if self._proc is not None:
                self._proc.join(2)  # the pipe closes before the process is reaped
            code = self._proc.exitcode if self._proc else None
            self._stop(kill=True)
            self.restarts += 1
            raise WorkerError(R.CRASHED, f"GPU worker died (exit code {code})") from None
        if tag == "error":
            self._stop(kill=False)
            self.restarts += 1
            raise WorkerError(R.LAUNCH_ERROR, payload["message"])
        return payload

    def evaluate(self, job: Job | dict) -> Result:
        """Evaluate one candidate; any failure becomes a Result with its status and reason."""
        self.send(job)
        return self.evaluated()

    def evaluated(self) -> Result:
        """The Result of the evaluation send() handed over; any failure becomes a Result with its status and reason."""
        try:
            return Result.from_dict(self.receive())
        except WorkerError as e:
            return Result(status=e.status, message=str(e))

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self._stop(kill=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
