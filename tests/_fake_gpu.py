"""A GPU clock in Python, for the CPU tests of interleaved timing (tests/test_interleave.py, test_bench.py).

`FakeGPU` advances a clock by each launch's cost, stretched by a slow drift (as the H100's clocks
drift over a bench); `FakeClock` stands in for evaluate.CUDA_EVENTS (events read only after a sync,
as CUDA requires); `cpu_prepare` stands in for evaluate.prepare_launches (warm-up, then a "graph" of
a fixed number of launches); `cpu_interleaved` is a time_interleaved for head_to_head's `timer`.
"""

from __future__ import annotations

from collections import Counter

from evotune.gpu.evaluate import Prepared
from evotune.gpu.interleave import time_interleaved

LAUNCHES_PER_REP = 4


class FakeGPU:
    """Each launch of contender `name` takes costs[name] us times (1 + drift * the clock's time in us)."""

    def __init__(self, costs: dict[str, float], drift: float = 0.0):
        self.costs, self.drift = costs, drift
        self.now = 0.0
        self.launches: Counter = Counter()
        self.sequence: list[str] = []  # the contender of every launch, in order

    def run(self, name: str) -> None:
        self.now += self.costs[name] * (1.0 + self.drift * self.now)
        self.launches[name] += 1
        self.sequence.append(name)

    def launcher(self, name: str, fn=None):
        """A launch of `name` (calling `fn` too, where given: a stand-in kernel's real work on the CPU)."""

        def launch():
            if fn is not None:
                fn()
            self.run(name)

        return launch


class FakeEvent:
    def __init__(self, clock: "FakeClock"):
        self.clock = clock
        self.serial = self.t = None

    def record(self) -> None:
        self.clock.recorded += 1
        self.serial, self.t = self.clock.recorded, self.clock.gpu.now


class FakeClock:
    """evaluate.CudaEvents on the FakeGPU: an event may be read only once a sync came after its record."""

    def __init__(self, gpu: FakeGPU):
        self.gpu = gpu
        self.recorded = self.synced = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def elapsed_us(self, start: FakeEvent, end: FakeEvent) -> float:
        assert start.serial is not None and end.serial is not None and end.serial <= self.synced, "read before sync"
        return end.t - start.t

    def sync(self) -> None:
        self.synced = self.recorded


def cpu_prepare(fn, warmup: int = 10) -> Prepared:
    """evaluate.prepare_launches on the CPU: `warmup` launches, then a replay of LAUNCHES_PER_REP launches."""
    for _ in range(warmup):
        fn()

    def replay():
        for _ in range(LAUNCHES_PER_REP):
            fn()

    return Prepared(replay, LAUNCHES_PER_REP, "cpu-stand-in")


def cpu_interleaved(gpu: FakeGPU):
    """A `timer(fns, rounds=, reps_per_round=)` for interleave.head_to_head: time_interleaved on `gpu`'s
    clock, each fn (a stand-in kernel or baseline that works on the CPU) costing its name's time."""

    def timer(fns, rounds, reps_per_round):
        return time_interleaved({n: gpu.launcher(n, fn) for n, fn in fns.items()}, rounds=rounds,
                                reps_per_round=reps_per_round, prepare=cpu_prepare, clock=FakeClock(gpu),
                                settle_us=0.0)  # one settling replay a turn: the stand-ins do real CPU work

    return timer
