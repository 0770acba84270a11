"""Stand-ins for evotune.gpu.workers._worker_main, for tests/test_workers.py.

They live in their own importable module because the spawn start method pickles a
process target by its qualified name, and the child then imports it: keeping them
out of the test module keeps the child's imports small (no pytest, no torch).
Each follows the real worker's protocol: ("ready", None) or ("fatal", msg) first,
then one answer per job, ("ok", payload) or ("error", {"message", "traceback"}).
"""

from __future__ import annotations

import os
import time

from evotune.gpu.workers import worker_jobs


def hang_worker(conn, device: int) -> None:
    """Starts, takes a job, and never answers (a kernel that spins forever)."""
    conn.send(("ready", None))
    conn.recv()
    while True:
        time.sleep(60)


def crash_worker(conn, device: int) -> None:
    """Starts, then dies on the first job without answering (a segfault in the driver)."""
    conn.send(("ready", None))
    conn.recv()
    os._exit(3)


def error_worker(conn, device: int) -> None:
    """Answers "pid" jobs with its process id; answers "fail" jobs with an error and exits, like the real worker."""
    conn.send(("ready", None))
    for job in worker_jobs(conn):
        if job["kind"] == "pid":
            conn.send(("ok", {"pid": os.getpid(), "device": device}))
        else:
            conn.send(("error", {"message": "CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access",
                                 "traceback": "Traceback (most recent call last): ..."}))
            return


def die_at_start_worker(conn, device: int) -> None:
    """Exits before saying it is ready (an import that kills the interpreter)."""
    os._exit(5)


def slow_start_worker(conn, device: int) -> None:
    """Takes longer to start than any grace the test allows."""
    time.sleep(60)


def fatal_worker(conn, device: int) -> None:
    """Reports that it cannot use the GPU, as the real worker does on a machine without one."""
    conn.send(("fatal", f"GPU worker could not start on device {device}: RuntimeError: no CUDA GPUs are available"))


# The reason the real worker gives for the planted out-of-bounds store (torch's wording).
ILLEGAL_ADDRESS = "AcceleratorError: CUDA error: an illegal memory access was encountered"


def fault_worker(conn, device: int) -> None:
    """Answers `evaluate` jobs of the planted-fault family (tests/fault_family.py) as the real worker
    does on the GPU: hangs on `hang`, answers an illegal address and exits on `oob_write`, fails the
    gate on `wrong_values` and `unwritten`, passes on `none`. The fault named by the environment
    variable EVOTUNE_FAKE_CRASH_ON kills the process instead (a driver segfault). Every answer
    carries the answering process id in `extra`, so a test can tell a fresh worker from the old one."""
    from evotune.records.result import Result

    conn.send(("ready", None))
    crash_on = os.environ.get("EVOTUNE_FAKE_CRASH_ON")
    for job in worker_jobs(conn):
        if job["kind"] == "pid":
            conn.send(("ok", {"pid": os.getpid()}))
            continue
        config = job["config"]
        fault = config.get("fault", "none")
        extra = {"pid": os.getpid()}
        if fault == crash_on:
            os._exit(3)
        if fault == "hang":
            while True:
                time.sleep(60)
        if fault == "oob_write":
            conn.send(("error", {"message": ILLEGAL_ADDRESS, "traceback": "Traceback (most recent call last): ..."}))
            return  # a sticky CUDA error: the real worker exits after answering
        if fault == "none":
            t = 10.0 + config["block_m"] / 100 + config.get("warp_key_groups", 1) / 10
            res = Result(status="ok", time_us=t, max_abs=1e-4, extra=extra,
                         timing={"median_us": t, "p10_us": t, "p90_us": t, "reps": 5, "launches_per_rep": 10,
                                 "method": "fake"})
        elif fault == "wrong_values":  # faster than any that passes, and wrong
            res = Result(status="wrong", message="error 215x the gate in seed 1 normal", time_us=1.0, max_abs=0.4,
                         extra=extra)
        elif fault == "unwritten":
            res = Result(status="wrong", message="4096 non-finite outputs (NaN poison left or computed) in seed 1 normal",
                         max_abs=float("inf"), extra=extra)
        else:
            conn.send(("error", {"message": f"fault {fault!r} should never reach a worker", "traceback": ""}))
            return
        conn.send(("ok", res.as_dict()))


def timed_start_worker(conn, device: int) -> None:
    """Starts as the real worker reports its start (when it was entered, its own steps' seconds), then answers
    every job with {"name": "stand-in"} and its "_timing" (as an InfoJob's device info and timing)."""
    entered = time.time()
    time.sleep(0.2)
    conn.send(("ready", {"entered": entered, "phases": {"import torch": 0.2}}))
    for _ in worker_jobs(conn):
        time.sleep(0.1)
        conn.send(("ok", {"name": "stand-in", "_timing": {"seconds": {"cuDNN version": 0.05}}}))
