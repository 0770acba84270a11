"""Stand-ins for evotune.workers._worker_main, for tests/test_workers.py.

They live in their own importable module because the spawn start method pickles a
process target by its qualified name, and the child then imports it: keeping them
out of the test module keeps the child's imports small (no pytest, no torch).
Each follows the real worker's protocol: ("ready", None) or ("fatal", msg) first,
then one answer per job, ("ok", payload) or ("error", {"message", "traceback"}).
"""

from __future__ import annotations

import os
import time


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
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
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
