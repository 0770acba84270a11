"""A stand-in GPU worker for the planted-fault family that also answers the faults the gate's
launch-integrity checks catch (tests/fault_family.py GATE_FAULTS), for tests/test_faults.py.

It wraps tests/_fake_workers.fault_worker: evaluate jobs of those faults are answered here, as the
real worker answers them on the GPU (WRONG, the message CAUGHT_AS gives); every other job goes on
to fault_worker unchanged. Like _fake_workers, it is importable by a spawned child without pytest.
"""

from __future__ import annotations

import os

import _fake_workers as fake


def gate_fault_answer(fault: str) -> dict:
    """The Result (as a dict) the real worker gives for a fault the launch-integrity checks catch."""
    from evotune.records.result import WRONG, Result
    from tests.fault_family import CAUGHT_AS

    caught = CAUGHT_AS[fault]
    caught = caught if isinstance(caught, str) else caught[0]  # a fault either of two checks may catch first
    return Result(status=WRONG, message=caught + "(as the GPU worker words it)",
                  extra={"pid": os.getpid()}).as_dict()


class _AnswersGateFaults:
    """The worker's end of the pipe, answering the gate faults' evaluate jobs itself."""

    def __init__(self, conn):
        self._conn = conn

    def send(self, message) -> None:
        self._conn.send(message)

    def recv(self):
        from tests.fault_family import GATE_FAULTS

        while True:
            job = self._conn.recv()
            fault = job.get("config", {}).get("fault") if isinstance(job, dict) else None
            if fault not in GATE_FAULTS:
                return job
            self._conn.send(("ok", gate_fault_answer(fault)))


def gate_fault_worker(conn, device: int) -> None:
    """fault_worker, with the gate faults answered as the real worker answers them."""
    fake.fault_worker(_AnswersGateFaults(conn), device)
