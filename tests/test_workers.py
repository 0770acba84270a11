"""Tests for evotune.gpu.workers on the CPU: the job payload of a compiled kernel, and how
GPUWorker turns a hang, a crash, a CUDA error and a failed start into a recorded status.

The real worker needs a GPU; here `_worker_main` is replaced by the stand-ins in
tests/_fake_workers.py (spawned processes that follow the same pipe protocol), except in
the test of the real worker on this GPU-less machine.
"""

from __future__ import annotations

import json
import os
import pickle
import time

import _fake_workers as fake
import pytest

from evotune.records import result as R
from evotune.gpu import workers
from evotune.build.compile import Compiled, Resources
from evotune.errors import EvotuneError, NoGPUError
from evotune.search.loop import worker_evaluator
from evotune.space.searchspace import Config
from evotune.gpu.workers import GPUWorker, WorkerError, _compiled_from_dict, compiled_to_dict

TIMEOUT_S = 1.0


def _compiled() -> Compiled:
    return Compiled(key="0123456789abcdef01234567", entry="evotune_attention", arch="sm_90a",
                    cubin_path="/tmp/cache/cubin/0123456789abcdef01234567.cubin",
                    options=("--gpu-architecture=sm_90a", "-std=c++17", "--ptxas-options=-v", "-lineinfo"),
                    log="ptxas info    : Used 136 registers\n",
                    resources=Resources(registers=136, static_smem=0, stack_frame=0, spill_stores=0, spill_loads=0,
                                        barriers=1),
                    compile_seconds=0.42, cached=True)


@pytest.fixture
def worker_with(monkeypatch):
    """A factory for a GPUWorker whose process runs the given stand-in; every worker made is closed afterwards."""
    made = []

    def make(target, timeout_s=TIMEOUT_S):
        monkeypatch.setattr(workers, "_worker_main", target)
        w = GPUWorker(device=0, timeout_s=timeout_s)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


# ------------------------------------------------------------------ payloads


def test_compiled_round_trip():
    """compiled_to_dict then _compiled_from_dict gives back an equal Compiled, cached flag and options tuple included."""
    c = _compiled()
    d = compiled_to_dict(c)
    back = _compiled_from_dict(json.loads(json.dumps(d)))  # plain data: survives JSON, so surely the pipe's pickle
    assert back == c
    assert back.cached is True and isinstance(back.options, tuple) and isinstance(back.resources, Resources)
    assert pickle.loads(pickle.dumps(d)) == d


def test_compiled_from_dict_defaults_cached_to_false():
    """A payload without the `cached` key (an older record) reads back as not cached."""
    d = compiled_to_dict(_compiled())
    del d["cached"]
    assert _compiled_from_dict(d).cached is False


def test_worker_evaluator_job(attention, space, mission):
    """worker_evaluator sends one plain-data `evaluate` job with family, shape, config, compiled kernel, seeds and reps."""

    class Recorder:
        def __init__(self):
            self.jobs = []

        def evaluate(self, job):
            self.jobs.append(job)
            return R.Result(status=R.OK, time_us=5.0, max_abs=1e-4)

    rec = Recorder()
    cfg = space.default_config()
    res = worker_evaluator(rec, attention, mission, seeds=(7, 8), reps=5)(cfg, _compiled())
    assert res.status == R.OK and res.time_us == 5.0
    (job,) = rec.jobs
    assert job["kind"] == "evaluate" and job["family"] == "attention"
    assert job["shape"] == mission.as_dict() and job["config"] == cfg.as_dict()
    assert Config.from_dict(job["config"]) == cfg
    assert _compiled_from_dict(job["compiled"]) == _compiled()
    assert job["seeds"] == [7, 8] and job["reps"] == 5
    json.dumps(job)  # nothing but plain data crosses the pipe


# ------------------------------------------------------------------ the real worker without a GPU


