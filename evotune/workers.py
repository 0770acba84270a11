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

from . import result as R
from .result import Result

# A fresh worker imports torch and CuPy and creates a context: allow for it once.
STARTUP_GRACE_S = 120.0


def _compiled_from_dict(d: dict):
    from .compile import Compiled, Resources

    return Compiled(key=d["key"], entry=d["entry"], arch=d["arch"], cubin_path=d["cubin_path"],
                    options=tuple(d["options"]), log=d["log"], resources=Resources(**d["resources"]),
                    compile_seconds=d["compile_seconds"], cached=d.get("cached", False))


def compiled_to_dict(c) -> dict:
    return {"key": c.key, "entry": c.entry, "arch": c.arch, "cubin_path": c.cubin_path, "options": list(c.options),
            "log": c.log, "resources": c.resources.as_dict(), "compile_seconds": c.compile_seconds, "cached": c.cached}


def device_info() -> dict:
    """What a run's meta.json records about the GPU and the software driving it."""
    import cupy
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver = cupy.cuda.runtime.driverGetVersion()
    return {
        "name": props.name,
        "sm": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "memory_gb": round(props.total_memory / 2**30, 1),
        "driver": _driver_string(),
        "cuda_driver_api": f"{driver // 1000}.{driver % 1000 // 10}",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
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


def _driver_string() -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except Exception:
        return "unknown"


def _handle(job: dict) -> dict:
    from .problems import get_problem
    from .space import Config

    kind = job["kind"]
    if kind == "info":
        return device_info()
    problem = get_problem(job["family"])
    shape = problem.shape_from_dict(job["shape"])
    if kind == "evaluate":
        from .evaluate import evaluate_compiled

        config = Config.from_dict(job["config"])
        res = evaluate_compiled(problem, shape, config, _compiled_from_dict(job["compiled"]),
                                seeds=tuple(job.get("seeds") or (1, 2, 3)), reps=job.get("reps", 40),
                                time_it=job.get("time_it", True))
        return res.as_dict()
    if kind == "verify":
        return _verify_job(problem, shape, job)
    if kind == "baselines":
        from .evaluate import measure_baselines

        return measure_baselines(problem, shape, names=job.get("names"), reps=job.get("reps", 40))
    if kind == "beside":
        return _beside_job(problem, shape, job)
    if kind == "bench":
        from .bench import bench_candidate

        raw = bench_candidate(problem, shape, Config.from_dict(job["config"]), _compiled_from_dict(job["compiled"]),
                              reps=job.get("reps", 100), seeds=tuple(job.get("seeds") or (1, 2, 3)),
                              baselines=job.get("names"))
        return {**raw, "device": {**device_info(), **gpu_clocks()}}
    raise ValueError(f"unknown job kind {kind!r}")


def _beside_job(problem, shape, job: dict) -> dict:
    """search.measure_beside_best: the family's baselines, then the given (best) config gated and timed
    again, in this one process on the same inputs, so that the two medians compare."""
    from .evaluate import evaluate_compiled, measure_baselines
    from .space import Config

    seeds = tuple(job.get("seeds") or (1, 2, 3))
    reps = job.get("reps", 100)
    base = measure_baselines(problem, shape, names=job.get("names"), seeds=seeds, reps=reps)
    res = evaluate_compiled(problem, shape, Config.from_dict(job["config"]), _compiled_from_dict(job["compiled"]),
                            seeds=seeds, reps=reps)
    return {"baselines": base, "evotune": res.as_dict(), "device": {**device_info(), **gpu_clocks()}}


# The deep check's timed-output check needs a timing, not a precise one: a few replays.
VERIFY_TIMING_REPS = 5


def _verify_job(problem, shape, job: dict) -> dict:
    """`evotune verify`: the search's gate and timed-output check (evaluate_launches), then bitwise
    determinism over many launches, all on one loaded module. `message` names the check that failed."""
    from .compile import load_kernel
    from .evaluate import bind_kernel, check_determinism, evaluate_launches, kernel_runner
    from .space import Config

    config = Config.from_dict(job["config"])
    compiled = _compiled_from_dict(job["compiled"])
    kernel = load_kernel(compiled, problem.geometry(config, shape).dynamic_smem)
    res = evaluate_launches(problem, shape, bind_kernel(problem, shape, config, kernel),
                            seeds=tuple(job.get("seeds") or (1, 2, 3)), reps=job.get("reps", VERIFY_TIMING_REPS))
    det_ok, det_msg = check_determinism(problem, shape, kernel_runner(problem, shape, config, kernel),
                                        launches=job.get("launches", 100))
    return {"verification": res.verification, "determinism": {"passed": det_ok, "detail": det_msg},
            "message": res.message}


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
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    import warnings

    warnings.filterwarnings("ignore")  # baselines' chatter (SDPA's "kernel not used because")
    try:
        import cupy
        import torch

        torch.cuda.set_device(device)
        cupy.cuda.Device(device).use()
    except Exception as e:
        conn.send(("fatal", f"GPU worker could not start on device {device}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        try:
            conn.send(("ok", _handle(job)))
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
        self.restarts = 0

    def _start(self) -> None:
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
            from .errors import NoGPUError

            raise NoGPUError(payload)
        self._proc, self._conn = proc, parent

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

    def call(self, job: dict, timeout_s: float | None = None):
        """Run one job; return its payload or raise WorkerError(status, message)."""
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self._stop(kill=True)
                self.restarts += 1
            self._start()
        try:
            self._conn.send(job)
        except (BrokenPipeError, OSError):
            self._stop(kill=True)
            self.restarts += 1
            raise WorkerError(R.CRASHED, "GPU worker died before it took the job") from None
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

    def evaluate(self, job: dict) -> Result:
        """Evaluate one candidate; any failure becomes a Result with its status and reason."""
        try:
            return Result.from_dict(self.call(job))
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