def test_real_worker_without_gpu_raises_no_gpu_error():
    """On a machine without a GPU the real worker reports it could not start, and call() raises NoGPUError."""
    w = GPUWorker(device=0, timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(NoGPUError, match="GPU worker could not start on device 0") as info:
            w.call({"kind": "info"})
    finally:
        w.close()
    # The worker said so (its `fatal` message), it was not waited out: a start past STARTUP_GRACE_S is a
    # WorkerError(CRASHED) "did not start within", never a NoGPUError.
    assert "did not start within" not in str(info.value)
    assert w._proc is None


def test_fatal_start_is_no_gpu_error_not_a_result(worker_with):
    """A worker that reports `fatal` raises NoGPUError from evaluate() too: a missing GPU is not a candidate's status."""
    w = worker_with(fake.fatal_worker)
    with pytest.raises(NoGPUError, match="no CUDA GPUs are available") as info:
        w.evaluate({"kind": "evaluate"})
    assert isinstance(info.value, EvotuneError) and info.value.exit_code == 1


# ------------------------------------------------------------------ hang, crash, CUDA error


def test_hang_becomes_timeout(worker_with):
    """A job that gets no answer within timeout_s is a TIMEOUT result, and the hung worker is killed."""
    w = worker_with(fake.hang_worker)
    proc_box = {}
    orig_start = w._start

    def start_and_keep():
        orig_start()
        proc_box["proc"] = w._proc

    w._start = start_and_keep
    start = time.monotonic()
    res = w.evaluate({"kind": "evaluate"})
    waited = time.monotonic() - start
    assert res.status == R.TIMEOUT and not res.ok
    assert f"no answer within {TIMEOUT_S:.0f} s" in res.message and "killed" in res.message
    assert waited >= TIMEOUT_S  # it gave the job its whole timeout (a lower bound: no speed is asserted)
    assert w.restarts == 1 and w._proc is None
    assert not proc_box["proc"].is_alive()


def test_call_timeout_argument_overrides_default(worker_with):
    """call(job, timeout_s=...) waits that long rather than the worker's default, and raises WorkerError(TIMEOUT)."""
    w = worker_with(fake.hang_worker, timeout_s=30)
    with pytest.raises(WorkerError) as info:
        w.call({"kind": "evaluate"}, timeout_s=1)
    assert info.value.status == R.TIMEOUT
    assert "no answer within 1 s" in str(info.value)  # the argument's timeout, not the default 30 s


def test_crash_becomes_crashed(worker_with):
    """A worker that dies mid-job is a CRASHED result naming the death, and the next job gets a fresh worker."""
    w = worker_with(fake.crash_worker)
    res = w.evaluate({"kind": "evaluate"})
    assert res.status == R.CRASHED
    assert res.message.startswith("GPU worker died")
    assert w.restarts == 1 and w._proc is None
    again = w.evaluate({"kind": "evaluate"})  # a new process, which dies the same way
    assert again.status == R.CRASHED and w.restarts == 2


def test_error_answer_becomes_launch_error_and_fresh_worker(worker_with):
    """An ("error", ...) answer is LAUNCH_ERROR with the worker's message; the worker exits and the next call starts a new one."""
    w = worker_with(fake.error_worker)
    first_pid = w.call({"kind": "pid"})["pid"]
    assert w.call({"kind": "pid"})["pid"] == first_pid  # healthy: the same process answers again
    assert w.restarts == 0

    res = w.evaluate({"kind": "evaluate"})
    assert res.status == R.LAUNCH_ERROR
    assert res.message == "CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access"
    assert w.restarts == 1 and w._proc is None

    second = w.call({"kind": "pid"})
    assert second["pid"] != first_pid and second["device"] == 0
    assert w.restarts == 1  # a planned restart after an error is counted once


def test_worker_error_carries_status(worker_with):
    """call() raises WorkerError whose .status is the Result status to record and whose text is the reason."""
    w = worker_with(fake.error_worker)
    with pytest.raises(WorkerError, match="illegal memory access") as info:
        w.call({"kind": "fail"})
    assert info.value.status == R.LAUNCH_ERROR


# ------------------------------------------------------------------ failed starts


def test_death_during_start_is_crashed(worker_with):
    """A worker that exits before saying it is ready raises WorkerError(CRASHED), and evaluate() records it."""
    w = worker_with(fake.die_at_start_worker)
    with pytest.raises(WorkerError, match="died while starting") as info:
        w.call({"kind": "evaluate"})
    assert info.value.status == R.CRASHED
    assert w.evaluate({"kind": "evaluate"}).status == R.CRASHED


def test_start_past_grace_is_crashed(worker_with, monkeypatch):
    """A worker silent for the whole startup grace is killed and reported as CRASHED."""
    monkeypatch.setattr(workers, "STARTUP_GRACE_S", 1.0)
    w = worker_with(fake.slow_start_worker)
    res = w.evaluate({"kind": "evaluate"})
    assert res.status == R.CRASHED and "did not start within 1 s" in res.message  # the patched grace, not 120 s
    assert w._proc is None


def test_close_is_idempotent_and_stops_the_worker(worker_with):
    """close() asks a live worker to exit and can be called again; a context manager closes too."""
    w = worker_with(fake.error_worker)
    w.call({"kind": "pid"})
    proc = w._proc
    w.close()
    assert w._proc is None and not proc.is_alive() and proc.exitcode == 0  # it left its loop, it was not killed
    w.close()
    with worker_with(fake.error_worker) as w2:
        w2.call({"kind": "pid"})
        proc2 = w2._proc
    assert not proc2.is_alive() and w2._proc is None


# ------------------------------------------------------------------ Ctrl-C


def _ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT, from the SigIgn mask in /proc/<pid>/status."""
    import signal

    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    raise AssertionError("no SigIgn line")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads signal masks from /proc")
def test_worker_ignores_sigint(worker_with):
    """A worker ignores SIGINT (Ctrl-C reaches the whole process group; the search process handles it) and keeps answering."""
    import signal

    w = worker_with(fake.error_worker)
    pid = w.call({"kind": "pid"})["pid"]
    assert _ignores_sigint(pid)
    os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    assert w._proc.is_alive() and w.call({"kind": "pid"})["pid"] == pid
    assert w.restarts == 0
    w.close()
    assert w._proc is None


# ------------------------------------------------------------------ where a worker's start goes


def test_start_phases_reach_the_search_timeline(worker_with):
    """A worker that reports its start (entry time, its own steps) gives the search's timeline its parts: the
    spawn up to its entry, each step, the device info's parts, and the rest (the pipe, waits); they add up to the whole."""
    from evotune.cli.search import _start_worker
    from evotune.timeline import Timeline

    w = worker_with(fake.timed_start_worker)
    timeline = Timeline()
    assert _start_worker(w, timeline) == {"name": "stand-in"}
    phases = {name: s for name, (s, _) in timeline.phases.items()}
    total = phases.pop("GPU worker start (in the background)")
    assert set(phases) == {"gpu start: spawn (interpreter, imports)", "gpu start: import torch",
                           "gpu start: device info: cuDNN version", "gpu start: the rest"}
    assert phases["gpu start: import torch"] == 0.2 and phases["gpu start: device info: cuDNN version"] == 0.05
    assert phases["gpu start: spawn (interpreter, imports)"] > 0.0 and phases["gpu start: the rest"] >= 0.05
    assert abs(sum(phases.values()) - total) < 1e-6


def test_stand_in_without_start_report_has_no_phases(worker_with):
    """A worker that reports nothing of its start (the protocol's ("ready", None)) leaves start_phases empty, so
    the timeline gets only the whole start."""
    w = worker_with(fake.error_worker)
    assert w.call({"kind": "pid"})["pid"] == w._proc.pid
    assert w.start_phases == {}


@pytest.mark.parametrize("text, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct  2 10:00:00 UTC 2025\n"
     "GCC version:  gcc version 11.4.0\n", "580.159.04"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  (dvs-builder@U16)\n",
     "570.86.15"),
    ("no driver here\n", None),
])
def test_driver_version_from_proc(text, version):
    """The driver version is read from /proc/driver/nvidia/version's text (proprietary and open modules) instead
    of starting nvidia-smi; text without it gives None (nvidia-smi is asked then)."""
    assert workers.driver_from_proc(text) == version


def test_answers_are_builtin_data():
    """What the worker sends back unpickles without importing anything: str subclasses (torch.__version__ is one,
    and unpickling it imported torch into the search process), numpy scalars and named tuples become builtins."""
    import pickletools
    from collections import namedtuple

    import numpy as np

    class Version(str):
        pass

    Pair = namedtuple("Pair", "a b")
    answer = {"torch": Version("2.11.0+cu130"), "cudnn": np.int64(91900), "t": np.float32(5.5), "ok": np.bool_(True),
              "seeds": (1, 2), "nested": [{"v": Version("x")}], "pair": Pair(1, 2), "none": None, "flag": True}
    plain = workers.builtin_data(answer)
    assert plain == {"torch": "2.11.0+cu130", "cudnn": 91900, "t": 5.5, "ok": True, "seeds": (1, 2),
                     "nested": [{"v": "x"}], "pair": [1, 2], "none": None, "flag": True}
    assert type(plain["torch"]) is str and type(plain["cudnn"]) is int and type(plain["t"]) is float
    globals_named = [arg for op, arg, _ in pickletools.genops(pickle.dumps(plain)) if "GLOBAL" in op.name]
    assert globals_named == []
